"""An exclusive claim on one cache entry, so parallel jobs (a Hydra multirun with the joblib launcher, two
runs started by hand) build a shared entry once: the first job builds it, the others wait and reuse it.

    with claim(Path(".cache/variants/baseline-1a2b"), "variant 'baseline'"):
        ... reuse the entry if it is finished, else build it ...

The claim is `fcntl.flock` on `<entry>.lock` beside the entry. The kernel drops a flock when its holder
dies (even by SIGKILL), so a killed job never leaves a stale claim that blocks the next one; the lock file
itself is left in place (deleting it would let two jobs lock two different files of the same name). A
shared cache on a network file system needs working flock there (NFSv4 and Lustre have it).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def lock_path(entry: Path) -> Path:
    """The lock file of a cache entry: `<entry>.lock` in the same directory.

    Args:
        entry: the cache entry (a directory or a file, existing or not).
    Returns:
        The lock file's path.
    """
    return entry.with_name(entry.name + ".lock")


@contextmanager
def claim(entry: Path, what: str) -> Iterator[None]:
    """Hold the exclusive claim on `entry` for the body; wait (saying for whom) while another process holds it.

    Args:
        entry: the cache entry to claim.
        what: how the wait message names the entry, e.g. "variant 'baseline' (.cache/variants/baseline-1a2b)".
    """
    path = lock_path(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            print(f"  waiting for {what}, held by {holder} (lock {path})", flush=True)
            t0 = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the holder, or by the kernel when it dies
            print(f"  {what}: released after {time.monotonic() - t0:.0f} s of waiting", flush=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the flock
