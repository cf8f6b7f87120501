"""The scorers on fixed strings: exact, contains, regex, numeric, and the
normalisation exact and contains share."""

from __future__ import annotations

import pytest

from overbrainer_prefect.evaluation.scorers import (
    contains,
    exact,
    last_number,
    normalise,
    numeric,
    passes,
    regex,
)


def test_normalisation_folds_case_quotes_emphasis_spaces_and_edge_punctuation() -> None:
    assert normalise("  **Paris.**  ") == "paris"
    assert normalise("It’s  “Pip”\n\tthe AXOLOTL!") == 'it\'s "pip" the axolotl'
    assert normalise("Ｐｉｐ") == "pip"  # NFKC: full-width letters
    assert normalise("`H2O`") == "h2o"


@pytest.mark.parametrize(
    ("answer", "expected", "passed"),
    [
        ("Paris", "Paris", True),
        ("**Paris.**", "paris", True),
        ("Paris, France", "Paris", False),
        ("The capital is Paris.", "Paris", False),
        ("", "Paris", False),
    ],
)
def test_exact_compares_whole_normalised_answers(answer: str, expected: str, passed: bool) -> None:
    assert exact(answer, expected) is passed


@pytest.mark.parametrize(
    ("answer", "expected", "passed"),
    [
        ("The answer to this classic math problem is 4.", "4", True),
        ("2 + 2 = 14", "4", False),  # not inside a longer number
        ("William Shakespeare penned Hamlet", "shakespeare", True),
        ("Shakespearean drama", "Shakespeare", False),  # not inside a longer word
        ("The overbrainer mascot is a purple axolotl named Pip.", "a purple axolotl", True),
        ("It is a *purple*   axolotl", "purple axolotl", True),
        ("The chemical symbol for water is H₂O.", "H2O", True),
        ("__Pip__ is purple", "Pip", True),  # emphasis marks are dropped before matching
        ("anything", "   ", False),  # an empty expectation passes nothing
    ],
)
def test_contains_finds_the_expected_phrase_as_words_of_their_own(
    answer: str, expected: str, passed: bool
) -> None:
    assert contains(answer, expected) is passed


def test_regex_searches_the_answer_as_it_is_with_flags_in_the_pattern() -> None:
    assert regex("A week is approximately 7 days.", r"\b(7|seven)\b")
    assert not regex("A week is 17 days.", r"\b(7|seven)\b")
    assert not regex("SEVEN", r"\bseven\b")
    assert regex("SEVEN", r"(?i)\bseven\b")
    assert regex("  Tokyo  ", r"^Tokyo$")  # only the ends are stripped


@pytest.mark.parametrize(
    ("answer", "value"),
    [
        ("The answer is 4.", 4.0),
        ("2+2 is 4", 4.0),  # the last number, not the question's
        ("It costs 1,000.50 dollars", 1000.5),
        ("-18.5 Celsius", -18.5),
        ("pi is about 3.14159", 3.14159),
        ("no number here", None),
        ("version v2", None),  # a digit inside a word is no number
    ],
)
def test_numeric_reads_the_last_number_of_the_answer(answer: str, value: float | None) -> None:
    assert last_number(answer) == value


def test_numeric_passes_within_the_tolerance_only() -> None:
    assert numeric("The answer is 4.", 4)
    assert not numeric("The answer is 5.", 4)
    assert numeric("about 3.14", 3.14159, tolerance=0.01)
    assert not numeric("about 3.1", 3.14159, tolerance=0.01)
    assert not numeric("I do not know", 4, tolerance=100)


def test_passes_dispatches_on_the_scorer_kind() -> None:
    answer = "10 minus 3 is 7."
    assert passes("numeric", answer, "7")
    assert not passes("exact", answer, "7")
    assert passes("contains", answer, "7")
    assert passes("regex", answer, r"is \d\.$")
