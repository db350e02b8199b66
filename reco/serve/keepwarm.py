"""Keep a core from idling: one SCHED_IDLE spinner process per core.

On this kind of VM (Firecracker, 2 vCPUs) a vCPU that idles between requests runs the next model
call several times slower (experiments/platform/README.md). A SCHED_IDLE process runs only when nothing else on the core is runnable, so it takes no time
from the server (or the load generator) but keeps the vCPU busy -- the software form of booting a
latency-critical host with idle=poll. It costs a whole core of host CPU; switch it off with
serve.keep_warm=false / loadtest.loadgen.keep_warm=false.

SCHED_IDLE yields only within its scheduling group. With autogroups on (Linux's default,
kernel.sched_autogroup_enabled) every session is a group, and a core is shared between groups before
SCHED_IDLE counts: a spinner took up to 40 % of the core from a busy server started in a session of its
own, and a worker of 2 ms units lost 31 % of its throughput (`python -m bench.keep_warm`,
experiments/platform/README.md#keep_warm-and-sessions). So the spinner stays in the session of the process
that starts it, and reco.serve.process starts servers in the caller's session (a process group of their
own, so Ctrl-C in the terminal still does not reach them).

One spinner per core, never more: several SCHED_IDLE spinners on one core do take time from its normal
tasks (experiments/platform/README.md), so a study of many servers runs one spinner per server core (reco.loadtest.study).
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

from reco.children import die_with_parent

_SPIN = """
import os
os.sched_setaffinity(0, [{cpu}])
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    pass
"""


def start_keep_warm(cpus: list[int]) -> list[subprocess.Popen]:
    """Start a spinner on each of `cpus`; stop them with `stop_keep_warm` (they also die with us).

    Args:
        cpus: core ids, one spinner each.
    Returns:
        The spinner processes.
    """
    # PR_SET_PDEATHSIG before exec (not in the script): a parent SIGKILLed while the spinner's Python
    # was still starting would otherwise leave it spinning forever.
    return [
        subprocess.Popen(
            [sys.executable, "-c", _SPIN.format(cpu=int(c))],
            stdin=subprocess.DEVNULL,
            preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGKILL),
        )
        for c in cpus
    ]


def stop_keep_warm(procs: list[subprocess.Popen]) -> None:
    """Kill and reap the spinners `start_keep_warm` returned.

    Args:
        procs: the spinner processes.
    """
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()
