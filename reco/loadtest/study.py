"""Serve and load-test every built variant the same way, for the pipeline.

1. The reference variant (the baseline) sets the yardsticks: its unloaded p99 (one closed-loop user)
   gives the SLO (capacity.slo_factor x that, unless capacity.slo_p99_ms is set), and its capacity at
   that SLO gives the common offered load (study.common_load_fraction x its capacity, unless
   study.common_rate is set).
2. Every variant, the reference included, is then served alone (server and Locust pinned to
   different cores) and measured under that same open-loop load, then capacity-searched at the same SLO.
Figures go into each variant's metrics and MLflow run; raw files into <run dir>/load/<variant>/.
"""

from __future__ import annotations

import time
from pathlib import Path

from reco.data.schema import Dataset
from reco.loadtest.capacity import find_capacity, resolve_slo, unloaded_p99
from reco.loadtest.requests import write_requests
from reco.loadtest.runner import LoadResult, plan_cpus, run_load
from reco.serve.process import start_server
from reco.tracking import Tracker


def _log(tracker: Tracker, node, res: LoadResult, prefix: str = "", subdir: str = "loadtest") -> None:
    tracker.log(node.run_id, metrics={f"{prefix}{k}": v for k, v in res.metrics.items()})
    tracker.log_artifacts(node.run_id, res.artifacts, subdir)


def load_test_all(
    nodes: list, data: Dataset, data_path: Path, c: dict, tracker: Tracker, out_dir: Path
) -> dict:
    """Returns {"slo_p99_ms", "common_rate_qps"} (None when not determined)."""
    lt, study = c["loadtest"], c["loadtest"]["study"]
    outcome: dict = {"slo_p99_ms": None, "common_rate_qps": None}
    if data.schema.user_key is None or data.schema.item_key is None:
        print(
            f"[load] skipped: dataset {data.name!r} has no user/item key, so it cannot be served", flush=True
        )
        return outcome
    only = study.get("variants")  # null: every variant
    ready = [n for n in nodes if n.variant is not None and (only is None or n.name in only)]
    if not ready:
        return outcome
    reference = next((n for n in ready if n.name == study.get("reference")), ready[0])
    server_cpus, gen_cpus = plan_cpus()
    requests = write_requests(
        data, out_dir / "load" / "requests.jsonl", lt["requests"]["n"], lt["requests"]["k"], lt["seed"]
    )
    cap_cfg = lt["capacity"]
    slo = cap_cfg.get("slo_p99_ms")
    rate = study.get("common_rate")
    order = [reference] + [n for n in ready if n is not reference]
    for i, node in enumerate(order, 1):
        d = out_dir / "load" / node.name
        t0 = time.time()
        print(f"\n[load {i}/{len(order)}] {node.name}: serving and load-testing", flush=True)
        try:
            with start_server(
                node.variant.dir, data_path, c["serve"], cpus=server_cpus, work_dir=d
            ) as server:
                if node is reference:
                    ref = unloaded_p99(server.url, lt, d / "unloaded", requests, gen_cpus)
                    _log(tracker, node, ref, prefix="unloaded_", subdir="loadtest/unloaded")
                    slo = resolve_slo(cap_cfg, ref.metrics["e2e_p99_ms"])
                    print(
                        f"  unloaded p99 {ref.metrics['e2e_p99_ms']:.2f} ms -> SLO p99 {slo:.2f} ms",
                        flush=True,
                    )
                cap = None
                if cap_cfg["enabled"]:
                    cap = find_capacity(server.url, lt, slo, d / "capacity", requests, gen_cpus)
                    (d / "capacity.md").write_text(cap.table() + "\n")
                    node.variant.metrics["max_qps_at_slo"] = cap.max_qps_at_slo
                    node.load["capacity_steps"] = [
                        {
                            "rate": s["rate"],
                            "qps": s["qps"],
                            "p99_ms": s["e2e_p99_ms"],
                            "error_rate": s["error_rate"],
                        }
                        for s in cap.steps
                    ]
                    tracker.log(
                        node.run_id, metrics={"max_qps_at_slo": cap.max_qps_at_slo, "slo_p99_ms": slo}
                    )
                    tracker.log_artifacts(node.run_id, [d / "capacity.md"], "loadtest")
                    print(f"  max QPS at SLO: {cap.max_qps_at_slo:.1f}", flush=True)
                if rate is None:
                    if cap and cap.max_qps_at_slo > 0:
                        rate = study["common_load_fraction"] * cap.max_qps_at_slo
                    else:  # no capacity at the SLO (or no search): the lowest rate the search knows
                        rate = cap_cfg["min_rate"]
                        print(f"  WARNING: {node.name} meets the SLO at no rate tried", flush=True)
                    print(f"  common offered load: {rate:.1f} req/s for every variant", flush=True)
                res = run_load(
                    server.url, {**lt, "mode": "open", "rate": rate}, d / "common", requests, gen_cpus
                )
            node.variant.metrics.update(res.metrics)
            node.load["latencies_ms"] = res.latencies_ms
            _log(tracker, node, res)
            m = res.metrics
            print(
                f"  at {rate:.1f} req/s: p50 {m['e2e_p50_ms']:.2f} p99 {m['e2e_p99_ms']:.2f} ms, "
                f"errors {m['error_rate']:.2%}, valid {bool(m['valid'])} ({time.time() - t0:.0f} s)",
                flush=True,
            )
        except Exception as e:  # one variant's failed load test must not stop the comparison
            node.load["error"] = f"{type(e).__name__}: {e}"
            print(f"  load test FAILED: {node.load['error'][:500]}", flush=True)
            tracker.log(node.run_id, tags={"load_error": node.load["error"][:5000]})
    outcome.update(slo_p99_ms=slo, common_rate_qps=rate)
    return outcome
