"""The load test's time budget (`loadtest.study.budget_min`): what runs, what is skipped, and what it cost.

A study's time follows the eager baseline's capacity on the machine (its capacity search runs at a few
requests per second), so the user sets the wall time instead, and the study spends it in its order of
work (reco.loadtest.study): a window that would start past the deadline is SKIPPED and listed, never
guessed; a capacity search stops between steps when the deadline (less what the later phases need)
has passed, and keeps its bracket open on that side. A figure left with fewer repeats has a wider interval
and a verdict it cannot decide reads INCONCLUSIVE; the report lists every skipped window and how many
more minutes would have run them (each estimated from the same variant's windows of that kind).

Before anything starts, a budget too small to test even the reference (settling every variant, then the
reference's unloaded windows that the SLO needs) stops the study with the minimum it needs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class BudgetTooSmall(ValueError):
    """budget_min cannot cover even the reference's first measurements."""


@dataclass
class Skipped:
    variant: str
    kind: str  # "unloaded" | "capacity" | "common" | "equal_util"
    what: str  # e.g. "common run 2 at 4.1 req/s"
    est_s: float | None  # seconds it would have taken (same variant's windows of that kind), None: unknown


@dataclass
class Budget:
    """The deadline of one study's measurements; `minutes` None: no budget (nothing is ever skipped)."""

    minutes: float | None
    start: float = field(default_factory=time.time)
    skipped: list[Skipped] = field(default_factory=list)
    clock: Callable[[], float] = time.time  # epoch seconds; a test hands in a clock it moves itself

    @property
    def deadline(self) -> float:
        return math.inf if self.minutes is None else self.start + 60.0 * self.minutes

    def over(self, reserve_s: float = 0.0) -> bool:
        """True when the deadline less `reserve_s` (time later phases need) has passed."""
        return self.clock() > self.deadline - reserve_s

    def used_min(self) -> float:
        return (self.clock() - self.start) / 60.0

    def more_min(self) -> float | None:
        """Minutes the skipped windows would have added (None when some has no estimate)."""
        est = [s.est_s for s in self.skipped]
        return None if any(e is None for e in est) else sum(est) / 60.0


def check_budget(minutes: float | None, need_s: float, what: str) -> None:
    """Stop before the first window when `minutes` cannot cover `need_s` seconds (`what` says of what)."""
    if minutes is None:
        return
    if not minutes > 0:
        raise BudgetTooSmall(
            f"loadtest.study.budget_min: expected > 0 minutes or null (no budget), got {minutes}"
        )
    if 60.0 * minutes < need_s:
        raise BudgetTooSmall(
            f"loadtest.study.budget_min={minutes:g} is too small to test even the reference: it needs at "
            f"least {math.ceil(need_s / 60.0)} min ({what}); raise it, or null for no budget"
        )


def summary(budget: Budget) -> str:
    """One line for the report and the log: budget, used, skipped windows and what would have run them."""
    if budget.minutes is None:
        return "none (loadtest.study.budget_min: null)"
    head = f"{budget.minutes:g} min, used {budget.used_min():.1f} min"
    if not budget.skipped:
        return head + "; every planned window ran"
    kinds: dict[str, int] = {}
    for s in budget.skipped:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    more = budget.more_min()
    extra = (
        f"about {budget.minutes + more:.0f} min would have run them" if more is not None else "no estimate"
    )
    listed = ", ".join(f"{n} {k}" for k, n in kinds.items())
    return f"{head}; skipped {len(budget.skipped)} windows ({listed}): {extra}"
