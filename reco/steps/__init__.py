"""Optimization steps: each turns a parent Variant into a child Variant, all through one signature.

    @register("prune", PruneConfig)
    def run(parent: Variant | None, data: Dataset, cfg: PruneConfig, ctx: StepRun) -> Variant

`cfg` is the step's typed config: conf/step/<name>.yaml (schema-checked by Hydra) merged with the
variant's overrides from the variant graph. `ctx` says where the child goes (`ctx.out_dir`), its name and
the shared trainer settings. A step builds its child with `child_variant` and writes only into
`ctx.out_dir`; the parent's directory is never touched. Every module of this package is imported by
`steps()`, so a new lever is one module that registers itself plus one YAML under conf/step/.
"""

from reco.steps.registry import (
    StepError,
    StepRun,
    StepSpec,
    child_variant,
    get_step,
    register,
    require_artifact,
    steps,
)

__all__ = [
    "StepError",
    "StepRun",
    "StepSpec",
    "child_variant",
    "get_step",
    "register",
    "require_artifact",
    "steps",
]
