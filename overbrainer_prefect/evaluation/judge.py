"""The pairwise judge: is the tuned model's answer better than the base model's?

Each held-out item is judged twice, once with the base answer as `A` and the
tuned one as `B` (`base_first`), once the other way (`tuned_first`), so a judge
that prefers whatever comes first (position bias) gives a tie, not a win. An
order's choice scores the tuned answer 1 (better), 0 (worse) or 1/2 (tie); an
item's score is the mean over the orders whose reply could be read, and the win
rate the mean over the items judged. Ties count half.

The judge is an OpenAI-compatible chat endpoint (`OpenAIJudge`: an Ollama
server's `/v1`, asked from this machine with httpx) or a GGUF the evaluation job
runs on the target; either gives the same `JudgeCall`s.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, JsonValue

from overbrainer_prefect.evaluation.spec import BadEvaluationInput, EvalItem, JudgeSpec
from overbrainer_prefect.evaluation.template import render

Order = Literal["base_first", "tuned_first"]
ORDERS: tuple[Order, ...] = ("base_first", "tuned_first")
Choice = Literal["A", "B", "tie"]

CHECK_TIMEOUT_S = 10.0  # an endpoint that does not list its models in this time is not answering
WORD = re.compile(r"[A-Za-z]+")
TIE_WORDS = frozenset({"tie", "tied", "draw", "equal", "neither", "both", "same"})


class JudgeError(RuntimeError):
    """A judge call failed while evaluating. The message is one line, without the
    endpoint's answer body."""


class JudgeCall(BaseModel):
    """One judge reply: the item, which answer came first, what the judge said."""

    model_config = ConfigDict(extra="forbid")

    item: str
    order: Order
    reply: str

    @property
    def choice(self) -> Choice | None:
        """The reply read as a choice (see `read_choice`)."""
        return read_choice(self.reply)


class JudgeOutcome(BaseModel):
    """The judge's verdict over the items it judged."""

    model_config = ConfigDict(extra="forbid")

    judge: str = Field(description="The judge: the endpoint's model, or the GGUF's name.")
    judged: int = Field(ge=0, description="Items with at least one readable reply.")
    wins: int = Field(ge=0, description="Items the tuned answer won in both orders.")
    losses: int = Field(ge=0, description="Items it lost in both orders.")
    ties: int = Field(ge=0, description="Every other item judged: ties, and split orders.")
    win_rate: float | None = Field(description="The tuned answer's mean score, ties half.")
    unreadable: int = Field(ge=0, description="Replies that were not A, B or tie.")
    split_orders: int = Field(
        ge=0, description="Items whose two orders chose opposite answers (position bias)."
    )
    scores: dict[str, float] = Field(default_factory=dict, description="Each item's score.")


def read_choice(reply: str) -> Choice | None:
    """The choice in a judge's reply: its first word `A` or `B` (after an optional
    `Answer`), or a tie word (`tie`, `draw`, `equal`...); None when it is neither."""
    words = WORD.findall(reply)
    if words and words[0].casefold() == "answer" and len(words) > 1:
        words = words[1:]
    if not words:
        return None
    first = words[0].casefold()
    if first == "a":
        return "A"
    if first == "b":
        return "B"
    return "tie" if first in TIE_WORDS else None


def order_score(order: Order, choice: Choice) -> float:
    """The tuned answer's score for `choice` in `order`: 1 when it was chosen, 0
    when the base answer was, 1/2 for a tie."""
    if choice == "tie":
        return 0.5
    tuned_letter = "B" if order == "base_first" else "A"
    return 1.0 if choice == tuned_letter else 0.0


def prompts(item: EvalItem, template: str, base: str, tuned: str) -> dict[Order, str]:
    """The judge's two prompts for `item`'s base and tuned answers, one per order."""
    expected = item.reference_text or item.expected
    return {
        "base_first": render(template, item.prompt, expected, base, tuned),
        "tuned_first": render(template, item.prompt, expected, tuned, base),
    }


def summarise(calls: Sequence[JudgeCall], judge: str) -> JudgeOutcome:
    """The outcome of the judge's `calls` (both orders of each item)."""
    by_item: dict[str, dict[Order, Choice | None]] = {}
    for call in calls:
        by_item.setdefault(call.item, {})[call.order] = call.choice
    scores: dict[str, float] = {}
    unreadable = split = 0
    for item, choices in by_item.items():
        readable = [order_score(o, c) for o, c in choices.items() if c is not None]
        unreadable += sum(1 for c in choices.values() if c is None)
        if not readable:
            continue
        scores[item] = sum(readable) / len(readable)
        if sorted(readable) == [0.0, 1.0]:
            split += 1
    return JudgeOutcome(
        judge=judge,
        judged=len(scores),
        wins=sum(1 for s in scores.values() if s == 1.0),
        losses=sum(1 for s in scores.values() if s == 0.0),
        ties=sum(1 for s in scores.values() if 0.0 < s < 1.0),
        win_rate=sum(scores.values()) / len(scores) if scores else None,
        unreadable=unreadable,
        split_orders=split,
        scores=scores,
    )


