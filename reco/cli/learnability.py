"""python -m reco.cli.learnability [--scores VARIANT_DIR/test_scores.npy] [data overrides ...]

How much of the synthetic data's planted click model a model can learn, and where a model falls short
(what it prints and why: reco.learnability).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reco.cli.compose import compose
from reco.cli.errors import exits_cleanly
from reco.config import ConfigError, typed
from reco.data.synthetic import SyntheticConfig, simulate
from reco.learnability import load_scores, report


@exits_cleanly("reco.learnability")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reco.cli.learnability", description=__doc__.splitlines()[0])
    ap.add_argument("--scores", type=Path, help="a variant's test_scores.npy (from the same data config)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data.params.n_users=20000")
    args = ap.parse_args(argv)
    data = compose(args.overrides).data
    if data.loader != "synthetic_ecommerce":
        raise ConfigError(f"data.loader={data.loader}: only synthetic_ecommerce has a planted click model")
    sim = simulate(typed(data.params, SyntheticConfig, "data.params"))
    scores = None if args.scores is None else load_scores(args.scores, len(sim.dataset.test.labels))
    print(report(sim, scores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
