"""Timing two ways of doing the same thing side by side on a shared, noisy
machine: the two sides alternate (which goes first alternates too), each pair
gives a ratio, and the median of the pairs' ratios is the figure."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Sides:
    """The timings of `ours` and `reference`, pair by pair (seconds)."""

    ours: list[float] = field(default_factory=list)
    reference: list[float] = field(default_factory=list)

    def speed_ratios(self) -> list[float]:
        """reference / ours per pair: above 1 means ours is faster."""
        return [r / o for o, r in zip(self.ours, self.reference, strict=True)]

    def time_ratios(self) -> list[float]:
        """ours / reference per pair: below 1 means ours is faster."""
        return [o / r for o, r in zip(self.ours, self.reference, strict=True)]

    def describe(self, size_mib: float | None = None) -> str:
        """The pairs' times (and rates, given the MiB moved) on one line."""

        def shown(times: list[float]) -> str:
            if size_mib is None:
                return " ".join(f"{t:.2f}" for t in times)
            return " ".join(f"{t:.2f} ({size_mib / t:.0f} MiB/s)" for t in times)

        return f"ours {shown(self.ours)}; reference {shown(self.reference)}"


def timed(action: Callable[[], object]) -> float:
    """Seconds `action()` takes."""
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def side_by_side(
    pairs: int,
    ours: Callable[[], float],
    reference: Callable[[], float],
    before: Callable[[], None] | None = None,
) -> Sides:
    """`pairs` timings of each side, alternating which runs first; each side is
    a callable returning its own seconds (so that it may leave its set-up out),
    `before` runs before every timing (cleaning up the previous one)."""
    sides = Sides()
    for number in range(pairs):
        order = [(ours, sides.ours), (reference, sides.reference)]
        if number % 2:
            order.reverse()
        for action, times in order:
            if before is not None:
                before()
            times.append(action())
    return sides


def median(values: list[float]) -> float:
    """The median of `values` (not empty)."""
    return float(statistics.median(values))
