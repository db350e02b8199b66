"""Walk an experiment's variant graph: build, measure, serve, load-test, track, report.

Finished variants are cached by a content hash of (step, step config, parent's hash, data
fingerprint, trainer/model config), so an interrupted experiment re-run redoes only what changed or
never finished. A failed variant is marked failed in MLflow and in the report; the rest go on.
"""

from __future__ import annotations

import hashlib
import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from reco.data import load_dataset
from reco.data.schema import Dataset
from reco.measure import evaluate, rank_latency
from reco.runtime import load_scorer
from reco.tracking import Tracker, environment_tags, flatten
from reco.train.loop import TrainConfig
from reco.variant import Variant

CACHE_VERSION = 1
STEPS = ("train", "prune", "distill", "accelerate", "batching")


class ConfigError(ValueError):
    pass


@dataclass
class Node:
    """One entry of the variant graph and what became of it."""

    name: str
    step: str
    parent: str | None
    step_cfg: dict
    variant: Variant | None = None
    error: str = ""
    run_id: str = ""
    cached: bool = False
    load: dict = field(default_factory=dict)  # load-test outcome (see reco.loadtest)


def plan(c: dict) -> list[Node]:
    """Validate `variants` and order it parents-first."""
    specs = c.get("variants") or {}
    if not specs:
        raise ConfigError(
            "variants: the experiment defines no variants (expected at least {baseline: {step: train}})"
        )
    nodes: dict[str, Node] = {}
    for name, spec in specs.items():
        spec = dict(spec or {})
        step = spec.pop("step", None)
        parent = spec.pop("parent", None)
        if step not in STEPS:
            raise ConfigError(f"variants.{name}.step: expected one of {STEPS}, got {step!r}")
        if step == "train" and parent:
            raise ConfigError(f"variants.{name}.parent: a train step has no parent (got {parent!r})")
        if step != "train" and parent not in specs:
            raise ConfigError(
                f"variants.{name}.parent: {parent!r} is not a variant of this experiment (have {sorted(specs)})"
            )
        base = c.get(step, {}) if step != "train" else {}
        step_cfg = OmegaConf.to_container(OmegaConf.merge(base, spec), resolve=True)
        nodes[name] = Node(name, step, parent, step_cfg)
    order: list[Node] = []
    state: dict[str, int] = {}

    def visit(n: str, path: tuple[str, ...]) -> None:
        if state.get(n) == 2:
            return
        if state.get(n) == 1:
            raise ConfigError(f"variants: cycle through {' -> '.join((*path, n))}")
        state[n] = 1
        if nodes[n].parent:
            visit(nodes[n].parent, (*path, n))
        state[n] = 2
        order.append(nodes[n])

    for n in nodes:
        visit(n, ())
    return order


def trainer_config(c: dict, out_dir: Path) -> TrainConfig:
    t = dict(c["trainer"])
    t["checkpoint_dir"] = t.get("checkpoint_dir") or str(out_dir / "checkpoints")
    return TrainConfig(**t)


def cache_key(node: Node, parent: Variant | None, data: Dataset, c: dict) -> str:
    src: dict = {"v": CACHE_VERSION, "step": node.step, "cfg": node.step_cfg, "data": data.fingerprint}
    src["parent"] = parent.cache_key if parent else None
    if node.step in ("train", "prune", "distill"):
        src["trainer"] = {k: v for k, v in c["trainer"].items() if k not in ("progress", "checkpoint_dir")}
    if node.step == "train":
        src["model"] = c["model"]
    return hashlib.sha256(json.dumps(src, sort_keys=True, default=str).encode()).hexdigest()[:16]


def build(
    node: Node, parent: Variant | None, data: Dataset, c: dict, out_dir: Path, tracker: Tracker
) -> Variant:
    trainer = trainer_config(c, out_dir)

    def on_epoch(epoch: int, row: dict[str, float]) -> None:
        tracker.log(node.run_id, metrics=row, step=epoch)

    if node.step == "train":
        from reco.train import baseline

        return baseline.run(data, c["model"], out_dir, trainer, node.name, on_epoch)
    assert parent is not None
    if node.step == "batching":
        from reco.steps import batching

        return batching.run(parent, node.step_cfg, out_dir, node.name)
    if node.step == "prune":
        from reco.steps import prune as step
    elif node.step == "distill":
        from reco.steps import distill as step
    else:
        from reco.steps import accelerate as step
    return step.run(parent, data, node.step_cfg, out_dir, trainer, node.name)


