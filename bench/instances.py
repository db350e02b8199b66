"""How much a variant's unloaded p50 differs between server process instances, and what removes it.

    python -m bench.instances --variant DIR [--variant DIR ...] --dataset DATA.pt
        [--condition study --condition hashseed --condition noaslr ...] [--instances 12] [--requests 400]

Each instance is a NEW `python -m reco.cli.serve` process (reco.serve.process.start_server, the way the
study starts its servers: the experiment's serve settings, pinned to the study's server core, one keep-warm
spinner per server core for the whole run). After `--warmup` requests it gets `--requests` requests one at
a time from one keep-alive http.client connection on the generator's core (the study's unloaded block is
one closed-loop Locust user; this client is lighter but the same shape), in `--chunk`-request turns with a
LONG-LIVED server of the same variant (started once, study condition): the other jobs on a shared machine
move a server's p50 several-fold within minutes, and fresh / long-lived cancels what hits both. Then the
fresh server is stopped. Variants x conditions are interleaved instance by instance in a random order per
round. Rows go to --csv as they are measured (a run cut short keeps them); --table-only pools CSVs.

Conditions (a server-process setting each; `study` is what the study does today):
  study      as reco.loadtest.study starts servers
  hashseed   PYTHONHASHSEED=0 (Python's str/bytes hash randomization off)
  noaslr     ASLR off for the server (personality(ADDR_NO_RANDOMIZE), inherited across exec = setarch -R)
  fixed      both of the above
  arena      MALLOC_ARENA_MAX=1 (one glibc malloc arena, whatever thread allocates)
  unpinned   the server not pinned to a core (the scheduler places it)

The table: per variant and condition, the between-instance spread of the p50s (sd/mean with a 95 %
chi-square interval, max/min) beside the within-instance interval (median relative half-width of each
instance's order-statistic 95 % CI of its p50, reco.stats.quantile_ci) and their ratio; then the spread of
fresh / long-lived for the p50, the server's own rank stage (Server-Timing: the model call) and the p10:
the per-process effect with the machine's drift taken out.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import http.client
import os
import random
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import orjson
from scipy import stats

from reco.cli.compose import compose
from reco.loadtest.requests import request_bodies
from reco.loadtest.runner import plan_cpus
from reco.serve.config import serve_config
from reco.serve.keepwarm import start_keep_warm, stop_keep_warm
from reco.serve.process import ServerHandle, start_server, stop_servers
from reco.stats import quantile_ci

ADDR_NO_RANDOMIZE = 0x0040000  # linux/personality.h
QUERY_PERSONALITY = 0xFFFFFFFF


@dataclass(frozen=True)
class Condition:
    """What a server process is started with, beyond the study's settings."""

    env: dict[str, str] = field(default_factory=dict)
    no_aslr: bool = False
    pinned: bool = True


CONDITIONS = {
    "study": Condition(),
    "hashseed": Condition(env={"PYTHONHASHSEED": "0"}),
    "noaslr": Condition(no_aslr=True),
    "fixed": Condition(env={"PYTHONHASHSEED": "0"}, no_aslr=True),
    "arena": Condition(env={"MALLOC_ARENA_MAX": "1"}),
    "unpinned": Condition(pinned=False),
    # THP is `madvise` here: only memory a process asks for gets 2 MB pages. torch's CPU allocator asks
    # when THP_MEM_ALLOC_ENABLE is set, glibc's malloc (ONNX Runtime's, numpy's) with this tunable.
    "hugepages": Condition(env={"THP_MEM_ALLOC_ENABLE": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}),
}


@dataclass
class Instance:
    """One fresh server process's unloaded p50 (95 % CI) and the long-lived server's p50 around it."""

    variant: str
    condition: str
    p50_ms: float
    lo_ms: float
    hi_ms: float
    ref_p50_ms: float
    personality: str
    rank_p50_ms: float = float("nan")  # the server's own model-call stage (Server-Timing), median
    ref_rank_p50_ms: float = float("nan")  # the same of the long-lived server
    p10_ms: float = float("nan")  # a low quantile: the request that no co-runner's burst delayed
    ref_p10_ms: float = float("nan")
    huge_kb: float = float("nan")  # the fresh server's AnonHugePages after its requests (smaps_rollup)

    @property
    def ratio(self) -> float:
        return self.p50_ms / self.ref_p50_ms


FIELDS = tuple(f.name for f in fields(Instance))  # the CSV's columns
TEXT_FIELDS = {"variant", "condition", "personality"}


_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def started_as(cond: Condition, all_cpus: set[int]) -> Iterator[None]:
    """This process's environment, personality and affinity set so a child started inside inherits the
    condition (start_server's Popen takes all three from us), restored after."""
    old_env = {k: os.environ.get(k) for k in cond.env}
    old_pers = _libc.personality(QUERY_PERSONALITY)
    old_aff = os.sched_getaffinity(0)
    os.environ.update(cond.env)
    if cond.no_aslr:
        _libc.personality(old_pers | ADDR_NO_RANDOMIZE)
    if not cond.pinned:
        os.sched_setaffinity(0, all_cpus)  # the client's own pin would otherwise be inherited
    try:
        yield
    finally:
        _libc.personality(old_pers)
        os.sched_setaffinity(0, old_aff)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


