"""Statistics of paired pass/fail outcomes, without scipy.

- `wilson`: the Wilson score interval of a pass rate (Wilson 1927), which stays
  inside [0, 1] and is sound for small samples and rates near 0 or 1, unlike
  the normal approximation;
- `mcnemar_exact`: McNemar's exact test of two models on the same items: the
  two-sided binomial test, at p = 1/2, of the discordant pairs (items that one
  model passes and the other fails); the concordant ones say nothing about which
  is better.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from statistics import NormalDist


@dataclass(frozen=True)
class Interval:
    """A confidence interval of a proportion."""

    low: float
    high: float


def wilson(successes: int, total: int, confidence: float = 0.95) -> Interval:
    """The Wilson score interval of `successes` out of `total` at `confidence`.

    Raises ValueError when the counts are negative, successes exceed the total,
    or confidence is not strictly between 0 and 1. An empty sample gives [0, 1].
    """
    if total < 0 or successes < 0 or successes > total:
        raise ValueError(f"{successes} successes out of {total}: give 0 <= successes <= total")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence {confidence}: give a level between 0 and 1, like 0.95")
    if total == 0:
        return Interval(0.0, 1.0)
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p = successes / total
    z2n = z * z / total
    centre = (p + z2n / 2) / (1 + z2n)
    half = z * math.sqrt(p * (1 - p) / total + z2n / (4 * total)) / (1 + z2n)
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == total else min(1.0, centre + half)
    return Interval(low, high)


def mcnemar_exact(fail_to_pass: int, pass_to_fail: int) -> float:
    """The two-sided p-value of McNemar's exact test for `fail_to_pass` items the
    second model passes and the first fails, and `pass_to_fail` the other way:
    twice the binomial(n, 1/2) probability of a count at most the smaller one,
    capped at 1 (1 when there is no discordant pair).

    Raises ValueError for a negative count.
    """
    if fail_to_pass < 0 or pass_to_fail < 0:
        raise ValueError(f"counts {fail_to_pass} and {pass_to_fail}: give counts of 0 or more")
    n = fail_to_pass + pass_to_fail
    if n == 0:
        return 1.0
    k = min(fail_to_pass, pass_to_fail)
    tail = Fraction(sum(math.comb(n, i) for i in range(k + 1)), 2**n)
    return float(min(Fraction(1), 2 * tail))
