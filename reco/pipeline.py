"""Run one experiment: build every variant of the graph, measure it, serve and load-test it, track, report.

Finished variants are cached by content hash (reco.graph.cache_key), so an interrupted experiment re-run
redoes only what changed or never finished. A variant counts as finished only when its `FINISHED` marker
exists (written last, after variant.json); anything else in its directory is rebuilt. A failed variant
is marked failed in MLflow and in the report; the rest go on. Parallel jobs (a Hydra multirun with
`hydra/launcher=joblib`) share the cache: a variant is built under its claim (reco.claim), so jobs that
share a parent build it once and the others wait for it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from omegaconf import OmegaConf

from reco.claim import claim
from reco.data import load_dataset
from reco.data.schema import Dataset
from reco.experiment import ExperimentConfig, RunContext
from reco.graph import Node, cache_key
from reco.loadtest.servings import DEFAULT, cross
from reco.measure import gemm_peak_gflops, load_scores, predict, rank_latency, save_scores, score_metrics
from reco.models.protocol import as_requests
from reco.profile import profile_rank
from reco.runtime import batch_invariant, load_scorer
from reco.serve.config import RetrievalKind, ServeConfig
from reco.serve.features import FeatureStore
from reco.serve.quality import (
    PER_CALL,
    QualityRequests,
    gains_of,
    look_order,
    look_rows,
    planted_gains,
    popularity,
    quality_requests,
    reference_topk,
    reproduces,
    request_candidates,
    served_topk,
    subset,
)
from reco.steps import StepRun
from reco.steps import train as train_step
from reco.tracking import Tracker, environment_tags, flatten, unreachable
from reco.tracking_server import EMBEDDED_UI, TrackingConfig, start_hint
from reco.variant import ArtifactError, Variant, atomic_write

if TYPE_CHECKING:
    from reco.report.context import ReferenceRanking
    from reco.stats.graded import GradedQuality

FINISHED = "FINISHED"  # marker file: the variant directory is complete
SCORES = "test_scores.npy"  # [N test rows] float32, the variant's own runtime's scores


@dataclass
class Built:
    """What became of one node of the graph."""

    node: Node
    variant: Variant | None
    error: str
    run_id: str
    cached: bool
    label: str = ""  # a serving row (reco.loadtest.servings): `<variant>_<serving>`; "": the variant itself

    @property
    def name(self) -> str:
        return self.label or self.node.name


def run(exp: ExperimentConfig, ctx: RunContext) -> list[Built]:
    """The whole experiment (see the module docstring).

    Args:
        exp: the typed experiment (reco.experiment.experiment_config; its variant graph already planned).
        ctx: where this execution writes (reco.cli.run fills it from Hydra).
    Returns:
        One Built per row of the report: every variant of the graph, parents first, each followed by its
        serving rows (reco.loadtest.servings) when the load test runs.
    """
    tracker = Tracker(exp.tracking.uri, exp.experiment_name, exp.tracking.artifact_root)
    for run_id in tracker.close_orphans():
        print(f"MLflow: closed run {run_id} left RUNNING by an interrupted execution (KILLED)", flush=True)
    run_name = exp.experiment_name + (f" [{', '.join(ctx.overrides)}]" if ctx.overrides else "")
    tags = {**environment_tags(), "experiment": exp.experiment_name, "overrides": " ".join(ctx.overrides)}
    if ctx.multirun:
        tags["multirun.sweep_dir"] = str(Path(ctx.sweep_dir).resolve())  # as a user can find it from anywhere
    parent_run = tracker.start_run(run_name, tags=tags)
    print(
        f"MLflow: experiment {exp.experiment_name!r}, parent run {parent_run} ({exp.tracking.uri})",
        flush=True,
    )
    status, error = "FAILED", ""
    built: list[Built] = []
    try:
        tracker.log(parent_run, params=flatten(exp.resolved))
        atomic_write(ctx.out_dir / "resolved_config.yaml", OmegaConf.to_yaml(OmegaConf.create(exp.resolved)))
        tracker.log_artifacts(parent_run, [ctx.out_dir / "resolved_config.yaml"])
        data, data_path = _load_data(exp, tracker, parent_run)
        exp = dataclasses.replace(exp, serve=with_retrieval(exp, data))
        topk = TopK(exp, data)  # one for the build and the report: its ground truth is ~20 s to grade
        build_all(exp, data, tracker, parent_run, built, topk)
        profile_all(exp, built, data, ctx.out_dir / "profile", tracker)
        study = None
        if exp.loadtest.enabled:
            from reco.loadtest.study import run_study

            ready = [(b.name, b.variant) for b in built if b.variant is not None]
            add_serving_rows(built, ready, exp.loadtest.study.servings, tracker, parent_run)
            log = study_log(tracker, {b.name: b.run_id for b in built})
            study = run_study(
                ready,
                data,
                data_path,
                exp.loadtest,
                exp.serve,
                ctx.out_dir / "load",
                log,
                headline=exp.headline,
            )
        report_dir = ctx.out_dir / "report" if ctx.multirun else exp.report_dir
        paths = write_study_report(exp, built, data, study, report_dir, tracker, topk)
        tracker.log_artifacts(parent_run, paths, "report")
        print(f"\nReport: {report_dir / 'report.md'}", flush=True)
        tracker.share_view(parent_run, study_view(parent_run, exp.quality.k))
        status = "FINISHED"
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (reco.cli.run turns it into this)
        status, error = "KILLED", f"interrupted: {e or 'SIGINT'}"
        tracker.log(parent_run, tags={"reco.end_reason": error})
        raise
    except Exception as e:  # the parent run's page says why (Tracker.end), then the user's terminal does
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        for row, b in enumerate(built, 1):
            tracker.log(b.run_id, tags={ROW_TAG: f"{row:03d}"})  # the report's row order (study_view)
            st = "FINISHED" if b.variant else "FAILED" if b.error or status != "KILLED" else "KILLED"
            why = ""  # what the run's page says (Tracker.end)
            if st == "KILLED":
                why = "interrupted while building"
                tracker.log(b.run_id, tags={"reco.end_reason": why})
            elif st == "FAILED":
                why = (
                    b.error or f"the experiment stopped before this row was built: {error or 'unknown error'}"
                )
            tracker.end(b.run_id, status=st, error=why)
        tracker.end(parent_run, status=status, error=error)
        if tracker.lost:
            note_unlogged(tracker, ctx.out_dir)
    # last, so that it is the line a user reads: the link, or that the UI is down and how to start it
    print(ui_line(exp.tracking, tracker.experiment_id, None if tracker.lost else parent_run), flush=True)
    return built


def note_unlogged(tracker: Tracker, out_dir: Path) -> None:
    """Say what the run did not log after its tracking server stopped answering, and keep the list."""
    path = atomic_write(out_dir / "mlflow_unlogged.txt", "".join(f"{w}\n" for w in tracker.unlogged))
    print(
        f"MLflow: {len(tracker.unlogged)} calls not logged after the tracking server {tracker.uri} stopped "
        f"answering ({tracker.lost}), listed in {path}; this execution's runs stay RUNNING in that store "
        "until the next run logging to it closes them as KILLED.",
        flush=True,
    )


def ui_line(tracking: TrackingConfig, experiment_id: str, view: str | None) -> str:
    """The run's last line: the link to its runs table, or, when nothing answers there, that the MLflow
    UI is down, how to start it and the link to open then."""
    url = runs_table_url(tracking.uri, experiment_id, view)
    remote = tracking.uri.startswith(("http://", "https://"))
    ui = tracking.uri.rstrip("/") if remote else EMBEDDED_UI
    if why := unreachable(ui, timeout_s=2.0):
        how = (
            start_hint(ui, tracking.server)
            if remote
            else "start it with `make mlflow-ui` (the embedded store)"
        )
        return f"MLflow UI at {ui} is not reachable ({why}): {how}, then open {url}"
    return f"MLflow runs table (this run's variants as rows, decision columns first): {url}"


def study_log(tracker: Tracker, run_ids: dict[str, str]) -> Callable[[str, list[Path], str], None]:
    """run_study's callback: each row's raw load-test files into its MLflow run (run_ids: row name -> run
    id) as they arrive. No metric goes this way: the report logs each row's figures once (log_report_metrics)."""

    def log(name: str, artifacts: list[Path], subdir: str) -> None:
        tracker.log_artifacts(run_ids[name], artifacts, subdir)

    return log


