"""The report's comparison sections: like-for-like latency, throughput and its SLO sensitivity, what each
step bought, repeats, where the time goes, correctness under load, and every capacity step.

Each returns Markdown lines; every figure carries its CI or range and says which.
"""

from __future__ import annotations

from reco.loadtest.capacity import (
    EXCEEDANCE_FAR_MIN_EFFECTIVE_N,
    EXCEEDANCE_FAR_SHARE,
    EXCEEDANCE_MAX_SHARE,
    EXCEEDANCE_MIN_EFFECTIVE_N,
)
from reco.loadtest.outcome import BATCH_MARGIN, QUANTILES
from reco.profile import STAGES
from reco.report.context import StudyContext
from reco.report.figures import KINDS, SLO_FACTORS, Latency, VariantFigures, capacity_gain
from reco.report.fmt import DASH, bracket, est, num, one_line, scaled, short, spread, table, vs_base
from reco.report.gate import Gate
from reco.report.metrics import CPU_PARTS, outside_handler, server_cpu_split
from reco.stats import Estimate, Verdict
from reco.stats.gauc import GAUC
from reco.stats.graded import GradedQuality
from reco.stats.paired import heaviest_block

KIND_LABEL = {"unloaded": "unloaded", "common": "at the common load", "equal_util": "at equal utilisation"}


def _pct(x: float | None) -> str:
    return DASH if x is None else f"{x:.0%}"


def _ratio(f: VariantFigures, kind: str, key: str = "p99") -> str:
    r = f.speedup.get((kind, key))
    if f.is_baseline:
        return vs_base(True, None)
    if r is None:
        return DASH
    reps = (
        f" (runs {num(r.repeats.lo, '.2f')}–{num(r.repeats.hi, '.2f')})"
        if r.repeats and r.repeats.n > 1
        else ""
    )
    return short(r.pooled, ".2f", "×") + reps


def _tail_block(lat: Latency | None) -> str:
    """'r27: 28 of 28' (reco.stats.paired.heaviest_block over the runs' blocks), DASH when none."""
    runs = [r for r in lat.used if r.block is not None] if lat else []
    found = heaviest_block([r.latencies_ms for r in runs], QUANTILES["p99"]) if runs else None
    if found is None:
        return DASH
    i, k, total = found
    return f"r{runs[i].block}: {k} of {total}"


def like_for_like(figs: list[VariantFigures], ctx: StudyContext) -> list[str]:
    """The three latency ratios (baseline / variant) with CIs, and each variant's unloaded latency."""
    rows = []
    for f in figs:
        un = f.latency.get("unloaded")
        if not f.latency:
            continue
        rows.append(
            [
                f"`{f.name}`",
                short(un.quantiles["p50"]) if un else DASH,
                short(un.quantiles["p99"]) if un else DASH,
                f"{un.n:,}" if un else DASH,
                _tail_block(un),
                _ratio(f, "unloaded", "p50"),
                _ratio(f, "unloaded"),
                _pct(f.utilisation("equal_util")),
                _ratio(f, "equal_util"),
                _pct(f.utilisation("common")),
                _ratio(f, "common"),
            ]
        )
    if not rows:
        return ["No variant was load-tested."]
    header = [
        "variant",
        "unloaded p50 ms [CI]",
        "unloaded p99 ms [CI]",
        "unloaded n",
        "p99's heaviest block",
        "speed-up p50 unloaded",
        "speed-up p99 unloaded",
        "util. (equal)",
        "speed-up p99 equal util.",
        "util. (common)",
        "speed-up p99 common load",
    ]
    return [
        "Speed-up = baseline latency / variant latency (> 1: faster), with a 95 % CI from the blocks both "
        "variants ran in (paired, so drift they shared cancels: see Statistics; from the two pooled intervals "
        "by MOVER where they share fewer than 2 blocks) and, in parentheses, the RANGE of the ratios of any "
        "two repeats (not a CI). Utilisation = offered rate / the variant's own median capacity at the SLO. "
        "The unloaded blocks are spread over the study, so minute-scale drift of the machine shows up in "
        "that interval instead of between runs. *p99's heaviest block*: of a variant's unloaded requests "
        "slower than its pooled p99, how many its heaviest block holds (block r: k of all): one block "
        "holding most of them is one slow stretch of the host: the variant's own pooled p99 rests on it, "
        "its unloaded speed-ups (median blocks) do not (experiments/platform/README.md).",
        "",
        "- **Like for like: unloaded** (one request at a time: what the model and the server cost) and "
        "**at equal utilisation** (each variant at the same fraction of its own capacity).",
        "- **Not like for like: at the common load.** Every variant gets the same offered rate, so a slow "
        "baseline runs near its capacity and queues while a fast variant idles; that ratio measures the "
        "baseline's queue as much as the model.",
        "",
        *table(header, rows),
    ]


