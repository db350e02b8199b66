"""Slow stretches of the host: one idle server, one request at a time, second by second.

    python -m bench.host_stretch --variant .cache/variants/distilled_onnx_int8-<key> --dataset .cache/data/<data>.pt
        [--seconds 240] [--cpu 0]

A real server (reco.serve.process.start_server, keep_warm off) pinned to `--cpu`, sent one /recommend
at a time over one keep-alive connection from this process (no load generator, so nothing queues): any
second whose median is well above the run's median is the machine, not the service. Beside each
second's p50/p99 it prints what the guest can see of why: the server core's user/system/idle/irq and
steal jiffies (/proc/stat; 100 a second) and the server process's minor/major page faults
(/proc/<pid>/stat). A stretch with the core busy, no steal and no faults is the host slowing the vCPU
(other tenants on its cache and memory) without telling the guest.

Ends with the stretches (runs of seconds with p50 > `--factor` x the median): start, length, their
p50 over the median.
"""

from __future__ import annotations

import argparse
import http.client
import json
import time
from pathlib import Path

import numpy as np

from reco.cli.compose import compose
from reco.data.schema import Dataset
from reco.loadtest.requests import request_bodies
from reco.serve.config import serve_config
from reco.serve.process import start_server

STAT = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_jiffies(cpu: int) -> np.ndarray:
    """The /proc/stat counters of cpu`cpu`, in STAT order."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            return np.array([int(x) for x in line.split()[1 : 1 + len(STAT)]])
    raise ValueError(f"--cpu {cpu}: no cpu{cpu} line in /proc/stat")


def faults(pid: int) -> tuple[int, int]:
    """(minor, major) page faults of process `pid` so far."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(f[7]), int(f[9])


def stretches(p50s: list[float], factor: float) -> list[tuple[int, int, float]]:
    """(first second, seconds, mean p50 / median) of each run of seconds with p50 > factor x the median."""
    med, out, start = float(np.median(p50s)), [], None
    for i, x in enumerate([*p50s, 0.0]):
        if x > factor * med and start is None:
            start = i
        elif x <= factor * med and start is not None:
            out.append((start, i - start, float(np.mean(p50s[start:i])) / med))
            start = None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.host_stretch", description=__doc__.splitlines()[0])
    p.add_argument("--variant", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--seconds", type=float, default=240.0)
    p.add_argument("--cpu", type=int, default=0, help="the server's core")
    p.add_argument("--factor", type=float, default=1.3, help="a second slower than this x the median is slow")
    a = p.parse_args(argv)
    bodies = [json.dumps(b).encode() for b in request_bodies(Dataset.load(a.dataset), 3000, 10, 0)]
    settings = serve_config(compose(["serve.keep_warm=false"]).serve)
    p50s: list[float] = []
    with start_server(a.variant, a.dataset, settings, cpus=[a.cpu]) as h:
        host, port = h.url.split("//")[1].split(":")
        conn, i = http.client.HTTPConnection(host, int(port)), 0
        end = time.time() + a.seconds
        print("time      n     p50 ms  p99 ms  " + " ".join(f"{s:>7s}" for s in STAT) + "  minflt majflt")
        while time.time() < end:
            j0, f0, lat, stop = cpu_jiffies(a.cpu), faults(h.pid), [], time.time() + 1.0
            while time.time() < stop:
                t = time.perf_counter()
                conn.request(
                    "POST", "/recommend", bodies[i % len(bodies)], {"Content-Type": "application/json"}
                )
                conn.getresponse().read()
                lat.append((time.perf_counter() - t) * 1e3)
                i += 1
            dj, f1 = cpu_jiffies(a.cpu) - j0, faults(h.pid)
            p50s.append(float(np.median(lat)))
            print(
                f"{time.strftime('%H:%M:%S')} {len(lat):4d} {p50s[-1]:8.2f} {np.percentile(lat, 99):7.2f}  "
                + " ".join(f"{x:7d}" for x in dj)
                + f"  {f1[0] - f0[0]:6d} {f1[1] - f0[1]:6d}",
                flush=True,
            )
    med = float(np.median(p50s))
    found = stretches(p50s, a.factor)
    print(
        f"\n{len(p50s)} s, median of the seconds' p50s {med:.2f} ms; {len(found)} stretches > {a.factor:g}x:"
    )
    for s, n, r in found:
        print(f"  from second {s}: {n} s at {r:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
