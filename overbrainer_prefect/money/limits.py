"""The GPU budget's two limits: how many pods run at once and what they cost
together an hour, each a global concurrency limit of the Prefect server
(`server_budget.gpu_budget` holds them):

- `overbrainer-gpu-pods`: one slot a pod;
- `overbrainer-gpu-cents-per-hour`: one slot a cent of hourly price, so a pod
  at $0.53/h holds 53 slots.
"""

from __future__ import annotations

import math

POD_LIMIT = "overbrainer-gpu-pods"
"""The global concurrency limit counting pods (one slot a pod)."""

SPEND_LIMIT = "overbrainer-gpu-cents-per-hour"
"""The global concurrency limit counting the hourly price of the pods, in cents."""

LEASE_S = 300.0  # the slots of a holder that died free themselves after this long


class BudgetError(Exception):
    """The GPU budget cannot be taken; the message says what to do."""


def cents_per_hour(price_per_hour: float) -> int:
    """The slots a pod at `price_per_hour` dollars an hour takes of the spend limit
    (cents, rounded up; at least one). Raises BudgetError for a negative or
    non-finite price."""
    if not math.isfinite(price_per_hour) or price_per_hour < 0:
        raise BudgetError(f"{price_per_hour!r} is not a price in dollars an hour")
    return max(1, math.ceil(round(price_per_hour * 100, 6)))


def create_commands(pods: int = 2, dollars_per_hour: float = 5.0) -> str:
    """The commands that create the budget's limits (for messages and the README)."""
    return (
        f"`prefect gcl create {POD_LIMIT} --limit {pods}` and "
        f"`prefect gcl create {SPEND_LIMIT} --limit {cents_per_hour(dollars_per_hour)}` "
        f"(or `python blocks/create_blocks.py --budget-pods {pods} "
        f"--budget-dollars-per-hour {dollars_per_hour:g}`)"
    )


def check_budget(pods: int, dollars_per_hour: float) -> dict[str, int]:
    """The size of each limit for at most `pods` pods at once, together at most
    `dollars_per_hour`. Raises BudgetError for a budget below one pod or one
    cent an hour."""
    if pods < 1:
        raise BudgetError(f"--budget-pods {pods}: allow at least one pod")
    if dollars_per_hour <= 0:
        raise BudgetError(f"--budget-dollars-per-hour {dollars_per_hour:g}: allow more than $0/h")
    return {POD_LIMIT: pods, SPEND_LIMIT: cents_per_hour(dollars_per_hour)}


def too_dear(price_per_hour: float, spend_cents: int, spend_limit: str = SPEND_LIMIT) -> str | None:
    """Why a pod at `price_per_hour` can never take the spend limit of
    `spend_cents` (it costs more than all of it), None when it fits."""
    cents = cents_per_hour(price_per_hour)
    if cents <= spend_cents:
        return None
    return (
        f"a pod at ${price_per_hour:.2f}/h costs more than the whole GPU budget "
        f"(${spend_cents / 100:.2f}/h, limit {spend_limit}): raise it with `prefect gcl update "
        f"{spend_limit} --limit {cents}`, or choose a cheaper GPU"
    )
