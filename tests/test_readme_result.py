"""The README's *The result* quotes the latest committed case-study report, and the README stays a manual.

Every figure *The result* gives (a value with its interval, a capacity bracket, an inline-code figure, a
verdict count, the SLO) must appear verbatim in the Summary of experiments/ecommerce_case_study/report.md:
a new report.md committed without the README's result updated fails here, naming the figures.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REPORT = ROOT / "experiments" / "ecommerce_case_study" / "report.md"

# `...` spans holding a digit; a value with its interval (`-0.23% [-0.33, -0.13]`, `7.00× [0.00, inf)`);
# a bare interval or bracket (`[38, 57)`); a verdict count (**5 MET**); the SLO (200 ms p99 SLO).
CODE = re.compile(r"`([^`\n]+)`")
INTERVAL = re.compile(r"[-+]?\d[\d.,]*(?:×|%)? \[[^\]\)\[]*[\]\)]|\[[-+]?\d[^\]\)\[]*[\]\)]")
VERDICTS = re.compile(r"\*\*\d+ [A-Z][A-Z ]*\*\*")
SLO = re.compile(r"\d+ ms p99 SLO")


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section (up to the next `## `), stripped."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert m, f"no '## {heading}' section"
    return m.group(1).strip()


def figures(result: str) -> set[str]:
    code = [c for c in CODE.findall(result) if re.search(r"\d", c)]
    found = set(code) | set(VERDICTS.findall(result)) | set(SLO.findall(result))
    for span in [result, *code]:
        found |= set(INTERVAL.findall(span))
    return found


def not_in_summary(readme: str, report: str) -> list[str]:
    summary = section(report, "Summary")
    return sorted(f for f in figures(section(readme, "The result")) if f not in summary)


def test_the_result_quotes_the_reports_summary():
    readme, report = README.read_text(), REPORT.read_text()
    result = section(readme, "The result")
    assert "experiments/ecommerce_case_study/report.md" in result, "The result must link the report"
    assert len(figures(result)) >= 6, f"The result quotes too few of the Summary's figures: {figures(result)}"
    missing = not_in_summary(readme, report)
    assert not missing, (
        f"README.md's The result quotes figures that {REPORT.relative_to(ROOT)}'s Summary does not have "
        f"(update the README from the report): {missing}"
    )


def test_a_changed_figure_is_caught():
    report = "## Summary\n\nΔAUC -0.23% [-0.33, -0.13]; gain 3.1× [2.1, 4.7]; **5 MET**, the 200 ms p99 SLO\n"
    same = "## The result\n\nΔAUC `-0.23% [-0.33, -0.13]`, gain 3.1× [2.1, 4.7], **5 MET**, 200 ms p99 SLO\n"
    assert not_in_summary(same, report) == []
    changed = same.replace("3.1× [2.1, 4.7]", "3.2× [2.1, 4.7]").replace("**5 MET**", "**6 MET**")
    assert not_in_summary(changed, report) == ["**6 MET**", "3.2× [2.1, 4.7]"]


def test_the_readme_is_a_manual():
    lines = README.read_text().splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines (at most 350: history goes to CHANGELOG.md)"
    first_command = next(i for i, line in enumerate(lines) if line.strip().startswith("```")) + 2
    assert first_command <= 30, f"the README's first command is on line {first_command} (within 30)"
    result = section(README.read_text(), "The result").splitlines()
    assert len(result) <= 12, f"The result has {len(result)} lines (at most 12)"
