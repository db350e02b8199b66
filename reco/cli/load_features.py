"""python -m reco.cli.load_features --dataset PATH.pt [key=value ...]: write a dataset's feature rows to Redis.

For serve.features=redis against a Redis you run yourself (a study with serve.redis.start=true starts
its own and loads it). The overrides are keys of the `serve` group (conf/serve/default.yaml), e.g.
`redis.host=127.0.0.1 redis.port=6380`. Loading again is a no-op while the store holds the same rows.
"""

from __future__ import annotations

import argparse
import sys

from reco.cli.errors import report, user_errors


def main(argv: list[str] | None = None) -> int:
    """Load the rows; 0 when Redis holds them, 2 (reason on stderr) when it cannot."""
    from reco.cli.serve import settings
    from reco.data.schema import Dataset
    from reco.serve.features import FeatureStore
    from reco.serve.redis_features import load_features

    p = argparse.ArgumentParser(prog="reco.cli.load_features", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True, help="Dataset .pt file whose train split holds the rows")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the serve settings (redis.port=...)")
    args = p.parse_args(argv)
    try:
        cfg = settings(args.overrides)
        data = Dataset.load(args.dataset)
        r = load_features(FeatureStore(data, cfg.retrieval), data.fingerprint, cfg.redis)
    except user_errors() as e:
        return report("reco.cli.load_features: cannot load", e)
    what = "already held" if r.reused else f"wrote {r.bytes / 1e6:.1f} MB in {r.seconds:.1f} s"
    print(f"redis {cfg.redis.host}:{cfg.redis.port}: {r.n_users} users, {r.n_items} items ({what})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
