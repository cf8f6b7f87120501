"""The judge's prompt: a template with placeholders, replaceable by the user.

Placeholders are `{question}`, `{expected}` (the item's expected answer, or
empty), `{answer_a}` and `{answer_b}`; each is replaced in one pass, so an
answer that itself holds `{answer_b}` is never expanded again, and any other
brace in the template stays as it is. A template must hold `{question}`,
`{answer_a}` and `{answer_b}`. The judge's reply is read by `judge.read_choice`:
its first word `A`, `B` or `tie`.

The evaluation job renders the same template on the target, where it cannot
import this package: `render` is the one of the generation module it is staged
with (`jobs/overbrainer_generate.py`), so both ends render alike.
"""

from __future__ import annotations

from overbrainer_prefect.jobs.overbrainer_generate import render as render

REQUIRED = ("{question}", "{answer_a}", "{answer_b}")

DEFAULT_TEMPLATE = """You are judging two answers to the same question.

Question: {question}
Expected answer (may be empty): {expected}

Answer A: {answer_a}

Answer B: {answer_b}

Which answer is better: correct, helpful and faithful to the expected answer?
Reply with one word only: A, B or tie."""


def template_problem(template: str) -> str | None:
    """One line saying which required placeholder `template` lacks, or None."""
    missing = [p for p in REQUIRED if p not in template]
    if missing:
        return (
            f"the judge template lacks {', '.join(missing)}: it must hold {{question}}, "
            "{answer_a} and {answer_b} (and may hold {expected})"
        )
    return None
