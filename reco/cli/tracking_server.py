"""python -m reco.cli.tracking_server [tracking.server.port=5001 ...]: a shared MLflow tracking server.

Runs `mlflow server` with the `tracking.server` settings (conf/tracking/default.yaml): a sqlite backend
store and a proxied artifact store, bound to 127.0.0.1. Experiments then log over HTTP with
`python run.py ... tracking.uri=http://127.0.0.1:5000` (`make mlflow-server`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from reco.cli.compose import compose
from reco.cli.errors import exits_cleanly
from reco.config import typed
from reco.tracking_server import (
    TrackingServerConfig,
    check_port_free,
    server_command,
    server_environment,
)


@exits_cleanly("reco.cli.tracking_server")
def main(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    c = typed(compose(argv).tracking.server, TrackingServerConfig, "tracking.server")
    check_port_free(c.host, c.port)
    if c.backend_store_uri.startswith("sqlite:///"):
        Path(c.backend_store_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    cmd = server_command(c)
    print(f"MLflow tracking server on http://{c.host}:{c.port} (use tracking.uri=http://{c.host}:{c.port})")
    print(" ".join(cmd), flush=True)
    os.execve(cmd[0], cmd, server_environment(c))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
