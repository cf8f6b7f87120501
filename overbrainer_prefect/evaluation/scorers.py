"""Scorers: whether an answer passes an item, on fixed strings.

Normalisation (`normalise`), used by `exact` and `contains`: Unicode NFKC,
curly quotes made straight, the markdown emphasis marks `*`, `_` and `` ` ``
removed, case folded, runs of whitespace made one space, and the ends
stripped of whitespace and of the punctuation `.,;:!?` and quotes. So
"**Paris.**" and "paris" are the same answer.

- `exact`: the normalised answer equals the normalised expected answer.
- `contains`: the normalised expected answer occurs in the normalised answer,
  not inside a longer word or number ("4" is in "2 + 2 = 4." but not in "14").
- `regex`: `re.search` of the expected pattern in the answer as it is (only its
  ends stripped); flags go in the pattern, like `(?i)`.
- `numeric`: the last number in the answer (commas between digit groups
  dropped, a leading minus kept) is within `tolerance` of the expected number;
  an answer without a number fails.
"""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Literal

ScorerKind = Literal["exact", "contains", "regex", "numeric"]
SCORERS: tuple[ScorerKind, ...] = ("exact", "contains", "regex", "numeric")

QUOTES = str.maketrans({"‘": "'", "’": "'", "‚": "'", "“": '"', "”": '"', "„": '"'})
EMPHASIS = re.compile(r"[*_`]+")
SPACES = re.compile(r"\s+")
EDGES = ".,;:!?'\" "
NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\w.])-?\d+(?:\.\d+)?")
"""A number in an answer: digit groups with commas (`1,000.5`) or plain digits."""


def normalise(text: str) -> str:
    """`text` normalised for `exact` and `contains` (see the module's docstring)."""
    text = unicodedata.normalize("NFKC", text).translate(QUOTES)
    text = EMPHASIS.sub("", text).casefold()
    return SPACES.sub(" ", text).strip(EDGES)


def exact(answer: str, expected: str) -> bool:
    """Whether the normalised answer is the normalised expected answer."""
    return normalise(answer) == normalise(expected)


def contains(answer: str, expected: str) -> bool:
    """Whether the normalised expected answer is in the normalised answer as a word
    or phrase of its own (not inside a longer word or number)."""
    needle = normalise(expected)
    if not needle:
        return False
    pattern = rf"(?<![^\W_]){re.escape(needle)}(?![^\W_])"
    return re.search(pattern, normalise(answer)) is not None


def regex(answer: str, pattern: str) -> bool:
    """Whether `pattern` is found in the answer. Raises re.error when the pattern
    does not compile (a spec checks it first: see `regex_problem`)."""
    return re.search(pattern, answer.strip()) is not None


def regex_problem(pattern: str) -> str | None:
    """Why `pattern` does not compile (re's message, with its position), or None."""
    try:
        re.compile(pattern)
    except re.error as error:
        return str(error)
    return None


def last_number(text: str) -> float | None:
    """The last number in `text`, or None when it holds none."""
    found = NUMBER.findall(unicodedata.normalize("NFKC", text))
    if not found:
        return None
    return float(found[-1].replace(",", ""))


def numeric(answer: str, expected: float, tolerance: float = 0.0) -> bool:
    """Whether the answer's last number is within `tolerance` of `expected`."""
    value = last_number(answer)
    return value is not None and math.isclose(value, expected, rel_tol=0.0, abs_tol=tolerance)


def passes(kind: ScorerKind, answer: str, expected: str, tolerance: float = 0.0) -> bool:
    """Whether `answer` passes the scorer `kind` against `expected` (a text, a
    pattern, or a number written out). Raises ValueError for an expected number
    that is not one, re.error for a pattern that does not compile."""
    if kind == "exact":
        return exact(answer, expected)
    if kind == "contains":
        return contains(answer, expected)
    if kind == "regex":
        return regex(answer, expected)
    return numeric(answer, float(expected), tolerance)