def throughput(figs: list[VariantFigures], ctx: StudyContext) -> list[str]:
    """QPS gain with its interval, each repeat's bracket, and the gain at 0.5x / 1x / 2x the SLO."""
    caps = [f for f in figs if f.capacity]
    if not caps or ctx.slo_p99_ms is None:
        return ["No capacity search was run."]
    rows = []
    for f in caps:
        brackets = ", ".join(
            bracket(c.highest_pass, c.lowest_fail, undecided=c.undecided)
            if c.decided
            else "undecided (time budget)"
            for c in f.capacity
        )
        rows.append([f"`{f.name}`", spread(f.max_qps, ".0f"), brackets, vs_base(f.is_baseline, f.qps_gain)])
    slo = ctx.slo_p99_ms
    sens = [
        [f"`{f.name}`"]
        + [
            f"{spread(f.max_qps_at[k], '.0f')}; gain {vs_base(f.is_baseline, f.qps_gain_at[k])}"
            for k in SLO_FACTORS
        ]
        for f in caps
    ]
    return [
        "Max QPS at the SLO = the highest rate whose p99 CI lies within the SLO, or, where that CI is open "
        f"far below it, whose bound on the share of requests past the SLO is <= {100 * EXCEEDANCE_MAX_SHARE:g} % "
        f"(<= {100 * EXCEEDANCE_FAR_SHARE:g} % where it rests on {EXCEEDANCE_FAR_MIN_EFFECTIVE_N} to "
        f"{EXCEEDANCE_MIN_EFFECTIVE_N} effective requests; the appendix says "
        "which: reco/loadtest/capacity.py) (median over repeats, range "
        "in parentheses); each repeat's bracket is [highest pass, lowest fail) in req/s, with the rates tried inside it "
        "that neither passed nor failed (*undecided*: the capacity may lie on either side); a repeat the study's "
        "time budget stopped before any rate passed is *undecided* and enters no median. The gain's interval "
        "covers every pair of repeats and each search's resolution: from highest pass / the baseline's lowest "
        "fail to lowest fail / the baseline's highest pass.",
        "",
        *table(["variant", "max QPS @SLO", "brackets per repeat", "QPS gain vs baseline"], rows),
        "",
        "### SLO sensitivity",
        "",
        "Each measured capacity step re-judged against 0.5×, 1× and 2× the SLO (its recorded p99 CI and error "
        "rate); the highest passing rate **among the rates the search measured** is a lower bound limited to "
        "the search's grid, which was laid out around the 1× SLO. 0 = no measured rate passed.",
        "",
        *table(["variant", *(f"{k:g}× SLO ({k * slo:.3g} ms)" for k in SLO_FACTORS)], sens),
    ]


def cost(figs: list[VariantFigures], ctx: StudyContext) -> list[str]:
    """What the hardware bill sees: server CPU per request at the common load, and capacity per core."""
    cores = ctx.study.server_cores if ctx.study else 0
    rows = []
    for f in figs:
        lat = f.latency.get("common")
        cpu = lat.stages().get("cpu_per_request_ms") if lat else None
        if cpu is None and f.max_qps is None:
            continue
        per_core = spread(scaled(f.max_qps, 1 / cores), ".1f") if f.max_qps is not None and cores else DASH
        rows.append([f"`{f.name}`", num(cpu), num(1000 / cpu, ".0f") if cpu else DASH, per_core])
    if not rows:
        return ["No load runs."]
    pinned = (
        f"{cores} server core{'s' * (cores != 1)}" if cores else "an unpinned server (no per-core figure)"
    )
    return [
        "Server CPU per answered request = the server processes' CPU seconds (every thread: event loop, "
        "ranking, batching; `reco_process_cpu_seconds` in /metrics) over the common-load windows / the "
        "requests they answered; its inverse is what one fully busy core could answer. Max QPS at the SLO "
        f"per core divides the capacity (median over repeats, range in parentheses) by the study's {pinned}.",
        "",
        *table(
            ["variant", "server CPU ms / request", "requests per CPU-second", "max QPS @SLO per core"], rows
        ),
    ]


