"""The Wilson interval and McNemar's exact test: against values worked out by
hand for small tables, and against scipy.stats (in this environment, or in the
job venv, which has it) over a grid of tables."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from overbrainer_prefect.evaluation.stats import mcnemar_exact, wilson
from tests.conftest import job_venv

Z95 = 1.959963984540054  # the 97.5% quantile of the standard normal


@pytest.mark.parametrize(
    ("up", "down", "expected"),
    [
        (0, 0, 1.0),  # no discordant pair: nothing to tell the models apart
        (3, 0, 2 / 8),  # n=3: 2 * P(X <= 0) = 2 * 1/8
        (5, 1, 2 * (1 + 6) / 64),  # n=6: 2 * (C(6,0) + C(6,1)) / 2^6
        (1, 5, 2 * (1 + 6) / 64),  # symmetric
        (2, 2, 1.0),  # 2 * (1 + 4 + 6) / 16 > 1: capped
        (15, 0, 2 / 2**15),  # 18/20 vs 3/20 with every flip upwards
        (16, 1, 2 * (1 + 17) / 2**17),
    ],
)
def test_mcnemars_exact_p_is_twice_the_binomial_tail_of_the_discordant_pairs(
    up: int, down: int, expected: float
) -> None:
    assert mcnemar_exact(up, down) == pytest.approx(expected, rel=1e-12)


def test_wilson_intervals_match_the_formula_worked_by_hand() -> None:
    # 0 of 10: [0, z²/(n + z²)]
    none = wilson(0, 10)
    assert none.low == 0.0
    assert none.high == pytest.approx(Z95**2 / (10 + Z95**2), rel=1e-12)
    # 5 of 10: centred on 1/2, half-width z·sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n)
    half = Z95 * math.sqrt(0.25 / 10 + Z95**2 / 400) / (1 + Z95**2 / 10)
    five = wilson(5, 10)
    assert five.low == pytest.approx(0.5 - half, rel=1e-12)
    assert five.high == pytest.approx(0.5 + half, rel=1e-12)
    assert (round(five.low, 4), round(five.high, 4)) == (0.2366, 0.7634)
    # all of them: the mirror of none
    every = wilson(10, 10)
    assert every.high == 1.0 and every.low == pytest.approx(1 - none.high, rel=1e-12)
    assert wilson(0, 0).low == 0.0 and wilson(0, 0).high == 1.0
    # a wider level, a wider interval
    assert wilson(5, 10, 0.99).low < five.low < five.high < wilson(5, 10, 0.99).high


def test_impossible_counts_are_refused_in_one_line() -> None:
    for call in (lambda: wilson(3, 2), lambda: wilson(-1, 2), lambda: mcnemar_exact(-1, 0)):
        with pytest.raises(ValueError, match="give") as caught:
            call()
        assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="confidence 1"):
        wilson(1, 2, 1)


GRID = [(k, n) for n in (1, 2, 7, 20, 53) for k in range(0, n + 1, max(1, n // 6))]
PAIRS = [(b, c) for b in (0, 1, 3, 9, 20) for c in (0, 2, 5, 17)]

SCIPY = """
import json, sys
from scipy.stats import binomtest
grid, pairs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {"wilson": [], "mcnemar": []}
for k, n in grid:
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    out["wilson"].append([ci.low, ci.high])
for b, c in pairs:
    out["mcnemar"].append(binomtest(min(b, c), b + c, 0.5).pvalue if b + c else 1.0)
print(json.dumps(out))
"""


def scipy_reference() -> dict[str, list[Any]]:
    """scipy.stats' values for GRID and PAIRS, from this Python when it has scipy,
    else from the job venv's."""
    python = sys.executable
    if importlib.util.find_spec("scipy") is None:
        python = str(job_venv() / "bin" / "python")
        if not Path(python).is_file():
            pytest.skip("no scipy here and no job venv")
    done = subprocess.run(
        [python, "-c", SCIPY, json.dumps(GRID), json.dumps(PAIRS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"no scipy in {python}: {done.stderr[-200:]}")
    result: dict[str, list[Any]] = json.loads(done.stdout)
    return result


def test_the_interval_and_the_test_agree_with_scipy_stats() -> None:
    reference = scipy_reference()
    for (k, n), (low, high) in zip(GRID, reference["wilson"], strict=True):
        ours = wilson(k, n)
        assert ours.low == pytest.approx(low, abs=1e-9), (k, n)
        assert ours.high == pytest.approx(high, abs=1e-9), (k, n)
    for (b, c), p in zip(PAIRS, reference["mcnemar"], strict=True):
        assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-9, abs=1e-15), (b, c)
