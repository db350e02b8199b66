"""Locust processes kept running across a study's load tests, each test started over Locust's web API.

    with LocustPool(log_dir) as pool:
        run_load(url, cfg, out / "a", requests, cpus, pool=pool)   # starts one Locust (web mode)
        run_load(url2, cfg, out / "b", requests, cpus, pool=pool)  # the same process: POST /swarm

A headless Locust process per window paid Python's and Locust's imports (~1.2 s here) every time: with
~20 windows, 24 of the smoke experiment's 141 s. A kept process is started once per (request file,
Triton model, cores, seed) -- what it reads at start-up -- and one more for request-interleaved windows
(reco.loadtest.interleave), with its web UI on 127.0.0.1, and each test is
a POST /swarm carrying that window's options (Locust copies every form field that names a parsed option
into it): host, users, load mode, rate, window, latency file. The locustfile's own routes tell when the
test has stopped (/reco/state; Locust's /stats/requests is cached for 2 s) and write Locust's reports of
that test beside its latency file (/reco/reports). The study prints the web UI's address, so a person can
watch the study's tests live in Locust's UI, "reco" tab included.

One process per key serves one window at a time (the study is sequential). A process that died, or that a
window left in an unknown state (an exception mid-window), is killed and replaced at the next window.
Single-process generators only: a distributed window (loadtest.workers > 1) starts its master and workers
per window (reco.loadtest.distributed). PooledLocust is the load generator (reco.loadtest.window) that
runs a window in the pool's process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from reco.loadtest.locust_proc import (
    LOCUSTFILE,
    Gen,
    check_record,
    generator_session,
    measure,
    spawn_locust,
)
from reco.loadtest.outcome import LoadRun
from reco.loadtest.window import Samples, Window, finish_single_process
from reco.serve.process import free_port, log_tail

# request file, Triton model, cores, seed, multi-server: a request-interleaved window's process
# (reco.loadtest.interleave) is a process of its own, so the --targets it was given never carry over into a
# one-server window (Locust keeps a form field's value until a later test sets it)
Key = tuple[str, str, tuple[int, ...], int, bool]


class PoolError(RuntimeError):
    pass


@dataclass
class KeptLocust:
    """One web-mode Locust process and where its UI and log are."""

    proc: subprocess.Popen
    web: str  # http://127.0.0.1:<port>
    log: Path
    key: Key
    tests: int = 0  # tests started so far

    def call(self, path: str, form: dict[str, object] | None = None, timeout_s: float = 10.0) -> dict:
        """GET the web UI's `path` (POST `form` when given); its JSON answer."""
        data = None if form is None else urllib.parse.urlencode({k: str(v) for k, v in form.items()}).encode()
        with urllib.request.urlopen(self.web + path, data=data, timeout=timeout_s) as r:
            return json.loads(r.read())

    def state(self) -> str:
        return str(self.call("/reco/state")["state"])

    def swarm(self, form: dict[str, object]) -> None:
        """Start a test; `form` holds user_count, spawn_rate, host, run_time and parsed options."""
        answer = self.call("/swarm", form)
        if not answer.get("success"):
            raise PoolError(f"Locust refused the test: {answer.get('message')}; {self.log}")
        self.tests += 1

    def wait_stopped(self, deadline: float) -> None:
        """Until the test has stopped (Locust ends it itself once the window has drained)."""
        while self.state() not in ("stopped", "ready"):
            if self.proc.poll() is not None or time.time() > deadline:
                raise PoolError(f"Locust did not stop the test in time; {self.log}:\n{log_tail(self.log)}")
            time.sleep(0.02)

    def write_reports(self) -> list[Path]:
        """Locust's CSV/HTML/JSON reports of the stopped test, beside its latency file."""
        return [Path(p) for p in self.call("/reco/reports", {}, timeout_s=60.0)["written"]]