def log_report_metrics(
    tracker: Tracker, run_ids: dict[str, str], per_variant: dict[str, dict[str, float]]
) -> None:
    """The report's figures of each row (reco.report.study_metrics) into its MLflow run, once: the only
    load-test metrics a row's run gets, under the README's names."""
    for name, run_id in run_ids.items():
        tracker.log(run_id, metrics=per_variant.get(name, {}))


def runs_table_url(uri: str, experiment_id: str, view: str | None = None) -> str:
    """The MLflow UI page of the experiment's runs table (MLflow 3 otherwise opens an overview page):
    on the tracking server itself, or on `make mlflow-ui` for the embedded store; with `view`, the
    runs-table view Tracker.share_view stored under that key.

    `workflowType=machine_learning` opens MLflow 3.17's model-training sidebar (Runs, Models, Traces):
    without it the UI takes the browser's last choice, GenAI on a first visit, whatever the experiment's
    `mlflow.experimentKind` tag says (seen in Chromium).
    """
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else EMBEDDED_UI
    query = f"?viewStateShareKey={view}&workflowType=machine_learning" if view else ""
    return f"{base}/#/experiments/{experiment_id}/runs{query}"


ROW_TAG = "reco.row"  # a variant run's row in the report, zero-padded ("001") so its text sorts in order