def _ratio_range(c: dict[str, float]) -> Estimate:
    """Server CPU / model CPU of server_cpu_split: the median with the range over its repeats."""
    keys = ("cpu_over_model_cpu", "cpu_over_model_cpu_rep_min", "cpu_over_model_cpu_rep_max")
    return Estimate(*(c[k] for k in keys), int(c["cpu_split_n_repeats"]))


def overhead(figs: list[VariantFigures]) -> list[str]:
    """A request's server CPU at the common load split by stage, beside the model's in-process cost."""
    rows = []
    for f in figs:
        lat = f.latency.get("common")
        c = server_cpu_split(lat) if lat else {}
        if not c:
            continue
        m, ms = f.result.variant.metrics, {p: c[f"cpu_per_request_{p}_ms"] for p in (*CPU_PARTS, "rest")}
        rows.append(
            [
                f"`{f.name}`",
                num(sum(ms.values())),
                num(ms["model"]),
                num(ms["retrieval"] + ms["features"]),
                num(ms["parse"] + ms["serialize"]),
                num(ms["rest"]),
                _pct(c["cpu_non_model_share"]),
                spread(_ratio_range(c), ".2f"),
                num(m.get("rank_p50_ms")),
                num(m.get("rank_floor_ms")),
            ]
        )
    if not rows:
        return ["No split of the server's CPU (a server without `reco_model_cpu_seconds`, or no load runs)."]
    header = ["variant", "server CPU ms / request", "model calls", "candidates + features",
              "parse + encode", "rest (HTTP, event loop)", "non-model share",
              "server CPU / model CPU (goal ≤ 1.5)", "rank p50 ms in-process", "FLOP floor ms"]  # fmt: skip
    return [
        "Where a request's server CPU goes (ms per answered request, the same common-load windows and "
        "scrapes as above, median over the repeats): `model calls` = the model calls' CPU "
        "(`reco_model_cpu_seconds`, each call once: a batched call's is shared among its requests by "
        "candidate rows); `candidates + features` and `parse + encode` = the event loop thread's CPU in "
        "retrieval and feature assembly, and in reading and validating the body and in top-k, the JSON "
        "body, Server-Timing and the metrics (`reco_cpu_seconds{stage}`); `rest` = the server CPU − those: "
        "HTTP parsing, the ASGI layers, the hand-off to the model's thread and back, writing the answer, "
        "other threads (a two-tower retrieval runs on the model's threads and lands here). Non-model share "
        "= 1 − model calls / server CPU; server CPU / model CPU is issue 45's overhead ratio (median, the "
        "range of the per-repeat ratios and how many: a range, not a CI). Beside them the model's "
        "in-process cost: rank p50 (one request's call, unloaded, one thread) and its FLOP floor (see "
        "*Inside one ranking call*).",
        "",
        *table(header, rows),
    ]


def _rel_auc(f: VariantFigures) -> float | None:
    """Relative ΔAUC vs the baseline (0 for the baseline itself)."""
    if f.is_baseline:
        return 0.0
    return f.result.auc_delta[1].value if f.result.auc_delta else None


def attribution(figs: list[VariantFigures]) -> list[str]:
    """Parent -> child: what each step bought in latency and throughput and cost in AUC."""
    by_name = {f.name: f for f in figs}
    rows = []
    for f in figs:
        parent = by_name.get(f.result.variant.parent or "")
        if parent is None or not (f.ok and parent.ok):
            continue
        a, b = _rel_auc(f), _rel_auc(parent)
        d_auc = a - b if a is not None and b is not None else None
        size = parent.result.variant.size_mb / f.result.variant.size_mb if f.result.variant.size_mb else None
        rows.append(
            [
                f.result.variant.step,
                f"`{parent.name}` → `{f.name}`",
                f"{short(parent.p99())} → {short(f.p99())}",
                num(None if d_auc is None else d_auc * 100, "+.2f"),
                num(size, ".2f"),
                short(capacity_gain(f, parent), ".2f", "×"),
            ]
        )
    if not rows:
        return ["No variant with a successful parent to compare against."]
    header = [
        "step",
        "parent → variant",
        "e2e p99 ms @common",
        "ΔAUC vs parent % (point)",
        "× smaller",
        "QPS ×",
    ]
    return [
        "Size: parent / child (> 1: smaller); QPS: child / parent median capacity at the SLO, in brackets the "
        "range over every pair of the two rows' repeats' capacity brackets (as the QPS gain vs the baseline: "
        "a range, not a CI). ΔAUC vs parent is the difference of the two ΔAUCs vs the baseline (point "
        "estimates; the CIs are vs the baseline).",
        "",
        *table(header, rows),
    ]