class LocustPool:
    """Web-mode Locust processes, one per Key, started on first use and stopped on close()."""

    def __init__(
        self, log_dir: str | Path, startup_timeout_s: float = 60.0, say: Callable[[str], None] | None = None
    ) -> None:
        self.log_dir = Path(log_dir)
        self.startup_timeout_s = startup_timeout_s
        self.say = say  # told each new process's web UI address
        self.kept: dict[Key, KeptLocust] = {}

    def __enter__(self) -> LocustPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(
        self,
        url: str,
        requests_path: Path | None,
        triton_model: str | None,
        cpus: list[int] | None,
        seed: int,
        multi: bool = False,
    ) -> KeptLocust:
        """The running process for these start-up settings (started now if there is none alive)."""
        key: Key = (str(requests_path or ""), triton_model or "", tuple(cpus or ()), int(seed), multi)
        k = self.kept.get(key)
        if k is not None and k.proc.poll() is None:
            return k
        self.discard(key)
        k = self._start(url, key)
        self.kept[key] = k
        if self.say is not None:
            self.say(f"[load] Locust web UI of the tests that follow (live, tab 'reco'): {k.web}")
        return k

    def _start(self, url: str, key: Key) -> KeptLocust:
        req, triton, cpus, seed, _ = key
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        cmd = [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", url,
            "--web-host", "127.0.0.1", "--web-port", str(port), "--loglevel", "WARNING",
            "--exit-code-on-error", "0", "--seed", str(seed),
        ]  # fmt: skip
        if req:
            cmd += ["--requests-file", req]
        if triton:
            cmd += ["--triton-model", triton]
        log = self.log_dir / f"locust-{port}.log"
        proc = spawn_locust(cmd, log, self.log_dir, cpus)
        k = KeptLocust(proc, f"http://127.0.0.1:{port}", log, key)
        deadline = time.time() + self.startup_timeout_s
        while True:
            try:
                k.state()
                return k
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                if proc.poll() is not None or time.time() > deadline:
                    why = f"exit code {proc.returncode}" if proc.poll() is not None else f"no answer: {e}"
                    proc.kill()
                    proc.wait()
                    raise PoolError(f"Locust did not start ({why}); {log}:\n{log_tail(log)}") from None
                time.sleep(0.05)

    def discard(self, key: Key) -> None:
        """Kill and forget one process (a window failed in it, or it died)."""
        k = self.kept.pop(key, None)
        if k is not None and k.proc.poll() is None:
            k.proc.kill()
            k.proc.wait()

    def close(self) -> None:
        for key in list(self.kept):
            self.discard(key)


@dataclass
class PooledLocust:
    """A window in the pool's kept process for its start-up settings: a POST /swarm with the window's
    options, Locust's reports of it through /reco/reports, its part of the kept log as its locust.log."""

    pool: LocustPool

    def run_window(self, w: Window) -> LoadRun:
        return finish_single_process(w, self.collect(w))

    def collect(self, w: Window) -> Samples:
        """Run the window in the kept process; what was sampled at its edges (every served server's scrapes)."""
        kept = self.pool.get(w.url, w.requests, w.triton_model, w.cpus, w.c.seed, multi=bool(w.targets))
        log_at, finished = kept.log.stat().st_size, False
        gens = [Gen("Locust", kept.proc, kept.log)]
        with generator_session(w) as base:
            try:
                form = {
                    "user_count": w.users,
                    "spawn_rate": w.c.spawn_rate,
                    "host": w.url,
                    "run_time": w.run_time,
                }
                kept.swarm(form | w.opts)
                samples = measure(w, gens)
                kept.wait_stopped(time.time() + w.c.drain_s + 60)
                if w.reports:
                    kept.write_reports()
                samples, finished = base.complete(samples), True
            finally:
                _copy_tail(kept.log, log_at, w.log)
                if not finished:  # mid-test, or gone: a fresh process for the next window
                    self.pool.discard(kept.key)
        check_record(w, gens)
        return samples


def _copy_tail(src: Path, offset: int, dst: Path) -> None:
    with open(src, "rb") as f:
        f.seek(offset)
        dst.write_bytes(f.read())