def decision_columns(k: int) -> list[str]:
    """The runs table's columns for one execution, in this order: what the report's gate decides on
    (ΔAUC, what users see -- Δ expected clicks@k where the data has a planted click model, else ΔGAUC --,
    p99 speed-up, QPS gain, the gate), then the raw p99 and capacity and where the row comes from (README
    "Metric names"); the run name is always shown.

    Args:
        k: the served top-k's size (quality.k), part of the metric's name (`expected_clicks_at_<k>_delta_rel`).
    """
    return [
        "metrics.`auc_delta_rel`",
        f"metrics.`expected_clicks_at_{k}_delta_rel`",
        "metrics.`gauc_delta_rel`",
        "metrics.`speedup_p99_common`",
        "metrics.`qps_gain`",
        "metrics.`gate`",
        "metrics.`e2e_p99_ms`",
        "metrics.`max_qps_at_slo`",
        "params.`backend`",
        "tags.`parent_variant`",
        "tags.`status`",
    ]


def study_view(parent_run: str, k: int) -> dict:
    """One execution in MLflow's runs table: its variant runs as flat rows in the report's order, with
    decision_columns(k) first (`columnOrder`; `selectedColumns` alone shows them alphabetically).

    Sorted by ROW_TAG, not by start time: MLflow 3.17's UI nests child runs under their parent (and
    fetches the parent though the filter leaves it out) only when the table is sorted by start time or
    neither sorted nor filtered; any other sort lists them flat. A shared view cannot expand a parent row
    (`runsExpanded` is not shared), so this is the one server-side way to show the variants unfolded.
    """
    columns = decision_columns(k)
    return {
        "searchFilter": f"tags.`mlflow.parentRunId` = '{parent_run}'",
        "orderByKey": f"tags.`{ROW_TAG}`",
        "orderByAsc": True,
        "selectedColumns": columns,
        "columnOrder": columns,
    }


def _load_data(exp: ExperimentConfig, tracker: Tracker, parent_run: str) -> tuple[Dataset, Path]:
    print(f"[data] loading {exp.data.loader}", flush=True)
    data, data_path = load_dataset(exp.data, exp.cache_dir / "data")
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
    return data, data_path


def build_all(
    exp: ExperimentConfig,
    data: Dataset,
    tracker: Tracker,
    parent_run: str,
    built: list[Built],
    topk: TopK | None = None,
) -> None:
    """Build (or reuse) and measure every node, parents first, appending to `built` as it goes (so an
    interruption still ends every run started); a failure skips only its subtree."""
    nodes, trainer = exp.variants, exp.trainer
    done: dict[str, Built] = {}
    topk = topk or TopK(exp, data)
    shared = data.schema.shared_columns if exp.serve.user_once else None  # scored as the service does
    for i, node in enumerate(nodes, 1):
        parent = done[node.parent] if node.parent else None
        print(
            f"\n[variant {i}/{len(nodes)}] {node.name}: {node.step}"
            + (f" from {node.parent}" if node.parent else ""),
            flush=True,
        )
        run_id = tracker.start_run(
            node.name,
            parent_id=parent_run,
            tags={"variant": node.name, "parent_variant": node.parent or "", "step": node.step},
        )
        b = done[node.name] = Built(node, None, "", run_id, False)
        built.append(b)
        if parent is not None and parent.variant is None:
            b.error = f"parent variant {node.parent!r} failed: {parent.error.splitlines()[0]}"
            print(f"  skipped: {b.error}", flush=True)
            tracker.log(run_id, tags={"error": b.error, "status": "skipped"})
            continue
        key = cache_key(node, parent.variant.cache_key if parent else None, data.fingerprint, trainer)
        out_dir = variant_dir(exp, node, key)
        t0 = time.time()
        try:
            # Parallel jobs sharing this variant (a sweep's common baseline): one builds, the others wait
            # here and then find it FINISHED. Held until FINISHED is rewritten, so no job ever sees (or
            # removes) another's half-built directory.
            with claim(out_dir, f"variant {node.name!r} ({out_dir})"):
                v, b.cached = _reuse(out_dir), True
                if v is None:
                    b.cached = False
                    shutil.rmtree(out_dir, ignore_errors=True)  # an unfinished build: start clean
                    ctx = StepRun(node.name, out_dir, trainer, functools.partial(_log_epoch, tracker, run_id))
                    v = node.spec.fn(parent.variant if parent else None, data, node.config, ctx)
                    v.cache_key, v.data_fingerprint = key, data.fingerprint
                    measure_accuracy(v, data, trainer.threads)
                v.metrics.update(
                    rank_latency(
                        load_scorer(v, threads=exp.serve.intra_op_threads, shared=shared),
                        data.val,  # timing only; the test split is the accuracy report's
                        n_candidates=exp.serve.n_candidates,
                        cfg=exp.rank_latency,
                        seed=exp.seed,
                        shared=shared,
                    )
                )
                # What the call would take if its dense layers ran at this machine's fp32 GEMM peak.
                v.metrics["gemm_peak_gflops"] = peak = gemm_peak_gflops()
                v.metrics["rank_floor_ms"] = v.flops_per_candidate * exp.serve.n_candidates / peak / 1e6
                base = next(d for d in done.values() if d.node.spec.root)  # the report's baseline
                topk.measure(v, None if base is b else base.variant)
                v.mlflow_run_id = run_id
                v.save()
                atomic_write(out_dir / FINISHED, key)
            b.variant = v
            _log_variant(tracker, run_id, v, exp.tracking.log_models)
            tracker.log(run_id, tags={"status": "ok", "cached": str(b.cached)})
            m = v.metrics
            print(
                f"  {'reusing finished variant ' + str(out_dir) + ' (same config, code and inputs)' if b.cached else 'built'}"
                f"\n  {node.name}: auc {m.get('auc', float('nan')):.4f}  params {v.params:,}  size {v.size_mb:.1f} MB  "
                f"rank p50 {m.get('rank_p50_ms', float('nan')):.2f} ms  ({time.time() - t0:.0f} s)",
                flush=True,
            )
        except Exception as e:  # a failed variant must not stop the comparison
            b.error = f"variant {node.name!r} (step {node.step}): {type(e).__name__}: {e}"
            print(f"  FAILED: {b.error}", flush=True)
            tracker.log(run_id, tags={"status": "failed"})  # its error: tag and page note at its end (run())
            failed = exp.cache_dir / "failed"
            failed.mkdir(parents=True, exist_ok=True)
            atomic_write(failed / f"{node.name}.txt", traceback.format_exc())
            tracker.log_artifacts(run_id, [failed / f"{node.name}.txt"], "error")  # the traceback, in the UI