RANK = re.compile(r"(?:^|, )rank;dur=([0-9.]+)")


class Client:
    """One keep-alive connection to a server; `send` times n POST /recommend one at a time."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.i = 0

    def send(self, bodies: list[bytes], n: int) -> tuple[list[float], list[float]]:
        """n requests: their latencies and the server's own rank stage (Server-Timing: the model call, so a
        per-process effect can be placed in the model or around it), both ms."""
        lat, rank = [], []
        for _ in range(n):
            body = bodies[self.i % len(bodies)]
            self.i += 1
            t = time.perf_counter()
            self.conn.request("POST", "/recommend", body, {"Content-Type": "application/json"})
            r = self.conn.getresponse()
            r.read()
            lat.append((time.perf_counter() - t) * 1e3)
            if r.status != 200:
                raise RuntimeError(f"POST /recommend answered {r.status}")
            m = RANK.search(r.getheader("Server-Timing") or "")
            rank.append(float(m.group(1)) if m else np.nan)
        return lat, rank

    def close(self) -> None:
        self.conn.close()


def paired(fresh: Client, ref: Client, bodies: list[bytes], args) -> tuple[np.ndarray, ...]:
    """Both servers warmed, then `args.chunk` requests to each in turn until `args.requests` each: the other
    helpers' bursts on the shared cores last seconds, so chunks of a few tens of ms fall on both alike.
    Returns the fresh server's latencies and rank stage, then the long-lived one's."""
    fresh.send(bodies, args.warmup)
    ref.send(bodies, args.warmup // 4)
    out: list[list[float]] = [[], [], [], []]
    while len(out[0]) < args.requests:
        for i, (a, b) in enumerate([fresh.send(bodies, args.chunk), ref.send(bodies, args.chunk)]):
            out[2 * i] += a
            out[2 * i + 1] += b
    return tuple(np.array(x) for x in out)


def port_of(h: ServerHandle) -> int:
    return int(h.url.rsplit(":", 1)[1])


def one_instance(
    variant: str, cond_name: str, args, settings, server_cpus, bodies, ref: ServerHandle
) -> Instance:
    """A fresh server of `variant` under the condition, measured in alternating chunks with the same
    variant's long-lived server (started once, as the study's): their ratio cancels the machine's drift."""
    cond = CONDITIONS[cond_name]
    with started_as(cond, set(range(os.cpu_count() or 1))):
        h: ServerHandle = start_server(
            Path(variant).resolve(),
            Path(args.dataset).resolve(),
            settings,
            cpus=server_cpus if cond.pinned else None,
        )
    try:
        pers = Path(f"/proc/{h.pid}/personality").read_text().strip()
        fresh, other = Client(port_of(h)), Client(port_of(ref))
        try:
            lat, rank, ref_lat, ref_rank = paired(fresh, other, bodies, args)
            huge_kb = anon_huge_kb(h.pid)
        finally:
            fresh.close()
            other.close()
    finally:
        h.stop()
    est = quantile_ci(lat, 0.5)
    ref_p50 = float(np.median(ref_lat))
    return Instance(
        name_of(variant),
        cond_name,
        est.value,
        est.lo,
        est.hi,
        ref_p50,
        pers,
        float(np.nanmedian(rank)),
        float(np.nanmedian(ref_rank)),
        float(np.quantile(lat, 0.1)),
        float(np.quantile(ref_lat, 0.1)),
        huge_kb,
    )


def anon_huge_kb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return float(line.split()[1])
    return float("nan")


def name_of(variant: str) -> str:
    return Path(variant).name.rsplit("-", 1)[0]


def spread_row(variant: str, cond: str, xs: list[Instance]) -> str:
    p = np.array([x.p50_ms for x in xs])
    k = len(p)
    mean, sd = p.mean(), p.std(ddof=1) if k > 1 else float("nan")
    cv = sd / mean
    # 95 % interval of the sd from chi-square on k - 1 df (normal instances)
    lo = cv * np.sqrt((k - 1) / stats.chi2.ppf(0.975, k - 1)) if k > 1 else float("nan")
    hi = cv * np.sqrt((k - 1) / stats.chi2.ppf(0.025, k - 1)) if k > 1 else float("nan")
    width = np.median([(x.hi_ms - x.lo_ms) / x.p50_ms for x in xs])
    within_sd = np.median([(x.hi_ms - x.lo_ms) / (2 * 1.96) for x in xs])
    q = np.array([x.ratio for x in xs])
    rk = np.array([x.rank_p50_ms / x.ref_rank_p50_ms for x in xs])
    rk = rk[~np.isnan(rk)]  # files from before the long-lived server's rank stage was kept
    rank = f"{100 * rk.std(ddof=1) / rk.mean():.1f} (n={len(rk)})" if len(rk) > 1 else "–"
    lo10 = np.array([x.p10_ms / x.ref_p10_ms for x in xs])
    lo10 = lo10[~np.isnan(lo10)]
    p10 = f"{100 * lo10.std(ddof=1) / lo10.mean():.1f} (n={len(lo10)})" if len(lo10) > 1 else "–"
    return (
        f"| {variant} | {cond} | {k} | {mean:.3f} | {100 * cv:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] | "
        f"{p.max() / p.min():.3f} | ±{50 * width:.1f} | {sd / within_sd:.2f} | "
        f"{100 * q.std(ddof=1) / q.mean():.1f} | {q.max() / q.min():.3f} | {rank} | {p10} |"
    )


