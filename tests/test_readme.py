"""Every command the README shows still works (`make readme-check` runs this file).

Commands are taken from the README's fenced code blocks, so a documented command cannot rot:
- `python run.py ...`: composed with its overrides and its variant graph planned (what run.py does
  before anything slow; a full run of each would take hours). Multirun sweeps are expanded per value.
- `python -m reco.X ...` / `python -m bench.X ...` and the `locust` / `mlflow` command lines: `--help` runs, and every flag the
  README uses is one the program accepts.
- `make T`: the target exists (`make -n T`); pip pins shown for a manual install match the Makefile's.
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from reco.cli.compose import compose
from reco.config import resolve_config
from reco.graph import plan

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Placeholders the README uses for the user's own values -> a value that exists here.
PLACEHOLDERS = {
    "data=<yours>": "data=table",
    "prune.amount=0.3,0.5,0.7": "prune.amount=0.3,0.5,0.7",
}


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^\s*```[a-z]*\n(.*?)^\s*```", text, flags=re.S | re.M)
    cmds = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():  # join continued lines
            line = line.split("  #")[0].strip()
            if re.match(r"^(python3?(\.11)?|\.venv/bin/\w+|make)\s", line):
                cmds.append(line)
    return cmds


COMMANDS = readme_commands()


def _expand(overrides: list[str]) -> list[list[str]]:
    """Hydra multirun sweeps `k=a,b` -> one override list per value."""
    choices = [[f"{o.split('=', 1)[0]}={v}" for v in o.split("=", 1)[1].split(",")] for o in overrides]
    return [list(c) for c in itertools.product(*choices)]


def test_readme_shows_commands():
    assert any("run.py" in c for c in COMMANDS) and any(c.startswith("make ") for c in COMMANDS)


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if " run.py" in f" {c}"])
def test_run_py_command_composes_and_plans(cmd):
    for a, b in PLACEHOLDERS.items():
        cmd = cmd.replace(a, b)
    args = shlex.split(cmd)[2:]
    overrides = [a for a in args if a not in ("-m", "--multirun")]
    for combo in _expand(overrides) if "-m" in args else [overrides]:
        nodes = plan(resolve_config(compose(combo)))
        assert nodes, cmd


def _help(argv: list[str]) -> str:
    proc = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.parametrize(
    "cmd",
    [
        c
        for c in COMMANDS
        if re.match(r"^(\.venv/bin/)?python3? -m (reco|bench)\.|^\.venv/bin/(locust|mlflow) ", c)
    ],
)
def test_program_accepts_every_flag_shown(cmd):
    args = shlex.split(cmd)
    prog = Path(args[0]).name
    if prog.startswith("python"):
        argv, rest = [sys.executable, "-m", args[2]], args[3:]
    elif prog == "locust":  # --help lists Locust's own options; the locustfile adds reco's
        argv, rest = [str(BIN / "locust"), "-f", "loadtest/locustfile.py"], args[1:]
        extra = re.findall(
            r'add_argument\(\s*"(--[a-z-]+)"', (ROOT / "loadtest" / "locustfile.py").read_text()
        )
    else:  # mlflow <subcommand>
        argv, rest = [str(BIN / "mlflow"), args[1]], args[2:]
    text = _help(argv) + "\n".join(extra if prog == "locust" else [])
    for flag in (a.split("=")[0] for a in rest if a.startswith("--")):
        assert flag in text, f"{cmd}: {flag} is not an option of {' '.join(argv)}"


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.startswith("make ")])
def test_make_target_exists(cmd):
    target = shlex.split(cmd)[1]
    proc = subprocess.run(
        ["make", "-n", target, "VARIANT=x", "DATASET=y"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, f"{cmd}: {proc.stderr}"


def test_manual_install_pins_match_the_makefile():
    make = (ROOT / "Makefile").read_text()
    for pin in re.findall(r"\b([a-z][a-z0-9-]+==[0-9.]+)", "\n".join(COMMANDS)):
        assert pin in make, f"README pins {pin} but the Makefile does not"