def variant_dir(exp: ExperimentConfig, node: Node, key: str) -> Path:
    return exp.cache_dir / "variants" / f"{node.name}-{key}"


def join(exp: ExperimentConfig) -> None:
    """This host's part of a training over several hosts (trainer.distributed.node_rank > 0): the ranks
    of every model node 0 trains, in the graph's order, and nothing else. Node 0 runs the pipeline (MLflow,
    the other steps, the study) and receives the trained model; a variant already FINISHED in the shared
    cache is one node 0 reuses without training, so this host skips it too."""
    d = exp.trainer.distributed
    data, _ = load_dataset(exp.data, exp.cache_dir / "data")
    for node in exp.variants:
        if node.step != "train":  # the only step that trains over ranks
            continue
        out_dir = variant_dir(exp, node, cache_key(node, None, data.fingerprint, exp.trainer))
        if (out_dir / FINISHED).exists():
            print(
                f"[node {d.node_rank}] {node.name}: finished in the cache ({out_dir}); nothing to train",
                flush=True,
            )
            continue
        print(
            f"[node {d.node_rank}/{d.nnodes}] {node.name}: training ranks "
            f"{d.node_rank * d.nproc}-{(d.node_rank + 1) * d.nproc - 1} of {d.world} "
            f"with node 0 at {d.master_addr}:{d.master_port}",
            flush=True,
        )
        train_step.join(data, node.config, exp.trainer, out_dir)
    print(f"[node {d.node_rank}] done; node 0 goes on with the pipeline", flush=True)


def add_serving_rows(
    built: list[Built], ready: list[tuple[str, Variant]], servings: dict, tracker: Tracker, parent_run: str
) -> None:
    """A row (and an MLflow child run) per variant served another way than `reco` (loadtest.study.servings),
    inserted after its variant's row; its model, metrics and files are the variant's own."""
    by_name = {b.name: b for b in built}
    rows: dict[str, list[Built]] = {}
    for p in cross(ready, servings):
        if p.serving_name == DEFAULT:
            continue
        src = by_name[p.variant.name]
        run_id = tracker.start_run(
            p.label,
            parent_id=parent_run,
            tags={
                "variant": p.label,
                "parent_variant": p.variant.name,
                "step": "serving",
                "serving": p.serving_name,
            },
        )
        row = Built(src.node, p.as_variant(), "", run_id, src.cached, label=p.label)
        built.append(row)  # at once, so run() ends its MLflow run whatever happens next
        _log_variant(tracker, run_id, row.variant, log_models=False)  # its model's figures, as its own run's
        tracker.log(run_id, params=flatten({"serving": {"name": p.serving_name, **asdict(p.serving)}}))
        rows.setdefault(src.name, []).append(row)
    built[:] = [r for b in built if not b.label for r in (b, *rows.get(b.name, ()))]  # each after its variant


