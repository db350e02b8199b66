"""python -m reco.cli.triton_server --variant DIR --dataset PATH.pt [--host H] [--port P] [--settings F] [key=value ...]

serve.backend=triton: the variant served by Triton Inference Server through PyTriton
(reco/serve/triton_backend.py), with the same command line and settings as `python -m reco.cli.serve`.
Runs under `.venv-triton`'s interpreter (`make triton-venv`).
"""

from __future__ import annotations

import sys

from reco.cli.serve import start


def main(argv: list[str] | None = None) -> int:
    """0 after a requested stop, 1 when tritonserver died, 2 when it could not start."""
    from reco.serve.triton_backend import serve

    return start("reco.serve.triton_backend", argv, serve)


if __name__ == "__main__":
    sys.exit(main())
