"""Test-only fault injection (serve.faults): a model that is slow for its first calls.

The service's timeout and recovery paths are tested against a real server; this is how that server's
model is made slow on purpose. Every serve.faults value is 0 in conf/serve/default.yaml, which leaves
the scorer untouched.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from reco.runtime import Scorer
from reco.serve.config import FaultsConfig

log = logging.getLogger("reco.serve.faults")
# Logged (WARNING, the servers' default level) as a slowed call begins: a test orders its next requests
# on this line in the server log (the call holds the model from here on), not on a guess of a sleep.
SLOW_CALL_STARTED = "serve.faults: slowed model call started"


def slowed(scorer: Scorer, faults: FaultsConfig) -> Scorer:
    """`scorer`, sleeping faults.model_delay_s inside each of its first faults.slow_calls calls (each
    logs SLOW_CALL_STARTED as it begins).

    Args:
        scorer: the model call, (dense [N, D], ids [N, F, L], mask [N, F, L]) -> probs [N].
        faults: the serve.faults settings.
    Returns:
        The scorer itself when no call is to be slowed, else a wrapper.
    """
    if faults.slow_calls <= 0 or faults.model_delay_s <= 0:
        return scorer
    left = [int(faults.slow_calls)]
    lock = threading.Lock()

    def call(dense: np.ndarray, ids: np.ndarray, mask: np.ndarray, sizes=None) -> np.ndarray:
        with lock:
            slow = left[0] > 0
            left[0] -= slow
        if slow:
            log.warning("%s (sleeping %g s)", SLOW_CALL_STARTED, faults.model_delay_s)
            time.sleep(faults.model_delay_s)
        return scorer(dense, ids, mask, sizes)

    return call