def profile_all(
    exp: ExperimentConfig, built: list[Built], data: Dataset, out_dir: Path, tracker: Tracker
) -> None:
    """One request's ranking call of every built variant profiled (reco.profile): stage split metrics
    (`profile_<stage>_ms`, also in the report) and the runtime's trace as the MLflow artifact `profile/`."""
    c, n = exp.profile, exp.serve.n_candidates
    if not c.enabled:
        return
    print(
        f"[profile] where the rank time goes: {c.calls} calls of {n} candidates",
        flush=True,
    )
    idx = np.random.default_rng(exp.seed).integers(0, len(data.val), size=n)
    part = data.val.take(idx)
    block = (part.dense.numpy(), part.ids.numpy(), part.mask().numpy())
    shared = data.schema.shared_columns if exp.serve.user_once else None
    if shared:  # one request: its candidates share its user and context
        block = as_requests(block, shared, [n])
    for b in built:
        if b.variant is None:
            continue
        try:
            p = profile_rank(
                b.variant, block, out_dir / b.name, c, threads=exp.serve.intra_op_threads, shared=shared
            )
        except Exception as e:  # a profile is a diagnostic: it must not fail the variant
            print(f"  {b.name}: profile failed: {type(e).__name__}: {e}", flush=True)
            tracker.log(b.run_id, tags={"profile_error": f"{type(e).__name__}: {e}"[:5000]})
            continue
        b.variant.metrics.update(p.metrics())
        tracker.log(b.run_id, metrics=p.metrics())
        tracker.log_artifacts(b.run_id, [p.trace], "profile")
        split = (
            "  ".join(f"{k} {v:.2f}" for k, v in p.stages_ms.items()) or "(no stage split for this backend)"
        )
        print(f"  {b.name}: {p.total_ms:.2f} ms/call  {split}", flush=True)


def _log_epoch(tracker: Tracker, run_id: str, epoch: int, row: dict[str, float]) -> None:
    tracker.log(run_id, metrics=row, step=epoch)


def finished_variants(exp: ExperimentConfig, data: Dataset) -> dict[str, Variant]:
    """The preset's variants a run of it would reuse from exp.cache_dir (finished, files intact), by name,
    parents first: what a benchmark replays without building anything."""
    keys: dict[str, str] = {}
    out: dict[str, Variant] = {}
    for node in exp.variants:
        keys[node.name] = cache_key(node, keys.get(node.parent or ""), data.fingerprint, exp.trainer)
        if (v := _reuse(variant_dir(exp, node, keys[node.name]))) is not None:
            out[node.name] = v
    return out


def _reuse(out_dir: Path) -> Variant | None:
    """The finished variant in `out_dir`, or None when it never finished or its files do not check out."""
    if not (out_dir / FINISHED).exists():
        return None
    try:
        v = Variant.load(out_dir)
        for role in v.artifacts:
            v.verify(role)
    except (ArtifactError, ValueError, TypeError) as e:
        print(f"  cached variant {out_dir} is damaged ({e}); rebuilding it", flush=True)
        return None
    return v if "auc" in v.metrics else None


class TopK:
    """Each variant's served top-k for the quality requests (reco.serve.quality), kept as an artifact whose
    name carries a hash of the settings behind it, so a cached variant redoes it only when they change.
    With quality.looks a variant other than the baseline answers them a look at a time and stops at the
    first look that decides its what-users-see gate; its lists then hold that look's requests
    (look_rows; `rows`)."""

    def __init__(self, exp: ExperimentConfig, data: Dataset) -> None:
        self.exp, self.data = exp, data
        q, serve = exp.quality, exp.serve
        key = [q.users, q.k, exp.seed, serve.n_candidates, asdict(serve.retrieval), data.fingerprint]
        if q.looks:  # where a variant stops depends on the looks, their level and the gate's limit
            key += [list(q.looks), q.look_confidence, exp.gate.max_expected_clicks_drop_pct]
        digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]
        self.file = f"topk-{digest}.npy"  # scored several requests a call (served_topk's per_call)
        # A runtime whose scores move with their batch-mates (dynamic INT8) is scored one request a call, as
        # its server (not batched) answers; at 8 a call most of its lists differ
        # (experiments/ecommerce_case_study/README.md#what-users-see). Their own name, so lists scored the
        # other way are never reused.
        self.alone_file = f"topk-{digest}-alone.npy"
        self._reqs: QualityRequests | None = None
        self._store: FeatureStore | None = None

    def _lists(self, v: Variant) -> tuple[str, int]:
        """v's lists' artifact name and the requests scored per model call (reads v's ONNX graphs)."""
        return (self.file, PER_CALL) if batch_invariant(v) else (self.alone_file, 1)

    @property
    def requests(self) -> QualityRequests:
        if self._reqs is None:
            self._reqs = quality_requests(self.data, self.exp.quality.users, self.exp.seed)
        return self._reqs

    @property
    def store(self) -> FeatureStore:
        if self._store is None:
            self._store = FeatureStore(self.data, self.exp.serve.retrieval)
        return self._store

    @functools.cached_property
    def truth(self) -> Truth | None:
        truth = ground_truth(self.exp, self.data, self.store, self.requests)
        if truth is None and self.exp.quality.looks:
            print(
                "  quality.looks: no planted click model to judge a look by, so every variant answers all "
                f"{len(self.requests.users):,} requests",
                flush=True,
            )
        return truth

    def rows(self, top: np.ndarray) -> np.ndarray:
        """The requests (indices into `requests`) that lists `top` answer: all, or a look's."""
        return look_rows(len(self.requests.users), len(top), self.exp.seed)

    def measure(self, v: Variant, base: Variant | None = None) -> None:
        """Add v's `topk` artifact ([users, k] item ids) unless it holds these settings' already; `base`:
        the baseline, whose lists (all requests) decide where v's looks stop (None: v is the baseline)."""
        if self.exp.quality.users == 0 or not len(self.requests.users):
            return
        file, per_call = self._lists(v)
        if file in v.artifacts:
            return
        shared = self.data.schema.shared_columns if self.exp.serve.user_once else None
        scorer = load_scorer(v, threads=self.exp.trainer.threads, shared=shared, batch=True)
        reqs, n = self.requests, len(self.requests.users)
        base_top = self.load(base)
        judged = base_top is not None and self.exp.quality.looks and self.truth is not None
        looks = [m for m in self.exp.quality.looks if m < n] if judged else []
        order = look_order(n, self.exp.seed) if looks else np.arange(n)
        top = np.empty((0, self.exp.quality.k), dtype=np.int64)
        for a, m in itertools.pairwise([0, *looks, n]):
            part = served_topk(
                scorer,
                self.store,
                self.data,
                subset(reqs, order[a:m]),
                self.exp.serve,
                self.exp.quality.k,
                per_call,
            )
            top = np.concatenate([top, part])
            if m < n and self._decided(top, order[:m], base_top):
                print(f"  what users see: decided at the look at {m:,} of {n:,} requests", flush=True)
                break
        top = top[np.argsort(order[: len(top)])]  # request order: rows look_rows(n, len(top))
        np.save(v.path / file, top, allow_pickle=False)
        v.add_artifact(file, file)

    def _decided(self, top: np.ndarray, answered: np.ndarray, base_top: np.ndarray) -> bool:
        """Whether lists `top` (of requests `answered`, in that order) give the what-users-see gate a
        verdict at quality.look_confidence (reco.report.gate's rule at the look's level)."""
        from reco.stats import Verdict, verdict_at_least
        from reco.stats.graded import clicks_delta, graded_per_request

        assert self.truth is not None  # measure looks only with a planted click model
        q, t = self.exp.quality, self.truth.subset(answered)
        x, b = (
            graded_per_request(t.gains_of(lists), t.gains)["clicks"] for lists in (top, base_top[answered])
        )
        e = clicks_delta(x, b, q.k, self.exp.seed, q.look_confidence)
        return verdict_at_least(e, -self.exp.gate.max_expected_clicks_drop_pct / 100) != Verdict.INCONCLUSIVE

    def load(self, v: Variant | None) -> np.ndarray | None:
        if v is None or not {self.file, self.alone_file} & v.artifacts.keys():
            return None  # no lists of these settings (without reading its graphs)
        file, _ = self._lists(v)
        return np.load(v.verify(file), allow_pickle=False) if file in v.artifacts else None