def distillation(figs: list[VariantFigures]) -> list[str]:
    """What the teacher adds: each distilled student against its no-teacher control (validation split)."""
    rows = []
    for f in figs:
        m = f.result.variant.metrics
        if f.result.variant.step != "distill" or "kd_gain_val_auc" not in m:
            continue
        lo, hi = m["kd_gain_val_auc_lo"], m["kd_gain_val_auc_hi"]
        verdict = (
            "**gain** (CI above 0)"
            if lo > 0
            else "**loss** (CI below 0)"
            if hi < 0
            else "not shown (CI spans 0)"
        )
        rows.append(
            [
                f"`{f.name}`",
                num(m.get("size_ratio"), ".2f"),
                num(m.get("teacher_val_auc"), ".4f"),
                num(m["student_val_auc"], ".4f"),
                num(m["control_val_auc"], ".4f"),
                f"{m['kd_gain_val_auc']:+.4f} [{lo:+.4f}, {hi:+.4f}]",
                verdict,
            ]
        )
    if not rows:
        return ["No distilled variant with a control (distill.control=false, or no distill step)."]
    header = ["variant", "× fewer params", "teacher val AUC", "student val AUC", "control val AUC",
              "KD gain [95% CI]", "what the teacher adds"]  # fmt: skip
    return [
        "The control is the same student (architecture, initialisation, data, budget, seed) trained on the "
        "labels alone; KD gain = student AUC − control AUC on the validation split, with a paired DeLong "
        "95% CI (same rows). Validation, not test: these runs chose the distillation settings.",
        "",
        *table(header, rows),
    ]


def embedding_compression(figs: list[VariantFigures]) -> list[str]:
    """Each embed_quant variant: the precision chosen per table and why, and what it bought overall."""
    by_name = {f.name: f for f in figs}
    blocks: list[list[str]] = []
    for f in figs:
        v, m = f.result.variant, f.result.variant.metrics
        if v.step != "embed_quant" or "emb_size_ratio" not in m:
            continue
        parent = by_name.get(v.parent or "")
        tables = sorted(
            k[len("emb_") : -len("_bits")] for k in m if k.startswith("emb_") and k.endswith("_bits")
        )
        rows = [
            [f"`{t}`", f"{m[f'emb_{t}_bits']:g}", num(100 * m[f"emb_{t}_val_auc_drop"], "+.4f")]
            for t in tables
        ]
        rank = f"{num(parent.result.variant.metrics.get('rank_p50_ms'), '.2f')} → " if parent else ""
        auc = short(f.result.auc_delta[1], "+.2%") if f.result.auc_delta else DASH
        blocks.append(
            [
                f"`{f.name}` (from `{v.parent}`, backend {v.backend}): embedding tables "
                f"{m['emb_fp32_mb']:.1f} → {m['emb_mb']:.1f} MB (**{m['emb_size_ratio']:.2f}× smaller**), model file "
                f"**{m['model_size_ratio']:.2f}× smaller**; validation AUC drop (relative) {100 * m['emb_tables_val_auc_rel_drop']:.3f}% "
                f"from the tables, {100 * m['emb_val_auc_rel_drop']:.3f}% for the whole variant; test ΔAUC vs the "
                f"baseline {auc}; in-process rank p50 {rank}{num(m.get('rank_p50_ms'), '.2f')} ms.",
                "",
                *table(["table", "bits", "val AUC drop % with only this table quantized (relative)"], rows),
            ]
        )
    if not blocks:
        return ["No embed_quant variant in this study."]
    lines = [
        "Each table gets the fewest bits whose validation AUC drop, with only that table quantized, stays "
        "within `embed_quant.table_budget`; the whole variant must stay within `embed_quant.budget` "
        "(validation split; the test split is read once, for the ΔAUC above).",
    ]
    for block in blocks:
        lines += ["", *block]
    return lines


def repeats(figs: list[VariantFigures]) -> list[str]:
    """Median and range across repeats of every kind of run (drift shows here, not in the pooled CI)."""
    rows = []
    for f in figs:
        for kind in KINDS:
            lat = f.latency.get(kind)
            if lat is None:
                continue
            invalid = f" ({lat.n_invalid} invalid)" if lat.n_invalid else ""
            rows.append(
                [
                    f"`{f.name}`",
                    KIND_LABEL[kind],
                    f"{len(lat.runs)}{invalid}",
                    spread(lat.spread("p50")),
                    spread(lat.spread("p99")),
                    est(lat.quantiles["p99"]),
                    num(lat.offered_qps, ".1f"),
                ]
            )
    if not rows:
        return ["No load runs."]
    header = [
        "variant",
        "run",
        "repeats",
        "p50 ms median (range)",
        "p99 ms median (range)",
        "p99 pooled",
        "offered",
    ]
    return table(header, rows)


