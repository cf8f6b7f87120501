"""What an evaluation asks: items, controls, scorers, a judge; and the plan that repeats it.

`EvaluationSpec` is what a user gives (a flow parameter): where the items come
from (the run's held-out rows, an eval file, a list), the controls (a default
set shipped with the package, and the user's own), how many tokens an answer
may have, the seed, the quant, and an optional judge. `items.plan_evaluation`
turns it, with the run's GGUFs, into an `EvaluationPlan`: every item written
out with its scorer, both GGUFs' SHA-256, the seed and the settings; it is the
`spec` of an evaluation's record, and all an evaluation needs to be repeated.

Every problem is one line naming what to fix, raised before anything runs.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from overbrainer_prefect.evaluation.scorers import ScorerKind, regex_problem
from overbrainer_prefect.evaluation.template import DEFAULT_TEMPLATE, template_problem
from overbrainer_prefect.trainers.export import DEFAULT_QUANT
from overbrainer_prefect.trainers.gguf_job import MAX_TOKENS_LIMIT, GgufAsk

Group = Literal["heldout", "control"]
"""`heldout`: what the fine-tune should have learned (held-out rows, eval-file
items); `control`: what it must not have broken."""

DEFAULT_MAX_TOKENS = 64  # an answer to a checkable question is a sentence or two


class BadEvaluationInput(ValueError):
    """An evaluation's input cannot be used; nothing was started. The message is one line."""


class Message(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str


class EvalItem(BaseModel):
    """A prompt and what its answer must satisfy. `prompt` is shorthand for a
    conversation of one user message."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str | None = Field(default=None, description="A name in tables; set by the plan.")
    group: Group = Field(default="heldout", description="`heldout` or `control`.")
    messages: list[Message] = Field(
        min_length=1, description="The conversation asked; the last message is the user's."
    )
    expected: str = Field(
        min_length=1,
        description="The expected answer (exact, contains), a pattern (regex) or a number "
        "(numeric).",
    )
    scorer: ScorerKind = Field(
        default="contains",
        description="`exact`, `contains`, `regex` or `numeric` (see evaluation/scorers.py).",
    )
    tolerance: float = Field(default=0.0, ge=0, description="Numeric: the absolute tolerance.")
    reference: str | None = Field(
        default=None,
        description="A full answer, for the held-out perplexity and the judge; by default "
        "the expected answer of an exact or contains item.",
    )
    source: str | None = Field(
        default=None, description="Where the item came from, as `file:line`; set when read."
    )

    @model_validator(mode="before")
    @classmethod
    def _prompt_is_one_message(cls, data: object) -> object:
        if isinstance(data, dict) and "prompt" in data:
            data = dict(data)
            prompt = data.pop("prompt")
            if "messages" in data:
                raise ValueError("give either prompt or messages, not both")
            data["messages"] = [{"role": "user", "content": prompt}]
        return data

    @model_validator(mode="after")
    def _checkable(self) -> EvalItem:
        if self.messages[-1].role != "user" or not self.messages[-1].content.strip():
            raise ValueError("the last message must be the user's, and not empty")
        if not self.expected.strip():
            raise ValueError("the expected answer is empty: write it out")
        if self.scorer == "regex":
            problem = regex_problem(self.expected)
            if problem is not None:
                raise ValueError(f"the regex does not compile ({problem}): fix the pattern")
        if self.scorer == "numeric":
            try:
                value = float(self.expected)
            except ValueError:
                raise ValueError(
                    "a numeric item's expected answer is not a number: write it like 4 or 3.14"
                ) from None
            if not math.isfinite(value):
                raise ValueError("a numeric item's expected answer is not a finite number")
        elif self.tolerance:
            raise ValueError(f"tolerance is for numeric items, and this one is {self.scorer}")
        return self

    @property
    def prompt(self) -> str:
        """The last user message: what tables show."""
        return self.messages[-1].content

    @property
    def reference_text(self) -> str | None:
        """The full answer the perplexity is measured on and the judge is shown."""
        if self.reference is not None:
            return self.reference
        return self.expected if self.scorer in ("exact", "contains") else None


class JudgeSpec(BaseModel):
    """A pairwise LLM judge: an OpenAI-compatible chat endpoint (an Ollama server's
    `http://host:11434/v1`) with a model name, or a GGUF on this machine that the
    evaluation job runs on the target."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str | None = Field(
        default=None,
        description="An OpenAI-compatible base URL, like http://127.0.0.1:11434/v1 (Ollama).",
    )
    model: str | None = Field(default=None, description="The model at the endpoint.")
    gguf: str | None = Field(
        default=None, description="A judge GGUF on this machine, run by the job on the target."
    )
    api_key_env: str | None = Field(
        default=None,
        description="The environment variable holding the endpoint's key (never the key).",
    )
    template: str = Field(
        default=DEFAULT_TEMPLATE,
        description="The judge's prompt: {question}, {expected}, {answer_a}, {answer_b}.",
    )
    max_tokens: int = Field(default=8, ge=1, le=256, description="Tokens of the judge's reply.")
    timeout_s: float = Field(default=120.0, gt=0, description="Seconds a judge call may take.")

    @model_validator(mode="after")
    def _one_judge(self) -> JudgeSpec:
        if (self.endpoint is None) == (self.gguf is None):
            raise ValueError("give the judge either an endpoint (with a model) or a gguf, not both")
        if self.endpoint is not None:
            if not self.endpoint.startswith(("http://", "https://")):
                raise ValueError(
                    f"the judge endpoint {self.endpoint} is not an http(s) URL: give one like "
                    "http://127.0.0.1:11434/v1"
                )
            if not self.model:
                raise ValueError("the judge endpoint needs a model: name it (like llama3.1:8b)")
        problem = template_problem(self.template)
        if problem is not None:
            raise ValueError(problem)
        return self


