"""Variants x servings: which model is served how in a study, and the report row each pair becomes.

A Variant is a model; how it is served (reco's server with or without its dynamic batcher, Triton with N
instances and its batcher) is a property of the study (loadtest.study.servings), not a step: no model
file is copied to serve it another way. The pair's label is the variant's name for the serving named
`reco` (reco's server as conf/serve configures it) and `<variant>_<serving>` otherwise, e.g.
`distilled_onnx_int8_batched`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from reco.config import ConfigError
from reco.loadtest.config import ServingConfig
from reco.serve.config import ServeConfig
from reco.variant import Variant

DEFAULT = "reco"  # the serving whose rows carry the bare variant name


@dataclass(frozen=True)
class Served:
    """One row of a study: `variant` served as `serving` says, reported as `label`."""

    label: str
    variant: Variant
    serving_name: str
    serving: ServingConfig

    def settings(self, serve: ServeConfig) -> ServeConfig:
        """`serve` with this serving applied (backend, batcher on/off, Triton instances, feature store,
        user once per request)."""
        s = self.serving
        triton = serve.triton
        if s.instances is not None:
            triton = dataclasses.replace(triton, instances=s.instances)
        batching = dataclasses.replace(serve.batching, enabled=s.batching)
        return dataclasses.replace(
            serve,
            backend=s.backend,
            batching=batching,
            triton=triton,
            features=serve.features if s.features is None else s.features,
            user_once=serve.user_once if s.user_once is None else s.user_once,
        )

    def as_variant(self) -> Variant:
        """The row's record for the report: the variant itself, or for another serving a copy named
        `label` whose lineage says how it is served (the model, metrics and files are the variant's)."""
        if self.serving_name == DEFAULT:
            return self.variant
        return dataclasses.replace(
            self.variant,
            name=self.label,
            parent=self.variant.name,
            step=f"serving {self.serving_name}",
            metrics=dict(self.variant.metrics),
        )


def label(variant: str, serving: str) -> str:
    return variant if serving == DEFAULT else f"{variant}_{serving}"


def pairs(names: list[str], servings: dict[str, ServingConfig]) -> list[tuple[str, str, ServingConfig]]:
    """(variant, serving name, serving) of every pair the study config asks for, variant by variant in the
    given order: what `cross` serves and what the report's rows are named after (reco.experiment checks a
    headline against them before anything runs).

    With no servings configured every variant is served by reco's server as conf/serve configures it.
    Raises ConfigError naming loadtest.study.servings.<name> when a label collides with a variant's name.
    """
    servings = servings or {DEFAULT: ServingConfig()}
    out = []
    for n in names:
        for s_name, s in servings.items():
            if s.variants is not None and n not in s.variants:
                continue
            if s_name != DEFAULT and (lab := label(n, s_name)) in names:
                raise ConfigError(
                    f"loadtest.study.servings.{s_name}: the row {lab!r} would clash with the variant {lab!r}"
                )
            out.append((n, s_name, s))
    return out


def cross(variants: list[tuple[str, Variant]], servings: dict[str, ServingConfig]) -> list[Served]:
    """Every (variant, serving) pair the study config asks for as a Served row (see `pairs`)."""
    by_name = dict(variants)
    return [
        Served(label(n, s_name), by_name[n], s_name, s) for n, s_name, s in pairs(list(by_name), servings)
    ]