def measure(v: Variant, data: Dataset, c: dict, accuracy: bool) -> None:
    """Accuracy through the variant's own runtime; in-process ranking latency at serving threads."""
    if accuracy:
        v.metrics.update(evaluate(load_scorer(v, threads=c["trainer"]["threads"]), data.test))
    scorer = load_scorer(v, threads=c["serve"]["intra_op_threads"])
    v.metrics.update(
        rank_latency(
            scorer,
            data.test,
            n_candidates=c["serve"]["n_candidates"],
            repeats=c["benchmark"]["repeats"],
            warmup=c["benchmark"]["warmup"],
            seed=c["seed"],
        )
    )


def _variant_dir(c: dict, name: str, key: str) -> Path:
    return Path(c["cache_dir"]) / "variants" / f"{name}-{key}"


def _log_variant(tracker: Tracker, node: Node, v: Variant, log_models: bool) -> None:
    params = flatten(
        {
            "variant": v.name,
            "parent": v.parent or "",
            "step": v.step,
            "backend": v.backend,
            "step_config": v.step_config,
        }
    )
    sizes = {"params": v.params, "size_mb": v.size_mb, "flops_per_candidate": v.flops_per_candidate}
    tracker.log(node.run_id, metrics={**v.metrics, **sizes}, params=params, tags={"cache_key": v.cache_key})
    files = [v.path / "variant.json"]
    if log_models:
        files += [v.path / f for f in v.artifacts.values()]
    tracker.log_artifacts(node.run_id, files, "variant")


def build_all(nodes: list[Node], data: Dataset, c: dict, tracker: Tracker, parent_run: str) -> None:
    by_name = {n.name: n for n in nodes}
    for i, node in enumerate(nodes, 1):
        parent = by_name[node.parent].variant if node.parent else None
        print(
            f"\n[variant {i}/{len(nodes)}] {node.name}: {node.step}"
            + (f" from {node.parent}" if node.parent else ""),
            flush=True,
        )
        node.run_id = tracker.start_run(
            node.name,
            parent_id=parent_run,
            tags={"variant": node.name, "parent_variant": node.parent or "", "step": node.step},
        )
        if node.parent and parent is None:
            node.error = (
                f"parent variant {node.parent!r} failed: {by_name[node.parent].error.splitlines()[0]}"
            )
            print(f"  skipped: {node.error}", flush=True)
            tracker.log(node.run_id, tags={"error": node.error, "status": "skipped"})
            tracker.end(node.run_id, failed=True)
            continue
        key = cache_key(node, parent, data, c)
        out_dir = _variant_dir(c, node.name, key)
        t0 = time.time()
        try:
            if (out_dir / "variant.json").exists() and "auc" in (cached := Variant.load(out_dir)).metrics:
                v, node.cached = cached, True
                print(f"  reusing finished variant {out_dir} (same config and inputs)", flush=True)
            else:
                v = build(node, parent, data, c, out_dir, tracker)
                v.cache_key, v.data_fingerprint = key, data.fingerprint
            measure(v, data, c, accuracy=not node.cached)
            v.mlflow_run_id = node.run_id
            v.save()
            node.variant = v
            _log_variant(tracker, node, v, c["tracking"]["log_models"])
            tracker.log(node.run_id, tags={"status": "ok", "cached": str(node.cached)})
            tracker.end(node.run_id)
            m = v.metrics
            print(
                f"  {node.name}: auc {m.get('auc', float('nan')):.4f}  params {v.params:,}  size {v.size_mb:.1f} MB  "
                f"rank p50 {m.get('rank_p50_ms', float('nan')):.2f} ms  ({time.time() - t0:.0f} s)",
                flush=True,
            )
        except Exception as e:  # a failed variant must not stop the comparison
            node.error = f"{type(e).__name__}: {e}"
            print(f"  FAILED: {node.error}", flush=True)
            tracker.log(node.run_id, tags={"error": node.error[:5000], "status": "failed"})
            (Path(c["cache_dir"]) / "failed").mkdir(parents=True, exist_ok=True)
            (Path(c["cache_dir"]) / "failed" / f"{node.name}.txt").write_text(traceback.format_exc())
            tracker.end(node.run_id, failed=True)


