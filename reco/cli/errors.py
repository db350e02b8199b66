"""A user's mistake (bad data, a bad override, a missing file) ends an entry point with the one clear
message reco already builds and a non-zero exit, not a Python traceback. RECO_TRACEBACK=1 shows it anyway.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., int])


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions whose message is written for the user: a ConfigError, StepError, data and serving errors
    (ValueError subclasses), missing files, artifacts that fail their SHA-256 check, unreachable servers,
    a distributed training whose rank failed or whose hosts did not all come."""
    from hydra.errors import HydraException

    from reco.loadtest.runner import LoadTestError
    from reco.serve.process import ServerStartError
    from reco.tracking import TrackingError
    from reco.tracking_server import TrackingServerError
    from reco.train.launch import DistributedTrainingError
    from reco.variant import ArtifactError

    return (
        ValueError,
        OSError,
        HydraException,
        ArtifactError,
        LoadTestError,
        ServerStartError,
        TrackingError,
        TrackingServerError,
        DistributedTrainingError,
    )


def report(prog: str, e: BaseException) -> int:
    """Print `prog: <Type>: <message>` (and its cause's first line) to stderr and return 2; with
    RECO_TRACEBACK=1 re-raise `e` instead. Call it from the `except` clause that caught `e`."""
    if os.environ.get("RECO_TRACEBACK"):
        raise e
    cause = f" ({str(e.__cause__).splitlines()[0]})" if e.__cause__ else ""
    print(f"{prog}: {type(e).__name__}: {e}{cause}", file=sys.stderr)
    return 2


def exits_cleanly(prog: str) -> Callable[[F], F]:
    """Decorate an entry point's main: a user error prints its message and returns 2 (see module doc)."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def main(*args, **kwargs) -> int:
            try:
                return fn(*args, **kwargs)
            except user_errors() as e:
                return report(prog, e)

        return main  # type: ignore[return-value]

    return wrap