def stages(figs: list[VariantFigures]) -> list[str]:
    """Client e2e vs the server's handler total at the common load, and the gap between them."""
    rows = []
    for f in figs:
        lat = f.latency.get("common")
        if lat is None:
            continue
        st, out = lat.stages(), outside_handler(lat)
        rows.append(
            [
                f"`{f.name}`",
                num(lat.mean_ms),
                num(st.get("server_total_mean_ms")),
                num(out.get("outside_handler_mean_ms")),
                short(lat.quantiles["p99"]),
                num(st.get("server_total_p99_ms")),
                num(out.get("outside_handler_p99_ms")),
                num(st.get("server_retrieval_p99_ms")),
                num(st.get("server_features_p99_ms")),
                num(st.get("server_queue_p99_ms")),
                num(st.get("server_rank_p99_ms")),
                num(st.get("cpu_rank_p99_ms")),
            ]
        )
    if not rows:
        return ["No load runs."]
    header = [
        "variant",
        "e2e mean",
        "server total mean",
        "outside mean",
        "e2e p99",
        "server total p99",
        "outside p99",
        "retrieval p99",
        "features p99",
        "queue p99",
        "rank p99",
        "rank CPU p99",
    ]
    return [
        "The server's `total` (Server-Timing and Prometheus) runs from handler entry to just before the "
        "response body is written; accept, HTTP parsing, event-loop backlog, writing the body and the "
        "network are **outside the handler** = client e2e − server total (ms). Inside it: `retrieval` (the "
        "candidates: heuristic lists, or the two-tower's user vector and its index search), `features` (the "
        "user's and candidates' feature rows: in-process tables, or one Redis MGET), `queue` (waiting for "
        "the admission gate and the model's thread), `rank` (the model call and top-k). Server quantiles come from "
        "Prometheus buckets (interpolated), and a difference of p99s is only indicative. `rank CPU` is the "
        "CPU time of the thread that made the model call (the whole call at one intra-op thread): beside "
        "the rank stage's wall time it tells a slower CPU (both grow: contention for memory or caches, a "
        "lower clock) from a call that waited for one (only the wall time grows).",
        "",
        *table(header, rows),
    ]


def retrieval(ctx: StudyContext) -> list[str]:
    """Where the candidates came from and, for a two-tower stage, its index front."""
    head = f"Candidates: {ctx.retrieval or 'not recorded'} (serve.retrieval)."
    f = ctx.front
    if f is None:
        return [
            head + " The two-tower stage and its FAISS front (serve.retrieval.kind=two_tower): "
            "experiments/retrieval/README.md in the reco repository; a 1M-item catalogue: "
            "experiments/ann_catalogue/README.md."
        ]

    def e(d: dict, spec: str, unit: str = "") -> str:
        return Estimate(d["value"], d["lo"], d["hi"], d["n"]).fmt(spec, unit)

    rows = [
        [
            r["index"] + (" **(served)**" if r["served"] else ""),
            e(r["recall"], ".3f"),
            e(r["p50_ms"], ".3f"),
            e(r["p99_ms"], ".3f"),
            e(r["speedup"], ".2f", "×"),
            f"{r['build_s']:.1f}",
        ]
        for r in f["rows"]
    ]
    return [
        head + f" The index front over the stage's {f['items']:,} item vectors ({f['dim']} dims), "
        f"{f['queries']:,} validation users as queries, N = {f['n']} candidates: recall@N against the exact "
        "search (bootstrap CI over users), one query per call on one FAISS thread (order-statistic CIs), "
        "the speed-up of the p50 against the exact search's (retrieval.front; reco/retrieval/front.py).",
        "",
        *table(["index", "recall@N vs exact", "p50 ms", "p99 ms", "speed-up p50", "build s"], rows),
    ]


