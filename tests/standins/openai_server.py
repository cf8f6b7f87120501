"""A stand-in of an OpenAI-compatible chat server (OpenAI's `/v1` REST API as
Ollama serves it, `docs/openai.md`), for the calls an evaluation's judge makes,
checking what such a server checks:

- `GET /v1/models`: the models it serves, `{"object": "list", "data": [{"id": ...}]}`;
- `POST /v1/chat/completions`: a JSON body with a served `model` (a name
  without a tag is its `:latest`; 404 `model not found` otherwise) and a
  non-empty `messages` list of `{role, content}` (400 otherwise); the answer
  is a `chat.completion` whose one choice's message is what `choose` says of
  the prompt's two answers.

The judge it plays reads the default judge prompt (`Question:`, `Answer A:`,
`Answer B:`) and answers with `choose(answer_a, answer_b)`: `A`, `B` or `tie`.
Every prompt is kept (`asked`), so a test can check that both orders of each
pair were asked; a bearer key, when `key` is set, is required (401).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from tests.standins.server import Reply, Seen, StandIn, json_reply

PROMPT = re.compile(
    r"Question: (?P<question>.*?)\n.*?Answer A: (?P<a>.*?)\n\nAnswer B: (?P<b>.*?)\n\nWhich",
    re.DOTALL,
)


@dataclass(frozen=True)
class Asked:
    """One judge prompt, as the stand-in read it."""

    question: str
    answer_a: str
    answer_b: str
    seed: int | None
    temperature: float | None


def prefers(word: str) -> Callable[[str, str], str]:
    """A judge that picks the answer holding `word` (a tie when both or neither do)."""

    def choose(a: str, b: str) -> str:
        if (word in a) == (word in b):
            return "tie"
        return "A" if word in a else "B"

    return choose


def first_always(a: str, b: str) -> str:
    """A judge with a pure position bias: always the first answer."""
    return "A"


class OpenAIStandIn(StandIn):
    """The stand-in server, serving `models` and judging with `choose`."""

    def __init__(
        self,
        models: tuple[str, ...] = ("judge:latest",),
        choose: Callable[[str, str], str] = first_always,
        key: str | None = None,
    ) -> None:
        super().__init__()
        self.models = models
        self.choose = choose
        self.key = key
        self.asked: list[Asked] = []
        self.prompts: list[str] = []

    def handle(self, request: Seen) -> Reply:
        if self.key is not None and request.headers.get("authorization") != f"Bearer {self.key}":
            return json_reply(401, {"error": {"message": "invalid api key"}})
        if request.path == "/v1/models" and request.method == "GET":
            data = [{"id": m, "object": "model", "owned_by": "library"} for m in self.models]
            return json_reply(200, {"object": "list", "data": data})
        if request.path == "/v1/chat/completions" and request.method == "POST":
            return self._chat(request)
        return json_reply(404, {"error": {"message": "404 page not found"}})

    def _chat(self, request: Seen) -> Reply:
        try:
            body = json.loads(request.body)
        except ValueError:
            return json_reply(400, {"error": {"message": "invalid request body"}})
        if not isinstance(body, dict) or not self.serves(body.get("model")):
            return json_reply(404, {"error": {"message": "model not found"}})
        messages = body.get("messages")
        if not (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages)
        ):
            return json_reply(400, {"error": {"message": "invalid messages"}})
        prompt = str(messages[-1]["content"])
        with self.lock:
            self.prompts.append(prompt)
        found = PROMPT.search(prompt)
        reply = "I cannot tell."
        if found is not None:
            asked = Asked(
                found["question"], found["a"], found["b"], body.get("seed"), body.get("temperature")
            )
            with self.lock:
                self.asked.append(asked)
            reply = self.choose(asked.answer_a, asked.answer_b)
        return json_reply(
            200,
            {
                "id": f"chatcmpl-{len(self.prompts)}",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": reply},
                        "finish_reason": "stop",
                    }
                ],
            },
        )

    def serves(self, name: object) -> bool:
        """Whether `name` is a model served, a name without a tag meaning `:latest`
        (as Ollama resolves it)."""
        if not isinstance(name, str):
            return False
        return name in self.models or (":" not in name and f"{name}:latest" in self.models)

    def both_orders_asked(self) -> bool:
        """Whether every pair asked was also asked the other way round."""
        with self.lock:
            seen = {(a.question, a.answer_a, a.answer_b) for a in self.asked}
        return bool(seen) and all((q, b, a) in seen for q, a, b in seen)