class EvaluationSpec(BaseModel):
    """An evaluation of a run's GGUF against its base model's (a flow parameter)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    heldout: bool = Field(
        default=True, description="Ask the run's held-out rows (when its training kept some)."
    )
    heldout_scorer: Literal["exact", "contains"] = Field(
        default="contains",
        description="How an answer to a held-out row is checked against the row's answer.",
    )
    eval_file: str | None = Field(
        default=None,
        description="A JSON-lines file of items: {prompt, expected, scorer?, tolerance?} or "
        "{messages} ending with the expected assistant answer.",
    )
    items: list[EvalItem] = Field(default_factory=list, description="Items given as a list.")
    default_controls: bool = Field(
        default=True, description="Ask the controls shipped with the package (general questions)."
    )
    controls_file: str | None = Field(
        default=None, description="A JSON-lines file of your own controls, as eval_file."
    )
    controls: list[EvalItem] = Field(
        default_factory=list, description="Your own controls, given as a list."
    )
    judge: JudgeSpec | None = Field(default=None, description="A pairwise LLM judge, if any.")
    max_tokens: int = Field(
        default=DEFAULT_MAX_TOKENS,
        ge=1,
        le=MAX_TOKENS_LIMIT,
        description="The most tokens an answer may have.",
    )
    seed: int = Field(default=0, description="The sampling seed (generation is greedy).")
    quant: str = Field(default=DEFAULT_QUANT, description="The quant type of both GGUFs.")
    perplexity: bool = Field(
        default=True, description="Measure both models' perplexity on the held-out answers."
    )
    confidence: float = Field(
        default=0.95, gt=0, lt=1, description="The level of the pass rates' intervals."
    )
    alpha: float = Field(
        default=0.05, gt=0, lt=1, description="McNemar's p below which a change is significant."
    )

    @field_validator("eval_file", "controls_file")
    @classmethod
    def _not_blank(cls, path: str | None) -> str | None:
        if path is not None and not path.strip():
            raise ValueError("the file name is empty: give a path or leave it unset")
        return path


class JudgeModel(BaseModel):
    """A judge GGUF an evaluation stages: where it is on this machine, its size and SHA-256."""

    model_config = ConfigDict(extra="forbid")

    path: str
    size: int = Field(ge=0)
    sha256: str


class EvaluationPlan(GgufAsk):
    """Everything an evaluation asks and of which models: enough to repeat it
    exactly. It is the `spec` of an evaluation's record."""

    items: list[EvalItem] = Field(min_length=1)
    judge: JudgeSpec | None = None
    judge_model: JudgeModel | None = Field(
        default=None, description="The judge GGUF, when the judge runs on the target."
    )
    perplexity: bool = True
    confidence: float = 0.95
    alpha: float = 0.05
    heldout_split: str | None = Field(
        default=None, description="The run's held-out split file the held-out rows came from."
    )

    def group(self, name: Group) -> list[EvalItem]:
        """The items of the group `name`, in order."""
        return [item for item in self.items if item.group == name]