def rank_profile(figs: list[VariantFigures]) -> list[str]:
    """The profiled ranking call of each variant split into model stages (reco.profile), beside its
    in-process rank p50 and the call's FLOP floor on this machine."""
    rows, peak = [], None
    for f in figs:
        m = f.result.variant.metrics
        total = m.get("profile_rank_ms")
        if total is None:
            continue
        cells = [
            f"{num(m[f'profile_{s}_ms'])} ({m[f'profile_{s}_ms'] / total:.0%})"
            if f"profile_{s}_ms" in m
            else "–"
            for s in STAGES
        ]
        p50, floor = m.get("rank_p50_ms"), m.get("rank_floor_ms")
        times = f"{p50 / floor:.1f}×" if p50 and floor else "–"
        peak = m.get("gemm_peak_gflops", peak)
        rows.append(
            [f"`{f.name}`", f.result.variant.backend, num(total), *cells, num(p50), num(floor), times]
        )
    if not rows:
        return ["Not profiled (profile.enabled=false)."]
    return [
        "One request's ranking call (serve.n_candidates candidates, one thread) under the runtime's profiler, "
        "mean ms per call (share of the call), in the form the service runs (serve.user_once: the user's "
        "and the context's embeddings computed once per request). embedding = id mapping, table gathers and "
        "pooling; interaction = the model's head besides its MLPs (DLRM's pairwise dots, DCN's cross net); "
        "mlp = bottom and top MLPs; other = the rest of the call (broadcasting the request's embeddings, "
        "sigmoid, runtime overhead). Profiling adds overhead, so the call is slower than the in-process rank "
        "p50. FLOP floor = the model's FLOPs per candidate × candidates / this machine's one-thread fp32 "
        f"GEMM peak ({num(peak)} GFLOP/s, a 512³ matmul; reco.measure.gemm_peak_gflops): the call's time if "
        "every FLOP ran at that peak (an INT8 graph's matmuls can beat it). The traces are in each "
        "variant's MLflow run under `profile/` (chrome://tracing or Perfetto).",
        "",
        *table(
            ["variant", "backend", "call ms", *STAGES, "rank p50 ms", "FLOP floor ms", "p50 / floor"], rows
        ),
    ]


def served_topk(figs: list[VariantFigures], gates: dict[str, Gate], ctx: StudyContext) -> list[str]:
    """What users see: each variant's served top-k over the same requests, graded by the planted P(click)
    where the data has one, its GAUC, and the logged measures; the reference rankers beside them (no
    gate); flags a pass on AUC with a fail here."""
    qs = [f for f in figs if f.result.quality is not None or f.result.gauc is not None]
    if not qs:
        return ["Not measured (`quality.users=0` and no test scores, or no variant has a served top-k)."]
    refs = ctx.references
    ks = [x.k for f in qs for x in (f.result.quality, f.result.graded) if x is not None]
    k = ks[0] if ks else None
    head = [
        "What decides it is the measure with ground truth. On data with a planted click model every "
        "candidate of a request is graded by its true P(click): **expected clicks@k** (their sum over the "
        "served top-k) and **oracle NDCG@k** (DCG with gain = true P(click), over the best DCG among that "
        "request's candidates); no request scores 0. **GAUC** is the AUC within each user on the test split "
        "(users with a positive and a negative), weighted by the user's rows: what ordering one user's items "
        "earns, on any data. Logged NDCG@k / recall@k count an item relevant when it was shown *and* clicked, "
        "so they reward popularity: they are reported, not gating. The reference rows rank the same "
        "candidates by training impressions (`popularity`) and by the true P(click) (`oracle`): they are not "
        "variants and have no gate. 95 % bootstrap CIs over requests (users for GAUC); every Δ is relative to "
        "the baseline and paired (the same requests or users resampled for both). They judge the trained "
        "model that is served, not the recipe: another training seed gives another student, whose expected "
        "clicks move by about as much as the KD gain (experiments/kd_trials compares recipes over 3 seeds).",
        "",
    ]
    if not ctx.planted:
        head += [
            "The oracle-graded measures do not apply: no planted click probabilities for these requests (data "
            "without a click model, or `quality.users=0`).",
            "",
        ]
    rows = []
    for f in qs:
        g = gates[f.name]
        flag = ""
        if g.quality is not None and g.accuracy.verdict == Verdict.PASS and g.quality.verdict == Verdict.FAIL:
            flag = " **passes on AUC, fails on what users see**"
        verdict = (str(g.quality.verdict) if g.quality else DASH) + flag
        rows.append(_truth_row(f"`{f.name}`", f.is_baseline, f.result.graded, f.result.gauc, ctx, verdict))
    rows += [_truth_row(f"*{r.name}* (reference)", False, r.graded, r.gauc, ctx, DASH) for r in refs]
    cols = ["variant", "GAUC", "ΔGAUC"]
    if ctx.planted:
        cols = ["variant", f"expected clicks@{k}", f"Δexpected clicks@{k}", f"oracle NDCG@{k}",
                f"Δoracle NDCG@{k}", "GAUC", "ΔGAUC"]  # fmt: skip
    out = head + table([*cols, "gate"], rows) + _looks_note(qs, ctx)
    logged = [(f"`{f.name}`", f.is_baseline, f.result.quality) for f in qs if f.result.quality is not None]
    logged += [(f"*{r.name}* (reference)", False, r.quality) for r in refs]
    if not logged:
        return out
    n = logged[0][2].ndcg.n  # the baseline's: every request
    lrows = [
        [
            name,
            short(q.ndcg, ".4f"),
            short(q.recall, ".4f"),
            vs_base(is_base, scaled(q.ndcg_delta, 100), "+.2f", "%", reference="0"),
            short(q.overlap, ".3f") if q.overlap else DASH,
            short(q.rbo, ".3f") if q.rbo else DASH,
        ]
        for name, is_base, q in logged
    ]
    out += [
        "",
        f"Logged measures over the same {n:,} requests (fewer where a variant stopped at a look, as above; "
        "test users with a positive, each with the service's "
        f"own candidates and ranking; reco/serve/quality.py): NDCG@{k} and recall@{k} of the top-{k} against "
        f"the user's positive test items (ir-measures); overlap@{k} and rank-biased overlap (p as configured, "
        f"normalised so identical lists score 1) against the baseline's top-{k} for the same request.",
        "",
        *table(["variant", f"NDCG@{k}", f"recall@{k}", f"ΔNDCG@{k}", f"overlap@{k}", "RBO"], lrows),
    ]
    return out


