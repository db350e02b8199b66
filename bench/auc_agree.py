"""Do two variants score the test split alike? Their AUCs and the paired ΔAUC (B - A) with its DeLong CI,
from each variant's stored test scores (the same test rows, so the difference is paired).

Used for issue 31: the baseline trained on 2 ranks against the single-process one of the same config.

    python -m bench.auc_agree A_VARIANT_DIR B_VARIANT_DIR experiment=ecommerce_case_study

A variant directory is `<cache_dir>/variants/<name>-<key>` (its record lists `test_scores`); the Hydra
overrides name the data config both were trained on. Exits 1 when the CI excludes 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import NormalDist

from reco.cli.compose import compose
from reco.cli.errors import exits_cleanly
from reco.data import load_dataset
from reco.data.config import data_config
from reco.measure import load_scores
from reco.stats import CONF, auc_delta, delong
from reco.variant import Variant


@exits_cleanly("bench.auc_agree")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.auc_agree", description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="variant directory A (the reference)")
    ap.add_argument("b", type=Path, help="variant directory B")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides naming the data, e.g. experiment=smoke")
    args = ap.parse_args(argv)
    cfg = compose(args.overrides)
    data, _ = load_dataset(data_config(cfg.data), Path(cfg.cache_dir) / "data")
    labels = data.test.labels.numpy()
    scores = []
    for d in (args.a, args.b):
        v = Variant.load(d)
        if "test_scores" not in v.artifacts:
            raise ValueError(f"{d}: the variant record lists no test_scores (expected a trained variant)")
        s = load_scores(v.verify("test_scores")).reshape(-1)
        if len(s) != len(labels):
            raise ValueError(f"{d}: {len(s):,} test scores, the data's test split has {len(labels):,} rows")
        scores.append(s)
    aucs, cov = delong(labels, scores)
    absolute, relative = auc_delta(labels, scores[0], scores[1])
    z = NormalDist().inv_cdf(1 - (1 - CONF) / 2)
    for i, d in enumerate((args.a, args.b)):
        print(f"{'AB'[i]} {d.name}: AUC {aucs[i]:.4f} ± {z * cov[i, i] ** 0.5:.4f}")
    print(
        f"B - A: {absolute.value:+.4f} [{absolute.lo:+.4f}, {absolute.hi:+.4f}] "
        f"({100 * relative.value:+.2f}% [{100 * relative.lo:+.2f}, {100 * relative.hi:+.2f}]), "
        f"paired DeLong 95% CI, {len(labels):,} test rows"
    )
    same = absolute.lo <= 0 <= absolute.hi
    print("the same within the CI" if same else "DIFFERENT: the CI excludes 0")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