HEADER = (
    "| variant | condition | instances | mean p50 ms | between-instance sd/mean % [95 %] | max/min | "
    "within-instance p50 CI half-width % (median) | between sd / within sd | "
    "fresh / long-lived p50: sd/mean % | its max/min | fresh / long-lived rank stage p50: sd/mean % | fresh / long-lived p10: sd/mean % |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def table(done: list[Instance], conds: list[str]) -> str:
    lines = [HEADER]
    for v in dict.fromkeys(x.variant for x in done):
        for c in conds:
            xs = [x for x in done if x.variant == v and x.condition == c]
            if len(xs) > 1:
                lines.append(spread_row(v, c, xs))
    return "\n".join(lines)


def read_csv(path: Path) -> list[Instance]:
    """The instances a --csv file holds; a column files from before it lack reads NaN."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [
        Instance(**{k: r[k] if k in TEXT_FIELDS else float(r.get(k) or "nan") for k in FIELDS}) for r in rows
    ]


def run(args, conds: list[str]) -> None:
    """Every round: each variant x condition once, in a random order; each instance appended to args.csv."""
    from reco.data.schema import Dataset

    ds = Dataset.load(args.dataset)
    bodies = [orjson.dumps(b) for b in request_bodies(ds, 2000, 10, 0)]
    del ds
    settings = serve_config(compose([f"experiment={args.experiment}", "serve.keep_warm=false"]).serve)
    server_cpus, gen_cpus = plan_cpus()
    if gen_cpus:
        os.sched_setaffinity(0, gen_cpus)
    spinners = start_keep_warm(server_cpus or [])  # the study: one per server core, for the whole study
    refs = {
        v: start_server(Path(v).resolve(), Path(args.dataset).resolve(), settings, cpus=server_cpus)
        for v in args.variant
    }
    rng = random.Random(args.seed)
    out = args.csv[-1]
    new = not out.exists()
    try:
        with open(out, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(FIELDS)
            for r in range(args.instances):
                cells = [(v, c) for v in args.variant for c in conds]
                rng.shuffle(cells)
                for v, c in cells:
                    x = one_instance(v, c, args, settings, server_cpus, bodies, refs[v])
                    w.writerow([getattr(x, k) for k in FIELDS])
                    f.flush()
                    print(
                        f"# round {r + 1} {x.variant} {c}: p50 {x.p50_ms:.3f} [{x.lo_ms:.3f}, {x.hi_ms:.3f}], "
                        f"long-lived {x.ref_p50_ms:.3f}, rank {x.rank_p50_ms:.3f} / {x.ref_rank_p50_ms:.3f}, "
                        f"huge pages {x.huge_kb / 1024:.0f} MB",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        stop_servers(list(refs.values()))
        stop_keep_warm(spinners)
    print(
        f"# {args.requests} requests/instance after {args.warmup} warm-up, server cores {server_cpus}, "
        f"client cores {gen_cpus}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="a built variant directory (repeat)")
    ap.add_argument("--dataset")
    ap.add_argument("--condition", action="append", choices=sorted(CONDITIONS), help="repeat; default: study")
    ap.add_argument(
        "--instances", type=int, default=12, help="rounds: server processes per variant and condition"
    )
    ap.add_argument("--requests", type=int, default=400, help="measured requests per instance")
    ap.add_argument("--warmup", type=int, default=100, help="requests sent and discarded first")
    ap.add_argument("--chunk", type=int, default=20, help="requests to each server in turn")
    ap.add_argument("--experiment", default="ecommerce_case_study", help="whose serve settings")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--csv",
        type=Path,
        action="append",
        required=True,
        help="one row per instance, appended to the last given; the table pools every one given (repeat)",
    )
    ap.add_argument("--table-only", action="store_true", help="print the table of --csv, measure nothing")
    args = ap.parse_args()
    conds = args.condition or ["study"]
    if not args.table_only:
        if not (args.variant and args.dataset):
            ap.error("--variant and --dataset are required to measure")
        run(args, conds)
    done = [x for path in args.csv for x in read_csv(path)]
    print(table(done, list(dict.fromkeys([*conds, *(x.condition for x in done)]))))


if __name__ == "__main__":
    main()