def _headers(judge: JudgeSpec) -> dict[str, str]:
    if judge.api_key_env is None:
        return {}
    key = os.environ.get(judge.api_key_env)
    if not key:
        raise BadEvaluationInput(
            f"judge.api_key_env names {judge.api_key_env}, which is not set here: set it, or "
            "leave api_key_env unset for a server without keys"
        )
    return {"Authorization": f"Bearer {key}"}


def _base(judge: JudgeSpec) -> str:
    assert judge.endpoint is not None
    return judge.endpoint.rstrip("/")


def check_judge_endpoint(judge: JudgeSpec, client: httpx.Client | None = None) -> None:
    """Checks, before anything runs, that the judge's endpoint answers and serves
    its model: `GET <endpoint>/models` (Ollama's `/v1/models`). Does nothing for a
    GGUF judge.

    Raises BadEvaluationInput with one line when the endpoint does not answer, is
    not OpenAI-compatible, or does not list the model (a name without a tag also
    matches its `:latest`).
    """
    if judge.endpoint is None:
        return
    headers = _headers(judge)
    url = f"{_base(judge)}/models"
    timeout = min(CHECK_TIMEOUT_S, judge.timeout_s)
    try:
        if client is None:
            with httpx.Client(timeout=timeout) as own:
                response = own.get(url, headers=headers)
        else:
            response = client.get(url, headers=headers, timeout=timeout)
    except httpx.HTTPError as error:
        raise BadEvaluationInput(
            f"the judge endpoint {judge.endpoint} does not answer ({_reason(error)}): start it "
            "(`ollama serve`) or fix judge.endpoint"
        ) from None
    if response.status_code != 200:
        raise BadEvaluationInput(
            f"the judge endpoint {judge.endpoint} answers HTTP {response.status_code} to "
            "GET /models: give an OpenAI-compatible base URL, like http://127.0.0.1:11434/v1"
        )
    try:
        listed = [str(m.get("id")) for m in response.json().get("data", [])]
    except (ValueError, AttributeError):
        raise BadEvaluationInput(
            f"the judge endpoint {judge.endpoint} lists no models in OpenAI's shape: give an "
            "OpenAI-compatible base URL, like http://127.0.0.1:11434/v1"
        ) from None
    wanted = {judge.model, f"{judge.model}:latest"}
    if not wanted & set(listed):
        raise BadEvaluationInput(
            f"the judge endpoint {judge.endpoint} has no model {judge.model}: pull it "
            f"(`ollama pull {judge.model}`) or name one it has"
        )


def _reason(error: httpx.HTTPError) -> str:
    if isinstance(error, httpx.ConnectError):
        return "cannot connect"
    if isinstance(error, httpx.TimeoutException):
        return "timed out"
    return type(error).__name__


@dataclass
class OpenAIJudge:
    """A judge behind an OpenAI-compatible `POST <endpoint>/chat/completions`,
    asked greedily (temperature 0) with a fixed seed."""

    spec: JudgeSpec
    client: httpx.Client

    def ask(self, prompt: str, seed: int) -> str:
        """The judge's reply to `prompt`. Raises JudgeError with one line (the HTTP
        status or the connection failure, never the body) when the call fails."""
        body: dict[str, JsonValue] = {
            "model": self.spec.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "seed": seed,
            "max_tokens": self.spec.max_tokens,
            "stream": False,
        }
        try:
            response = self.client.post(
                f"{_base(self.spec)}/chat/completions",
                json=body,
                headers=_headers(self.spec),
                timeout=self.spec.timeout_s,
            )
        except httpx.HTTPError as error:
            raise JudgeError(
                f"the judge endpoint {self.spec.endpoint} failed: {_reason(error)}"
            ) from None
        if response.status_code != 200:
            raise JudgeError(
                f"the judge endpoint {self.spec.endpoint} answered HTTP {response.status_code}"
            )
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError(
                f"the judge endpoint {self.spec.endpoint} answered no chat completion"
            ) from None
        return str(content or "")

    def judge(self, pairs: Sequence[tuple[EvalItem, str, str]], seed: int) -> list[JudgeCall]:
        """Both orders of each `(item, base answer, tuned answer)`, asked in turn.
        Raises JudgeError when a call fails."""
        calls = []
        for item, base, tuned in pairs:
            assert item.id is not None
            for order, prompt in prompts(item, self.spec.template, base, tuned).items():
                calls.append(JudgeCall(item=item.id, order=order, reply=self.ask(prompt, seed)))
        return calls