def _stage_dir(exp: ExperimentConfig, data: Dataset) -> Path:
    key = json.dumps([asdict(exp.two_tower), data.fingerprint, exp.seed])
    return exp.cache_dir / "retrieval" / f"two_tower-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def retrieval_label(serve: ServeConfig) -> str:
    """How the study's servers found their candidates, for the report."""
    r = serve.retrieval
    if r.kind == RetrievalKind.two_tower:
        return f"two-tower ({r.index.label})"
    groups = (
        f"popular items of the user's {r.user_feature} ({r.item_feature}), then " if r.user_feature else ""
    )
    return f"heuristic: {groups}global popularity"


def front_file(exp: ExperimentConfig) -> Path | None:
    """Where the report's retrieval front of the served two-tower stage is kept (None: no such stage, or
    one the pipeline did not train: the front is measured beside the stages it owns)."""
    r = exp.serve.retrieval
    if r.kind != RetrievalKind.two_tower or not r.artifact or not exp.front.queries:
        return None
    key = json.dumps([asdict(exp.front), asdict(r.index), exp.serve.n_candidates, exp.seed])
    return Path(r.artifact) / f"front-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def with_retrieval(exp: ExperimentConfig, data: Dataset) -> ServeConfig:
    """exp.serve, with serve.retrieval.artifact set to a trained two-tower stage when the servers need one
    (kind=two_tower, no artifact given): trained from `retrieval.two_tower` once per settings and data,
    kept in the cache under a claim, so parallel jobs train it once. Its front (`retrieval.front`) is
    measured once beside it for the report."""
    r = exp.serve.retrieval
    if r.kind != RetrievalKind.two_tower or r.artifact:  # a stage of the user's own is served as it is
        return exp.serve
    from reco.retrieval.artifact import MANIFEST, save_artifact
    from reco.retrieval.two_tower import SideRows, encode, train_two_tower

    out = _stage_dir(exp, data)
    with claim(out, f"retrieval stage ({out})"):
        if (out / MANIFEST).exists():
            print(f"\n[retrieval] reusing the trained two-tower stage {out}", flush=True)
        else:
            print("\n[retrieval] training the two-tower stage (retrieval.two_tower)", flush=True)
            model, _ = train_two_tower(data, exp.two_tower, exp.seed)
            item_ids, ids, mask, dense = FeatureStore(data, None).item_catalogue()
            vecs = encode(model.item, SideRows.from_arrays(ids, mask, dense))
            save_artifact(out, model, exp.two_tower, item_ids, vecs, data.fingerprint)
        serve = dataclasses.replace(exp.serve, retrieval=dataclasses.replace(r, artifact=str(out)))
        front = front_file(dataclasses.replace(exp, serve=serve))
        if front is not None and not front.exists():
            _measure_front(exp, serve, data, front)
    return serve


