"""Hydra callback for a multirun whose jobs run side by side (`hydra/launcher=joblib`, `n_jobs` != 1).

Each job trains with `trainer.threads` torch threads; two 2-thread jobs on 2 cores oversubscribe them,
and OpenMP's default busy-wait (libgomp, which torch uses) then spins the waiting threads on the cores the
working ones need. Passive waiting roughly halves two side-by-side jobs' time and slightly slows a lone
job (experiments/platform/README.md), so it is set for parallel jobs only, in the launching process before the launcher starts its workers (libgomp
reads the variable once, when torch loads); a value set by the user wins.
"""

from __future__ import annotations

import os
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

POLICY = "OMP_WAIT_POLICY"


def runs_side_by_side(config: DictConfig) -> bool:
    """Whether the multirun's launcher runs several jobs at once (joblib with n_jobs other than 1)."""
    launcher = config.hydra.get("launcher") or {}
    return "joblib" in str(launcher.get("_target_", "")).lower() and launcher.get("n_jobs", -1) != 1


class ParallelJobs(Callback):
    """conf/config.yaml's hydra.callbacks.parallel_jobs (module docstring)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if runs_side_by_side(config) and POLICY not in os.environ:
            os.environ[POLICY] = "PASSIVE"
            print(f"[sweep] jobs run side by side: {POLICY}=PASSIVE for their torch threads", flush=True)
