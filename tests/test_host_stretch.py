"""bench.host_stretch's reading of a run: runs of slow seconds against the run's median."""

import pytest

from bench.host_stretch import cpu_jiffies, stretches


def test_stretches_are_runs_of_slow_seconds():
    p50s = [2.0] * 10 + [3.0, 3.2] + [2.0] * 5 + [2.8] + [2.0] * 3 + [4.0]
    found = stretches(p50s, 1.3)
    assert [(s, n) for s, n, _ in found] == [(10, 2), (17, 1), (21, 1)]  # one at the very end too
    assert found[0][2] == pytest.approx(1.55)
    assert stretches([2.0] * 20, 1.3) == []


def test_an_unknown_cpu_is_named():
    with pytest.raises(ValueError, match="--cpu 4096"):
        cpu_jiffies(4096)