def _looks_note(qs: list[VariantFigures], ctx: StudyContext) -> list[str]:
    """Which variants answered fewer requests than the baseline: they stopped at a look (quality.looks)."""
    base = next((f.result.quality for f in qs if f.is_baseline and f.result.quality), None)
    if base is None or ctx.look_confidence is None:
        return []
    n = base.ndcg.n
    short_ = [
        f"`{f.name}` {f.result.quality.ndcg.n:,}"
        for f in qs
        if f.result.quality and f.result.quality.ndcg.n < n
    ]
    if not short_:
        return []
    return [
        "",
        f"Answered in looks (`quality.looks`, in a seeded random order of the {n:,} requests): a variant stops "
        f"at the first look where its paired {ctx.look_confidence:.1%} interval of Δexpected clicks lies wholly "
        "on one side of the gate's limit (Haybittle-Peto: the looks spend almost none of the last look's 5 %), "
        "and its figures rest on the requests it answered, paired with the baseline's answers to them: "
        + ", ".join(short_)
        + " requests.",
    ]


def _truth_row(
    name: str, is_base: bool, graded: GradedQuality | None, gauc: GAUC | None, ctx: StudyContext, verdict: str
) -> list[str]:
    grouped = [
        short(gauc.value, ".4f") if gauc else DASH,
        vs_base(is_base, scaled(gauc.delta, 100) if gauc else None, "+.2f", "%", reference="0"),
    ]
    if not ctx.planted:
        return [name, *grouped, verdict]
    g = graded
    return [
        name,
        short(g.clicks, ".3f") if g else DASH,
        vs_base(is_base, scaled(g.clicks_delta, 100) if g else None, "+.2f", "%", reference="0"),
        short(g.ndcg, ".4f") if g else DASH,
        vs_base(is_base, scaled(g.ndcg_delta, 100) if g else None, "+.2f", "%", reference="0"),
        *grouped,
        verdict,
    ]


def correctness(figs: list[VariantFigures]) -> list[str]:
    """Scores under load vs offline scores, per variant; a batched serving's bound says how much of it the
    runtime's batch dependence takes (reco.loadtest.correctness)."""
    rows, batched = [], False
    for f in figs:
        c = f.result.load.correctness if f.result.load else None
        if c is not None:
            verdict = "PASS" if c.passed else "**FAIL**"
            bound = f"{c.tolerance:.0e}"
            if c.allowed > c.tolerance:
                batched, bound = (
                    True,
                    f"{c.allowed:.1e} ({BATCH_MARGIN:g} × batch spread {c.batch_spread:.1e})",
                )
            rows.append([f"`{f.name}`", f"{c.n_requests:,}", f"{c.max_abs_diff:.2e}", bound, verdict])
    if not rows:
        return ["Not checked in this study."]
    out = table(["variant", "requests checked", "max |Δ score|", "allowed", "verdict"], rows)
    if batched:
        out += [
            "",
            "A batched serving scores each request together with whatever arrived with it; a runtime "
            "whose scores depend on that company (dynamic INT8 takes each activation's scale from the "
            "whole call) is allowed twice the widest difference between a request's scores in offline "
            "batches and alone (its batch spread). A batcher that mixed up rows would differ by far more.",
        ]
    return out