def run(cfg: DictConfig) -> list[Node]:
    from hydra.core.hydra_config import HydraConfig

    c = OmegaConf.to_container(cfg, resolve=True)
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode.name == "MULTIRUN"
    nodes = plan(c)  # config errors before anything slow
    tracker = Tracker(c["tracking"]["uri"], c["experiment_name"], c["tracking"]["artifact_root"])
    overrides = [o for o in hc.overrides.task if not o.startswith("experiment=")]
    run_name = c["experiment_name"] + (f" [{', '.join(overrides)}]" if overrides else "")
    tags = {**environment_tags(), "experiment": c["experiment_name"], "overrides": " ".join(overrides)}
    if multirun:
        tags["multirun.sweep_dir"] = hc.sweep.dir
    parent_run = tracker.start_run(run_name, tags=tags)
    print(
        f"MLflow: experiment {c['experiment_name']!r}, parent run {parent_run} ({c['tracking']['uri']})",
        flush=True,
    )
    failed = True
    try:
        tracker.log(parent_run, params=flatten({k: v for k, v in c.items() if k != "hydra"}))
        (out_dir / "resolved_config.yaml").write_text(OmegaConf.to_yaml(c))
        tracker.log_artifacts(parent_run, [out_dir / "resolved_config.yaml"])

        print("[data] loading " + str(c["data"].get("loader")), flush=True)
        data, data_path = load_dataset(c["data"], Path(c["cache_dir"]) / "data")
        print(
            f"[data] {data.name}: train {len(data.train):,} val {len(data.val):,} test {len(data.test):,} rows, "
            f"fingerprint {data.fingerprint}, skipped {data.skipped or 'none'}, padded {data.padded or 'none'}",
            flush=True,
        )
        tracker.log(
            parent_run,
            params={"data.fingerprint": data.fingerprint, "data.path": str(data_path)},
            metrics={f"data_skipped_{k}": v for k, v in data.skipped.items()}
            | {f"data_padded_{k}": v for k, v in data.padded.items()},
        )
        build_all(nodes, data, c, tracker, parent_run)
        load = {}
        if c["loadtest"]["enabled"]:
            from reco.loadtest.study import load_test_all

            load = load_test_all(nodes, data, data_path, c, tracker, out_dir)
        report_dir = out_dir / "report" if multirun else Path(c["report_dir"])
        paths = write_study_report(nodes, c, load, report_dir)
        tracker.log_artifacts(parent_run, paths, "report")
        print(f"\nReport: {report_dir / 'report.md'}", flush=True)
        failed = False
    finally:
        tracker.end(parent_run, failed=failed)
    return nodes


def write_study_report(nodes: list[Node], c: dict, load: dict, out_dir: Path) -> list[Path]:
    from reco.report import StudyContext, VariantResult, write_report

    baseline = next(n.name for n in nodes if n.step == "train")
    results = []
    for n in nodes:
        v = n.variant or Variant(n.name, n.step, n.parent, "torch", {})
        results.append(
            VariantResult(
                variant=v,
                status="ok" if n.variant else "failed",
                error=n.error,
                latencies_ms=n.load.get("latencies_ms"),
                capacity_steps=n.load.get("capacity_steps", []),
            )
        )
    ctx = StudyContext(
        experiment=c["experiment_name"],
        baseline=baseline,
        slo_p99_ms=load.get("slo_p99_ms"),
        common_rate_qps=load.get("common_rate_qps"),
        auc_keep=c["gate"]["auc_keep"],
        max_error_rate=c["loadtest"]["capacity"]["max_error_rate"],
        machine=machine_line(),
        targets=c.get("targets", {}),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_report(results, ctx, out_dir)


def machine_line() -> str:
    t = environment_tags()
    return (
        f"{time.strftime('%Y-%m-%d')} · {t['machine.cpu']} · {t['machine.cores']} cores · "
        f"Python {t['machine.python']} · torch {t['machine.torch']} · onnxruntime {t['machine.onnxruntime']}"
    )
