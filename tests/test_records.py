"""experiments/<name>/ holds one record per study, and what configs and code cite there exists.

A study's folder is its README (what it measures, the command, a runs table, the findings) beside the
latest report, comparison.csv and plots; earlier runs are in git history, logs in MLflow. Comments in
conf/ and reco/ that justify a knob link the figure as experiments/<name>/README.md#<heading>.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
CITE = re.compile(r"experiments/([\w-]+)/README\.md#([\w-]+)")


def anchors(readme: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", readme.read_text(), flags=re.S | re.M)
    heads = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def tracked(folder: Path) -> list[Path]:
    """The files git tracks under `folder` (a local run's own outputs there are not the record)."""
    proc = subprocess.run(["git", "ls-files", "-z", str(folder)], cwd=ROOT, capture_output=True)
    if proc.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / f for f in proc.stdout.decode().split("\0") if f]


def test_study_folders_are_records():
    files = tracked(EXPERIMENTS)
    copies = [
        p.relative_to(ROOT)
        for p in files
        if p.suffix == ".log" or re.match(r"(run\d+|attempt|agree)_", p.name)
    ]
    assert not copies, f"logs and run copies belong in git history and MLflow, not experiments/: {copies}"
    long = {
        str(p.relative_to(ROOT)): n
        for p in files
        if p.name == "README.md"
        and p.parent.parent == EXPERIMENTS
        and (n := len(p.read_text().splitlines())) > 200
    }
    assert not long, f"a study README is at most 200 lines: {long}"


def test_figures_cited_by_configs_and_code_exist():
    dead = []
    for path in [*(ROOT / "conf").rglob("*.yaml"), *(ROOT / "reco").rglob("*.py")]:
        for name, anchor in CITE.findall(path.read_text()):
            readme = EXPERIMENTS / name / "README.md"
            if not readme.exists() or anchor not in anchors(readme):
                dead.append(f"{path.relative_to(ROOT)}: experiments/{name}/README.md#{anchor}")
    assert not dead, f"links to figures that are not there: {dead}"
