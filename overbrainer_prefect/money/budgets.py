"""What may be spent: a day's and a month's dollars for every pod together,
and optionally for the pods of one target, checked once when they are read.

The budgets live on the Prefect server (`server_budget.py`); this module only
checks them, so any process reads them the same way. Days and months are
UTC: a day's budget resets at 00:00 UTC, a month's on the 1st at 00:00 UTC.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class BudgetSettingError(ValueError):
    """Budgets that cannot be used; the message is one line saying what to fix."""


class Limits(BaseModel):
    """A day's and a month's dollars (None: no bound on that period)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    day_usd: float | None = Field(default=None, description="Dollars a UTC day may cost.")
    month_usd: float | None = Field(default=None, description="Dollars a UTC month may cost.")

    @field_validator("day_usd", "month_usd", mode="before")
    @classmethod
    def _dollars(cls, value: object) -> object:
        if value is None:
            return None
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a number of dollars")
        try:
            number = float(str(value))  # any JSON the variable holds
        except (TypeError, ValueError):
            raise ValueError(f"{str(value)[:40]!r} is not a number of dollars") from None
        if not math.isfinite(number):
            raise ValueError(f"{value!r} is not a number of dollars")
        if number <= 0:
            raise ValueError(f"${number:g} is not a budget: give more than $0, or leave it unset")
        return number

    @property
    def bounded(self) -> bool:
        """Whether any period is bounded."""
        return self.day_usd is not None or self.month_usd is not None


class Budgets(Limits):
    """Every pod's day and month together, and (in `targets`, by target block
    name like `overbrainer-runpod-target/runpod`, or its bare name) one target's own."""

    targets: dict[str, Limits] = Field(default_factory=dict)

    def applying_to(self, target: str) -> list[tuple[str, str | None, float]]:
        """The bounds a pod of `target` must fit in: (period, target or None
        for every target, dollars), periods `day` then `month`."""
        found: list[tuple[str, str | None, float]] = []
        own = self.targets.get(target) or self.targets.get(target.rpartition("/")[2])
        for scope, limits in ((None, self), (target, own)):
            if limits is None:
                continue
            if limits.day_usd is not None:
                found.append(("day", scope, limits.day_usd))
            if limits.month_usd is not None:
                found.append(("month", scope, limits.month_usd))
        return found


HOW_TO_SET = (
    "`python blocks/create_blocks.py --budget-day-usd 20 --budget-month-usd 300`, or "
    '`prefect variable set overbrainer_budget \'{"day_usd": 20, "month_usd": 300}\' --overwrite`'
)
"""How the budgets are set, for messages."""


def budgets_from(value: object) -> Budgets:
    """`value` (the JSON the budget variable holds) as checked budgets.
    Raises BudgetSettingError with one line naming the first field in error."""
    if isinstance(value, Budgets):
        return value
    if not isinstance(value, dict):
        raise BudgetSettingError(
            f'the budget is not a JSON object like {{"day_usd": 20, "month_usd": 300}}: '
            f"set it with {HOW_TO_SET}"
        )
    try:
        return Budgets.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise BudgetSettingError(f"budget {where}: {message}; set it with {HOW_TO_SET}") from None
