"""Where would quality.looks stop each variant? A replay on a preset's finished variants.

    python -m bench.quality_looks                               # experiment=ecommerce_case_study
    python -m bench.quality_looks --looks 2000 4000 cache_dir=.cache

Every variant of the preset finished in the cache (reco.pipeline.finished_variants: nothing is built)
answers all quality.users requests: its lists with quality.looks=[] where cached, else scored now as the
build scores them, and kept. Then, in the looks' order (reco.serve.quality.look_order), each look's paired
Δexpected clicks@k against the baseline's on the same requests is printed at quality.look_confidence
(the last, all requests: the gate's 95 %) with the verdict it gives against gate.max_expected_clicks_drop_pct;
`<-` marks the first look that decides, where TopK.measure stops. Needs data with a planted click model.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from reco.cli.compose import compose
from reco.data import load_dataset
from reco.experiment import experiment_config
from reco.pipeline import TopK, finished_variants
from reco.serve.quality import look_rows
from reco.stats import CONF, Verdict, verdict_at_least
from reco.stats.graded import clicks_delta, graded_per_request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experiment", default="ecommerce_case_study")
    ap.add_argument(
        "--looks", type=int, nargs="*", help="request counts (default: the preset's quality.looks)"
    )
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as run.py takes them")
    a = ap.parse_args()
    exp = experiment_config(compose([f"experiment={a.experiment}", *a.overrides]))
    q = exp.quality
    looks = list(a.looks if a.looks is not None else q.looks)
    data, _ = load_dataset(exp.data, exp.cache_dir / "data")
    topk = TopK(dataclasses.replace(exp, quality=dataclasses.replace(q, looks=[])), data)
    truth = topk.truth
    variants = finished_variants(exp, data)
    root = exp.variants[0].name
    if truth is None or root not in variants:
        sys.exit(
            f"bench.quality_looks: needs a planted click model and the finished {root!r} in {exp.cache_dir}"
        )
    clicks = {}
    for name, v in variants.items():
        print(f"[{name}] all {q.users:,} requests' lists", flush=True)
        topk.measure(v)
        v.save()  # the lists are kept with the variant, as the build keeps them
        clicks[name] = graded_per_request(truth.gains_of(topk.load(v)), truth.gains)["clicks"]
    base, n = clicks.pop(root), len(truth.gains)
    limit = -exp.gate.max_expected_clicks_drop_pct / 100
    print(f"\nΔexpected clicks@{q.k} vs {root!r}, limit {limit:+.2%}; looks at {looks} of {n:,}")
    for name, x in clicks.items():
        cells, stopped = [], False
        for m in [*(m for m in looks if m < n), n]:
            conf = q.look_confidence if m < n else CONF
            r = look_rows(n, m, exp.seed)
            e = clicks_delta(x[r], base[r], q.k, exp.seed, conf)
            verdict = verdict_at_least(e, limit)
            mark = " <-" if verdict != Verdict.INCONCLUSIVE and not stopped else ""
            stopped |= bool(mark)
            cells.append(
                f"{m:,} ({conf:.1%}): {100 * e.value:+.2f}% [{100 * e.lo:+.2f}, {100 * e.hi:+.2f}] {verdict}{mark}"
            )
        print(f"  {name}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