def invalid_runs(figs: list[VariantFigures]) -> list[str]:
    """Every run whose generator could not vouch for it; excluded from figures and verdicts."""
    lines = []
    for f in figs:
        for kind, lat in f.latency.items():
            for i, r in enumerate(lat.runs, 1):
                if not r.valid:
                    lines.append(
                        f"- `{f.name}` {KIND_LABEL[kind]} run {i}: {one_line(r.invalid_reason) or 'no reason'} "
                        f"(load generator CPU {r.loadgen_cpu_pct:.0f} %)"
                    )
        for i, c in enumerate(f.capacity, 1):
            bad = [s for s in c.steps if not s.run.valid]
            if bad:
                rates = ", ".join(f"{s.rate:g}" for s in bad)
                lines.append(f"- `{f.name}` capacity search {i}: steps at {rates} req/s invalid")
    return lines


def capacity_steps(figs: list[VariantFigures]) -> list[str]:
    """Every step of every capacity search, per variant."""
    out = []
    for f in figs:
        if not f.capacity:
            continue
        rows = [
            [
                str(i),
                f"{s.rate:g}",
                f"{s.run.qps:.1f}",
                f"{s.run.n:,}",
                short(s.run.quantiles.get("p99")),
                f"{s.run.error_rate:.2%}",
                "yes" if s.run.valid else f"**no**: {s.run.invalid_reason}",
                str(s.verdict),
                s.reason,
            ]
            for i, c in enumerate(f.capacity, 1)
            for s in sorted(c.steps, key=lambda s: s.rate)
        ]
        header = ["repeat", "rate", "achieved QPS", "n", "p99 ms [CI]", "errors", "valid", "verdict", "why"]
        out += [f"### `{f.name}`", "", *table(header, rows), ""]
    return out or ["No capacity search was run."]


def learning_curve(figs: list[VariantFigures]) -> list[str]:
    """The baseline's training per epoch, whether it stopped on validation AUC, and its gap to the oracle."""
    base = next(f for f in figs if f.is_baseline)
    curve = base.result.variant.learning_curve
    if not curve:
        return [
            "Not recorded (the baseline was not trained by the train step, or was built before it was kept)."
        ]
    best = max(range(len(curve)), key=lambda i: curve[i]["val_auc"])
    rows = [
        [
            str(i + 1)
            + (" (kept)" if i == best else "")
            + (f" (stopped {r['epoch_fraction']:.0%} in)" if "epoch_fraction" in r else ""),
            num(r["train_loss"], ".4f"),
            num(r["val_auc"], ".4f"),
            num(r.get("val_logloss"), ".4f"),
        ]
        for i, r in enumerate(curve)
    ]
    if best < len(curve) - 1:
        why = (
            f"Validation AUC peaked at epoch {best + 1} and did not improve for the {len(curve) - 1 - best} "
            "epoch(s) after it: training stopped there (early stopping, `trainer.patience`), the kept "
            "weights are the best epoch's."
        )
        if "epoch_fraction" in curve[-1]:
            why += (
                f" The last epoch stopped after {curve[-1]['epoch_fraction']:.0%} of its rows, its validation "
                "AUC already more than `trainer.stop_check_margin` below the best "
                "(`trainer.stop_check_fraction`)."
            )
    else:
        why = (
            f"The best epoch is the last one trained ({len(curve)}): validation AUC was still rising or the "
            "budget (`trainer.epochs`) ended training, so convergence is **not shown**."
        )
    m = base.result.variant.metrics
    auc, oracle = m.get("auc"), m.get("oracle_auc")
    gap = (
        f" Test AUC {auc:.4f} vs the oracle's {oracle:.4f}: {oracle - auc:.4f} below the ceiling "
        "(`python -m reco.cli.learnability` splits that gap into what the data let a model learn and what not)."
        if auc is not None and oracle is not None
        else ""
    )
    return [why + gap, "", *table(["epoch", "train loss", "val AUC", "val logloss"], rows)]
