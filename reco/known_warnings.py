"""Known third-party warnings (TorchRec, torch, FBGEMM) go to a log file, not the terminal.

A distributed training printed ~50 lines of them (the planner's topology notice, "caching params will be
ignored" per table, deprecations inside TorchRec's own calls, torch.fx's tracing notice, once per rank)
around the sharding plan and the progress lines a user runs it for (issue 47). None is about reco's
settings: each is raised inside those packages' own code about their own calls. So the entry point
(reco.cli.run) diverts them to `<run dir>/third_party_warnings.log`, one line each, and names the file
at the end; RECO_SHOW_THIRD_PARTY_WARNINGS=1 shows them as before.

What is diverted, in the process that calls divert() and in every child that calls follow_parent()
(the training ranks: they are spawned, so they learn the file from the environment):
- a Python warning whose code location is inside one of PACKAGES (a warning those packages attribute to
  reco's code through stacklevel is about reco's call, and still shows);
- a log record at WARNING or below from one of PACKAGES' loggers, or logged on the root logger from
  inside their code (TorchRec's `logging.warning("Sharding spec not found ...")`). ERROR and above
  still reach the terminal: a failed rank must never be hidden.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path

PACKAGES = ("torchrec", "torch", "fbgemm_gpu")
ENV = "RECO_THIRD_PARTY_WARNINGS_LOG"  # the file, for child processes (follow_parent)
SHOW_ENV = "RECO_SHOW_THIRD_PARTY_WARNINGS"  # "1": leave every warning on the terminal


def _package_dirs() -> tuple[str, ...]:
    """Where PACKAGES are installed ('<site-packages>/torch/'), found without importing them."""
    from importlib.util import find_spec

    dirs = []
    for name in PACKAGES:
        spec = find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs += [str(Path(p)) + os.sep for p in spec.submodule_search_locations]
    return tuple(dirs)


class _Log:
    """The file the diverted warnings are appended to (by several processes: one short write per line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.dirs = _package_dirs()

    def third_party(self, filename: str) -> bool:
        return filename.startswith(self.dirs)

    def write(self, kind: str, where: str, message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} pid {os.getpid()} {kind} {where}: {' | '.join(message.splitlines())}"
        try:
            with open(self.path, "a") as fh:
                fh.write(line + "\n")
        except OSError:  # a log that cannot be written must not stop the run: show the warning instead
            print(line, file=sys.stderr)


class _RecordFilter(logging.Filter):
    """On a logger: divert its third-party records at WARNING or below (see the module docstring)."""

    def __init__(self, log: _Log, by_path: bool) -> None:
        super().__init__()
        self.log, self.by_path = log, by_path

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING or (self.by_path and not self.log.third_party(record.pathname)):
            return True
        self.log.write(record.levelname, record.name, record.getMessage())
        return False


_installed: _Log | None = None  # this process's log once diverted; a later divert() only moves it


def divert(path: Path) -> None:
    """Send known third-party warnings of this process and of the children that call follow_parent() to
    `path` (appended); a no-op with RECO_SHOW_THIRD_PARTY_WARNINGS=1. Call it before the work; a second
    call (the next job of a multirun in the same process) moves them to its own `path`."""
    if os.environ.get(SHOW_ENV) == "1":
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    os.environ[ENV] = str(path.resolve())
    _install(path.resolve())


def follow_parent() -> None:
    """In a child process: divert as the parent does (divert() left the file in the environment)."""
    if os.environ.get(ENV) and os.environ.get(SHOW_ENV) != "1":
        _install(Path(os.environ[ENV]))


def _install(path: Path) -> None:
    global _installed
    if _installed is not None:  # the hooks are in place: point them at the new file
        _installed.path = path
        return
    _installed = log = _Log(path)
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None) -> None:
        if log.third_party(str(filename)):
            log.write(category.__name__, f"{filename}:{lineno}", str(message))
        else:
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    # A logger-level filter sees the records logged on that logger, not its children's: so one on each
    # logger that emits (the package's loggers are created as its modules import), installed through
    # the logger class, plus one by code location on the root logger.
    for name in PACKAGES:
        logging.getLogger(name).addFilter(_RecordFilter(log, by_path=False))
    logging.getLogger().addFilter(_RecordFilter(log, by_path=True))
    _filter_new_loggers(log)


def _filter_new_loggers(log: _Log) -> None:
    """Give every existing and future logger under PACKAGES the filter (their modules create them at import,
    some only once a distributed run starts)."""
    manager = logging.Logger.manager

    def ours(name: str) -> bool:
        return name.split(".", 1)[0] in PACKAGES

    for name, logger in list(manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and ours(name):
            logger.addFilter(_RecordFilter(log, by_path=False))
    base = manager.loggerClass or logging.getLoggerClass()

    class Filtered(base):  # type: ignore[misc,valid-type]
        def __init__(self, name: str, level: int = logging.NOTSET) -> None:
            super().__init__(name, level)
            if ours(name):
                self.addFilter(_RecordFilter(log, by_path=False))

    manager.setLoggerClass(Filtered)


def summary(path: Path) -> str:
    """'34 known third-party warnings (TorchRec, torch, FBGEMM) kept in <path>', or '' when none were."""
    try:
        n = sum(1 for _ in open(path))
    except OSError:
        return ""
    return f"{n} known third-party warnings (TorchRec, torch, FBGEMM) kept in {path}" if n else ""
