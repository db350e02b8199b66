"""Known third-party warnings go to a file (reco.known_warnings), in the entry point's process and in a
spawned child, while reco's own warnings and third-party errors stay on the terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter: divert() changes the process's warning and logging machinery.
SCRIPT = r"""
import logging, multiprocessing, sys, warnings
from pathlib import Path
from importlib.util import find_spec
from reco import known_warnings

torchrec = find_spec("torchrec").submodule_search_locations[0]
torch = find_spec("torch").submodule_search_locations[0]


def in_torchrec(code):  # code that runs as if it were TorchRec's own
    exec(compile(code, f"{torchrec}/distributed/fake.py", "exec"), {"logging": logging, "warnings": warnings})


def child():
    known_warnings.follow_parent()
    logging.getLogger("torchrec.distributed.comm").warning("from the rank: TORCHREC_RESOLVED_POD_SIZE not set")


if __name__ == "__main__":
    logging.basicConfig()  # as TorchRec's import does: a stderr handler on the root logger
    known_warnings.divert(Path(sys.argv[1]))
    warnings.warn_explicit("`broadcast_buffers` is deprecated", FutureWarning, f"{torch}/distributed/x.py", 83)
    logging.getLogger("torchrec.distributed.utils").warning("Compute Kernel is dense, caching params will be ignored")
    logging.getLogger("torch.fx._symbolic_trace").warning("is_fx_tracing will return true")
    in_torchrec("logging.warning('Sharding spec not found for ebc.t_segment')")
    p = multiprocessing.get_context("spawn").Process(target=child)
    p.start(); p.join()
    # what stays on the terminal
    warnings.warn("reco's own warning", UserWarning)
    logging.getLogger("torchrec.distributed.utils").error("rank 1 failed: an error is never hidden")
    logging.warning("a root warning from reco's code")
    print(known_warnings.summary(Path(sys.argv[1])))
    # the next job of a multirun in this process: its warnings to its own file, once each
    second = Path(sys.argv[1]).with_name("second.log")
    known_warnings.divert(second)
    logging.getLogger("torchrec.distributed.utils").warning("second job")
    count = lambda p: p.read_text().count("second job") if p.exists() else "-"
    print(count(second), count(Path(sys.argv[1])))
"""


def run(tmp_path: Path, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    script, log = tmp_path / "entry.py", tmp_path / "out" / "third_party_warnings.log"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(log)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc, log


def test_third_party_warnings_go_to_the_file_and_errors_stay(tmp_path):
    proc, log = run(tmp_path)
    kept = log.read_text()
    for text in (
        "FutureWarning",
        "`broadcast_buffers` is deprecated",
        "WARNING torchrec.distributed.utils: Compute Kernel is dense",
        "WARNING torch.fx._symbolic_trace: is_fx_tracing",
        "WARNING root: Sharding spec not found for ebc.t_segment",
        "WARNING torchrec.distributed.comm: from the rank",  # the spawned child's, through the environment
    ):
        assert text in kept, (text, kept)
        assert text.split(": ")[-1] not in proc.stderr, proc.stderr
    assert len(kept.splitlines()) == 5
    assert "reco's own warning" in proc.stderr and "a root warning from reco's code" in proc.stderr
    assert "rank 1 failed: an error is never hidden" in proc.stderr and "error is never" not in kept
    summary, second_job = proc.stdout.strip().splitlines()
    assert summary == f"5 known third-party warnings (TorchRec, torch, FBGEMM) kept in {log}"
    assert second_job == "1 0"  # a second divert() moves them, without hooking twice


def test_they_can_be_shown_as_before(tmp_path):
    proc, log = run(tmp_path, {"RECO_SHOW_THIRD_PARTY_WARNINGS": "1"})
    assert not log.exists() and proc.stdout.splitlines() == ["", "- -"]
    assert "Compute Kernel is dense" in proc.stderr and "from the rank" in proc.stderr