def _measure_front(exp: ExperimentConfig, serve: ServeConfig, data: Dataset, path: Path) -> None:
    """The served stage's index front over `retrieval.front.queries` validation users -> `path` (JSON)."""
    import torch

    from reco.retrieval.ann import IndexSpec
    from reco.retrieval.artifact import load_artifact
    from reco.retrieval.front import front_table, measure_front
    from reco.retrieval.two_tower import encode, side_rows

    art = load_artifact(serve.retrieval.artifact, data.schema, data.fingerprint)
    s, va = data.schema, data.val
    _, first = np.unique(va.ids[:, s.index(s.user_key), 0].numpy(), return_index=True)
    pick = np.random.default_rng(exp.seed).permutation(first)[: exp.front.queries]
    queries = encode(art.model.user, side_rows(s, va, "user", torch.from_numpy(pick)))
    served, n = serve.retrieval.index, min(serve.n_candidates, len(art.item_ids))
    specs = [IndexSpec("flat"), *([served] if served.kind != "flat" else []), *exp.front.indexes]
    specs = [sp for i, sp in enumerate(specs) if sp not in specs[:i]]
    print(
        f"[retrieval] the index front: {len(specs)} indexes, {len(queries)} validation users, N={n}",
        flush=True,
    )
    rows = measure_front(specs, art.item_vectors, queries, n, threads=1)
    blob = {
        "items": len(art.item_ids),
        "dim": int(art.item_vectors.shape[1]),
        "queries": len(queries),
        "n": n,
        "rows": front_table(rows, served),
    }
    atomic_write(path, json.dumps(blob, indent=1))


def measure_accuracy(v: Variant, data: Dataset, threads: int) -> None:
    """Score the test split once through the variant's own runtime: metrics + the scores themselves
    (kept as an artifact so ΔAUC against the baseline is paired on the same rows)."""
    scores = predict(load_scorer(v, threads=threads, batch=True), data.test)
    v.metrics.update(score_metrics(data.test, scores))
    save_scores(v.path / SCORES, scores)
    v.add_artifact("test_scores", SCORES)


def _log_variant(tracker: Tracker, run_id: str, v: Variant, log_models: bool) -> None:
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
    tracker.log(run_id, metrics={**v.metrics, **sizes}, params=params, tags={"cache_key": v.cache_key})
    files = [v.path / "variant.json"]
    if log_models:
        files += [v.path / f for r, f in v.artifacts.items() if r != "test_scores"]
    tracker.log_artifacts(run_id, files, "variant")


