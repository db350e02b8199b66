"""Child processes die with the process that started them, even when it is SIGKILLed.

A SIGKILLed parent cannot pass anything on, so every long-lived child reco starts (the server, its
workers, Locust) asks the kernel for a signal when its parent goes (Linux PR_SET_PDEATHSIG): an
interrupted experiment leaves no server, worker or load generator behind.
"""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent exits (call it in the child).

    Args:
        parent_pid: the pid the caller expects as its parent; if that is already gone, exit now.
        sig: the signal to receive.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        raise SystemExit(f"process {os.getpid()}: parent {parent_pid} is gone; exiting")
