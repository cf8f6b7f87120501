"""A stand-in of Ollama's REST API (`docs/api.md`, `server/routes.go`,
`server/create.go`) for the calls a GGUF delivery makes, checking what the
real server checks:

- `HEAD /api/blobs/sha256:<hex>`: 200 when the blob is stored, 404 when not,
  400 for a malformed digest;
- `POST /api/blobs/sha256:<hex>`: the body is hashed and refused (400,
  `digest mismatch`) unless it hashes to the digest; 201 once stored, 200
  when it already was;
- `POST /api/create`: a valid model name, relative file names, well-formed
  digests, no create-time quantize of a GGUF (400 each); then, in the status
  stream, each blob must be stored (`... not found`) and be a GGUF (its
  magic), the parameters known, the template's actions balanced; the model
  is kept (named `name:latest` without a tag) and the stream ends `success`;
  `"stream": false` gets one answer instead;
- `GET /api/tags`, `POST /api/show`: the models kept.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from tests.standins.server import Reply, Seen, StandIn, json_reply

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
NAME_PART = r"[a-zA-Z0-9][a-zA-Z0-9._-]{0,79}"
MODEL_NAME = re.compile(rf"^(?:{NAME_PART}/){{0,2}}{NAME_PART}(?::{NAME_PART})?$")
PARAMETERS = {
    "stop": list,
    "temperature": float,
    "num_ctx": int,
    "num_predict": int,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "seed": int,
    "repeat_penalty": float,
    "repeat_last_n": int,
}
"""Parameters a model may set, with their types (a subset of `api/types.go` Options)."""


@dataclass
class Model:
    """A model the stand-in created."""

    name: str
    files: dict[str, str]
    template: str | None
    system: str | None
    parameters: dict[str, Any]
    digest: str = ""
    size: int = 0


class OllamaStandIn(StandIn):
    """The stand-in server; `blobs` (by digest) and `models` (by full name) are its store."""

    def __init__(self) -> None:
        super().__init__()
        self.blobs: dict[str, bytes] = {}
        self.models: dict[str, Model] = {}

    def count(self, method: str, prefix: str) -> int:
        """How many `method` requests to a path starting with `prefix` it saw."""
        with self.lock:
            return sum(1 for s in self.seen if s.method == method and s.path.startswith(prefix))

    def handle(self, request: Seen) -> Reply:
        path = request.path
        if path.startswith("/api/blobs/"):
            return self._blob(request, path.removeprefix("/api/blobs/"))
        if path == "/api/create" and request.method == "POST":
            return self._create(request)
        if path == "/api/tags" and request.method == "GET":
            return self._tags()
        if path == "/api/show" and request.method == "POST":
            return self._show(request)
        return json_reply(404, {"error": "404 page not found"})

    def _blob(self, request: Seen, digest: str) -> Reply:
        if not DIGEST.match(digest):
            return json_reply(400, {"error": "invalid digest format"})
        if request.method == "HEAD":
            with self.lock:
                return Reply(200 if digest in self.blobs else 404)
        if request.method != "POST":
            return json_reply(405, {"error": "method not allowed"})
        with self.lock:
            if digest in self.blobs:
                return Reply(200)
        got = "sha256:" + hashlib.sha256(request.body).hexdigest()
        if got != digest:
            return json_reply(400, {"error": f'digest mismatch, expected "{digest}", got "{got}"'})
        with self.lock:
            self.blobs[digest] = request.body
        return Reply(201)

    def _create(self, request: Seen) -> Reply:
        try:
            body = json.loads(request.body)
        except ValueError:
            return json_reply(400, {"error": "invalid character in request body"})
        if not isinstance(body, dict):
            return json_reply(400, {"error": "json: cannot unmarshal into CreateRequest"})
        name = body.get("model") or body.get("name") or ""
        files = body.get("files")
        if not isinstance(name, str) or not MODEL_NAME.match(name):
            return json_reply(400, {"error": "invalid model name"})
        if not files and not body.get("from"):
            return json_reply(400, {"error": "neither 'from' or 'files' was specified"})
        if not isinstance(files, dict):
            return json_reply(400, {"error": "json: cannot unmarshal files"})
        for path, digest in files.items():
            if (
                path in (".", "")
                or path.startswith("/")
                or ".." in path.split("/")
                or (":" in path or "\\" in path)
            ):
                return json_reply(400, {"error": f"file path must be relative: {path}"})
            if not isinstance(digest, str) or not DIGEST.match(digest):
                return json_reply(400, {"error": f"invalid digest for {path}"})
        if body.get("quantize") or body.get("quantization"):
            return json_reply(
                400,
                {"error": "create-time quantization is only supported for safetensors imports"},
            )
        events, error = self._build(name, files, body)
        if body.get("stream") is False:
            if error is not None:
                return json_reply(int(error.get("status", 500)), {"error": error["error"]})
            return json_reply(200, {"status": "success"})
        lines = [*events, error] if error is not None else [*events, {"status": "success"}]
        return Reply(
            200,
            headers={"Content-Type": "application/x-ndjson"},
            chunks=[json.dumps(line).encode() + b"\n" for line in lines],
        )

    def _build(
        self, name: str, files: dict[str, str], body: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        events: list[dict[str, Any]] = [{"status": "parsing GGUF"}]
        size = 0
        for path, digest in sorted(files.items()):
            with self.lock:
                blob = self.blobs.get(digest)
            if blob is None:
                return events, {"error": f"blob not found for {path} (digest {digest})"}
            if blob[:4] != b"GGUF":
                return events, {"error": f"{path}: invalid file magic", "status": 400}
            size += len(blob)
            events.append({"status": f"using existing layer {digest}"})
        parameters = body.get("parameters") or {}
        if not isinstance(parameters, dict):
            return events, {"error": "parameters must be an object", "status": 400}
        for key, value in parameters.items():
            kind = PARAMETERS.get(key)
            if kind is None:
                return events, {"error": f"unknown parameter '{key}'", "status": 400}
            ok = (
                isinstance(value, list) and all(isinstance(v, str) for v in value)
                if kind is list
                else isinstance(value, int | float) and not isinstance(value, bool)
            )
            if not ok:
                return events, {"error": f"invalid value for parameter '{key}'", "status": 400}
        template = body.get("template")
        if template is not None:
            problem = _template_problem(template)
            if problem:
                return events, {"error": f"template: {problem}", "status": 400}
            events.append({"status": "creating new layer (template)"})
        system = body.get("system")
        if system is not None:
            events.append({"status": "creating new layer (system)"})
        if parameters:
            events.append({"status": "creating new layer (params)"})
        events.append({"status": "writing manifest"})
        full = name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"
        manifest = json.dumps([files, template, system, parameters], sort_keys=True).encode()
        model = Model(
            name=full,
            files=dict(files),
            template=template,
            system=system,
            parameters=dict(parameters),
            digest=hashlib.sha256(manifest).hexdigest(),
            size=size,
        )
        with self.lock:
            self.models[full] = model
        return events, None

    def _tags(self) -> Reply:
        with self.lock:
            models = [
                {
                    "name": m.name,
                    "model": m.name,
                    "modified_at": "2026-01-01T00:00:00Z",
                    "size": m.size,
                    "digest": m.digest,
                    "details": {"format": "gguf"},
                }
                for m in self.models.values()
            ]
        return json_reply(200, {"models": models})

    def _show(self, request: Seen) -> Reply:
        try:
            body = json.loads(request.body)
        except ValueError:
            return json_reply(400, {"error": "invalid request body"})
        name = str(body.get("model") or body.get("name") or "")
        full = name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"
        with self.lock:
            model = self.models.get(full)
        if model is None:
            return json_reply(404, {"error": f"model '{name}' not found"})
        return json_reply(
            200,
            {
                "template": model.template or "{{ .Prompt }}",
                "system": model.system or "",
                "parameters": "\n".join(
                    f"{k} {json.dumps(x)}"
                    for k, v in model.parameters.items()
                    for x in (v if isinstance(v, list) else [v])
                ),
                "details": {"format": "gguf"},
            },
        )


def _template_problem(template: str) -> str | None:
    """What a Go template parser would refuse: unbalanced delimiters, or blocks
    (`range`, `if`, `with`) without their `end`."""
    if template.count("{{") != template.count("}}"):
        return "unbalanced delimiters"
    actions = re.findall(r"\{\{-?\s*(\w+)", template)
    opened = sum(1 for a in actions if a in ("range", "if", "with", "block", "define"))
    closed = sum(1 for a in actions if a == "end")
    if opened != closed:
        return f"{opened} blocks but {closed} ends"
    return None