def write_study_report(
    exp: ExperimentConfig,
    built: list[Built],
    data: Dataset,
    study,
    out_dir: Path,
    tracker: Tracker,
    topk: TopK | None = None,
) -> list[Path]:
    """Comparison table, plots and report.md of the study; each variant's report metrics into its run.

    ΔAUC against the baseline is paired on the same test rows (DeLong CI) from each variant's stored
    test scores, so a cached variant is compared without scoring the test split again.
    """
    from reco.report import Machine, StudyContext, VariantResult, study_metrics, write_report
    from reco.stats import auc_ci, auc_delta
    from reco.stats.gauc import gauc
    from reco.stats.topk import topk_quality

    print(f"\n[report] ΔAUC, GAUC and what users see for {len(built)} rows; tables and plots", flush=True)
    base = next(b for b in built if b.node.spec.root)
    labels = data.test.labels.numpy()
    s = data.schema
    users = data.test.ids[:, s.index(s.user_key), 0].numpy() if s.user_key else None
    base_scores = _scores(base.variant)
    topk = topk or TopK(exp, data)
    base_top = topk.load(base.variant)
    truth = topk.truth if base_top is not None else None
    base_gain = truth.gains_of(base_top) if truth is not None else None
    results = []
    for b in built:
        v = b.variant or Variant(b.name, b.node.step, b.node.parent, "torch", {})
        scores, top = _scores(b.variant), topk.load(b.variant)
        delta = quality = graded = grouped = None
        if b is not base and scores is not None and base_scores is not None:
            delta = auc_delta(labels, base_scores, scores)
        if users is not None and scores is not None and (b is base or base_scores is not None):
            grouped = gauc(users, labels, scores, None if b is base else base_scores, exp.seed)
        if top is not None and (b is base or base_top is not None):
            # a variant stopped at a look is paired with the baseline's lists for the requests it answered
            rows = topk.rows(top)
            against = None if b is base else base_top[rows]
            quality = topk_quality(
                top, subset(topk.requests, rows).relevant, against, exp.quality.rbo_p, exp.seed
            )
            if truth is not None and base_gain is not None:
                graded = truth.subset(rows).graded(top, None if b is base else base_gain[rows], exp.seed)
        results.append(
            VariantResult(
                variant=v,
                load=study.outcomes.get(b.name) if study else None,
                auc_delta=delta,
                quality=quality,
                graded=graded,
                gauc=grouped,
                status="ok" if b.variant else "failed",
                error=b.error,
            )
        )
    references = (
        _references(exp, data, topk, base_top, truth, base_gain, base_scores, users, labels)
        if base_top is not None and users is not None
        else []
    )
    tags = environment_tags()
    ctx = StudyContext(
        experiment=exp.experiment_name,
        baseline=base.name,
        max_auc_drop=exp.gate.max_auc_drop_pct / 100,
        max_clicks_drop=exp.gate.max_expected_clicks_drop_pct / 100 if truth is not None else None,
        max_gauc_drop=exp.gate.max_gauc_drop_pct / 100 if users is not None else None,  # no users: no GAUC
        planted=truth is not None,
        look_confidence=exp.quality.look_confidence if exp.quality.looks else None,
        references=references,
        max_error_rate=exp.loadtest.capacity.max_error_rate,
        study=study,
        machine=Machine.from_tags(tags),
        commit=tags["git.commit"],
        targets=exp.targets,
        headline=exp.headline,
        retrieval=retrieval_label(exp.serve),
        front=json.loads(f.read_text()) if (f := front_file(exp)) is not None and f.exists() else None,
        baseline_auc=auc_ci(labels, base_scores) if base_scores is not None else None,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = write_report(results, ctx, out_dir)
    log_report_metrics(tracker, {b.name: b.run_id for b in built}, study_metrics(results, ctx))
    return paths


def _scores(v: Variant | None) -> np.ndarray | None:
    if v is None or "test_scores" not in v.artifacts:
        return None
    return load_scores(v.verify("test_scores"))


@dataclass
class Truth:
    """Quality requests' candidates graded by the planted click model (synthetic data only)."""

    cands: list[np.ndarray]
    gains: list[np.ndarray]

    def gains_of(self, top: np.ndarray) -> np.ndarray:
        return gains_of(top, self.cands, self.gains)

    def subset(self, rows: np.ndarray) -> Truth:
        """The requests at `rows` (a look's: TopK.rows)."""
        return Truth([self.cands[i] for i in rows], [self.gains[i] for i in rows])

    def graded(self, top: np.ndarray, base_gain: np.ndarray | None, seed: int) -> GradedQuality:
        """`top`'s graded figures; base_gain: gains_of(the baseline's lists), computed once by the caller
        (every variant is graded against the same ones), None for the baseline itself."""
        from reco.stats.graded import graded_quality

        return graded_quality(self.gains_of(top), self.gains, base_gain, seed)


def ground_truth(
    exp: ExperimentConfig, data: Dataset, store: FeatureStore, requests: QualityRequests
) -> Truth | None:
    """The planted P(click) of every request's candidates (as the service retrieves them from `store`; the
    requests of any split: bench.static_int8 chooses settings on validation's); None when the data has
    no planted click model (any loader but synthetic_ecommerce, or test rows whose logged P(click) the
    model its config regenerates does not give back)."""
    if exp.data.loader != "synthetic_ecommerce":
        return None
    from reco.config import typed
    from reco.data.synthetic import SyntheticConfig, click_model

    model = click_model(typed(exp.data.params, SyntheticConfig, "data.params"))
    if not reproduces(model, data):
        return None
    cands = request_candidates(store, requests, exp.serve.n_candidates)
    return Truth(cands, planted_gains(model, data, requests, cands))


def _references(
    exp: ExperimentConfig,
    data: Dataset,
    topk: TopK,
    base_top: np.ndarray,
    truth: Truth | None,
    base_gain: np.ndarray | None,
    base_scores: np.ndarray | None,
    users: np.ndarray,
    labels: np.ndarray,
) -> list[ReferenceRanking]:
    """The reference rows of *What users see*: the same candidates ranked by training popularity and, with
    a planted click model, by the true P(click); each also scores the test rows (`users`, `labels`: the
    test split's, as the variants' GAUC reads them) for its GAUC."""
    from reco.report.context import ReferenceRanking
    from reco.stats.gauc import gauc
    from reco.stats.topk import topk_quality

    s, t, q = data.schema, data.test, exp.quality
    cands = (
        truth.cands
        if truth is not None
        else request_candidates(topk.store, topk.requests, exp.serve.n_candidates)
    )
    pop = popularity(data)
    rankers = {"popularity": ([pop[c] for c in cands], pop[t.ids[:, s.index(s.item_key), 0].numpy()])}
    if truth is not None and t.oracle is not None:
        rankers["oracle"] = (truth.gains, t.oracle.numpy())
    out = []
    for name, (cand_scores, row_scores) in rankers.items():
        top = reference_topk(cands, cand_scores, q.k)
        out.append(
            ReferenceRanking(
                name,
                topk_quality(top, topk.requests.relevant, base_top, q.rbo_p, exp.seed),
                truth.graded(top, base_gain, exp.seed) if truth is not None else None,
                gauc(users, labels, row_scores, base_scores, exp.seed),
            )
        )
    return out
