"""Does the keep-warm spinner take time from a busy worker started in another session?

    python -m bench.keep_warm [--cpu 1] [--seconds 4] [--repeats 3] [--units-ms 10 2]

A worker process pinned to `--cpu` repeats units of `units-ms` of wall-clock busy work with a sleep of a
third of a unit between them (a server at ~75 % utilisation), and reports its units per second and each
unit's p50 / p99 wall time: a unit longer than its length was descheduled inside it, fewer units per second
than without a spinner means it waited to run after its sleeps. With autogroups on (Linux's default) each
session is a scheduling group and a core is shared between groups before SCHED_IDLE counts, so where the
worker and reco.serve.keepwarm's spinner (SCHED_IDLE, in the session of the process that started it)
each run matters. The arrangements, alternating over `--repeats` rounds so a slow stretch of the host
hits them alike:

- *no spinner*;
- *worker: own session*: the spinner and a worker started in a session of its own, as
  reco.serve.process started servers before (start_new_session);
- *worker: own process group*: the spinner and a worker in this session, in a process group of its own
  (Ctrl-C in the terminal still does not reach it), as reco.serve.process starts servers now;
- *worker: own session, spinner's group at nice 19*: the other way out (the spinner a session of its own
  whose group has the least weight), for comparison.

Prints the CPU model and kernel.sched_autogroup_enabled: without autogroups every arrangement is one group.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from reco.cpu import cpu_model
from reco.serve.keepwarm import start_keep_warm, stop_keep_warm

WORKER = """
import os, sys, time
os.sched_setaffinity(0, [int(sys.argv[1])])
unit, nap, seconds = float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
t0, took = time.time(), []
while time.time() - t0 < seconds:
    s = time.perf_counter()
    while time.perf_counter() - s < unit:
        pass
    took.append(time.perf_counter() - s)
    time.sleep(nap)
print(len(took) / (time.time() - t0), *took)
"""

# a spinner whose session's group runs at nice 19 (the comparison; reco.serve.keepwarm's is in its starter's)
NICE19 = """
import os, sys
with open("/proc/self/autogroup", "w") as f:
    f.write("19")
os.sched_setaffinity(0, [int(sys.argv[1])])
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    pass
"""


def worker(cpu: int, unit_s: float, seconds: float, own_session: bool) -> tuple[float, np.ndarray]:
    """(units per second, each unit's wall ms) of one worker run, in a session or a process group of its own."""
    args = [sys.executable, "-c", WORKER, str(cpu), str(unit_s), str(unit_s / 3), str(seconds)]
    where = {"start_new_session": True} if own_session else {"process_group": 0}
    out = subprocess.run(args, capture_output=True, text=True, check=True, **where).stdout.split()
    return float(out[0]), np.array(out[1:], dtype=float) * 1000.0


def nice19(cpu: int) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-c", NICE19, str(cpu)]
    return [subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)]


# name -> (the spinner(s) on the core, whether the worker gets a session of its own)
ARRANGEMENTS: dict[str, tuple[Callable[[int], list[subprocess.Popen]], bool]] = {
    "no spinner": (lambda cpu: [], True),
    "worker: own session": (lambda cpu: start_keep_warm([cpu]), True),
    "worker: own process group": (lambda cpu: start_keep_warm([cpu]), False),
    "worker: own session, spinner's group at nice 19": (nice19, True),
}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.keep_warm", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", type=int, default=1, help="the core the worker and the spinner share")
    p.add_argument("--seconds", type=float, default=4.0, help="one worker run")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every arrangement, alternating")
    p.add_argument("--units-ms", type=float, nargs="+", default=[10.0, 2.0], help="a unit's busy work")
    a = p.parse_args()
    flag = Path("/proc/sys/kernel/sched_autogroup_enabled")
    groups = flag.read_text().strip() if flag.exists() else "absent"
    print(
        f"CPU: {cpu_model()}; kernel.sched_autogroup_enabled = {groups}; worker and spinner on cpu {a.cpu}\n"
    )
    print("| unit | arrangement | runs | units/s (min-max) | unit p50 ms | unit p99 ms (min-max over runs) |")
    print("|---|---|---|---|---|---|")
    for unit in a.units_ms:
        res: dict[str, list[tuple[float, np.ndarray]]] = {k: [] for k in ARRANGEMENTS}
        for r in range(a.repeats):
            names = list(ARRANGEMENTS) if r % 2 == 0 else list(reversed(ARRANGEMENTS))
            for name in names:
                spinners, own_session = ARRANGEMENTS[name]
                spin = spinners(a.cpu)
                time.sleep(0.3)  # the spinner is up and spinning before the worker starts
                try:
                    res[name].append(worker(a.cpu, unit / 1000.0, a.seconds, own_session))
                finally:
                    stop_keep_warm(spin)
        for name, runs in res.items():
            rate = [x for x, _ in runs]
            p50 = np.median(np.concatenate([t for _, t in runs]))
            p99 = [float(np.percentile(t, 99)) for _, t in runs]
            print(
                f"| {unit:g} ms | {name} | {len(runs)} | {np.median(rate):.1f} ({min(rate):.1f}-{max(rate):.1f}) "
                f"| {p50:.2f} | {np.median(p99):.2f} ({min(p99):.2f}-{max(p99):.2f}) |"
            )


if __name__ == "__main__":
    main()
