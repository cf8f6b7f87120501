"""Pushing a GGUF to an Ollama server through its REST API.

The file goes up once, as a blob named by its SHA-256 (`HEAD
/api/blobs/sha256:<hex>` says whether the server has it; `POST` sends it and
the server checks the digest), then `POST /api/create` makes a model of it
with its chat template, stop words and default system prompt. The create call
answers a stream of `{"status": ...}` lines ending in `success`, or an
`{"error": ...}` line.

The create goes through the official client (`ollama.AsyncClient.create`): its
request shape is the one that moves between Ollama versions. The blob stays
ours, over httpx, although the official `create_blob` streams too. Measured
pushing a 1,000 MiB GGUF (the stand-in server of tests/standins on 127.0.0.1
in its own process, 2 shared cores; `bench/ollama_blob.py` repeats it), each
client in a fresh process: the official `create_blob` then `create` peaked at
50 MiB RSS (44 after its imports); ours at 51 MiB in 256 KiB pieces (46
after its imports)
(56 MiB in 1 MiB pieces: a few pieces are alive at once, the one read and
its copies on the way to the socket, and the allocator keeps what they
left; 50 MiB in 128 KiB pieces, 1 s slower of 7 under load): neither holds
the file, so memory is no reason; but `create_blob`

- has no existence check and sends the whole file every time: 30 to 33 s to send
  the same 1,000 MiB again where ours takes 0.07 to 0.4 s and sends nothing
  (a nightly that delivers an unchanged GGUF, or a second destination);
- hashes the file itself before sending it, a second full read of a GGUF whose
  SHA-256 the retrieval already verified, and names the blob by whatever is on
  disk now, where ours names it by the verified SHA-256 so that the server
  refuses a file changed since;
- reads in 32 KiB pieces, one thread hop each: 15 to 25 s for the 1,000 MiB
  against 4 to 6 s for ours;
- has no timeout by default and turns only a refused connection into an error
  of its own (a timeout comes out as httpx's).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import ollama

from overbrainer_prefect.delivery import DeliveryError, public_url

DEFAULT_URL = "http://127.0.0.1:11434"
"""Where `ollama serve` listens by default."""

CHUNK = 256 << 10  # bytes read from the GGUF per piece of a blob upload (see above)
TIMEOUT = httpx.Timeout(connect=10.0, read=600.0, write=600.0, pool=10.0)
"""A blob of gigabytes takes minutes to write and the server hashes it before
answering; a create parses the whole GGUF before its first status line."""

MAX_ERROR_TEXT = 200  # characters of a server's error message kept in ours

CHATML_TEMPLATE = (
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n"
    "{{ .Content }}<|im_end|>\n"
    "{{ end }}<|im_start|>assistant\n"
)
"""ChatML as an Ollama Go template: each message `<|im_start|>role\\ncontent<|im_end|>\\n`,
then the assistant's turn opened, as the Jinja templates of SmolLM2 and Qwen render it."""

CHATML_STOP = ("<|im_end|>",)
"""Where a ChatML answer ends."""

_CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")
_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system\n(.+?)<\|im_end\|>", re.DOTALL)
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


class OllamaError(DeliveryError):
    """The Ollama server could not be reached, or refused a step."""


class OllamaUnreachable(OllamaError):
    """Nothing answered at the server's URL (refused, timed out, cut off)."""


class OllamaRejected(OllamaError):
    """The server answered with an error (a digest it refused, a model it could
    not create); `status` is the HTTP status, or 200 for an error in the stream."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ModelSettings:
    """How Ollama renders prompts for a model: its Go template (None lets the
    server pick one from the GGUF), its default system prompt and its
    parameters (`stop`, `temperature`...)."""

    template: str | None = None
    system: str | None = None
    parameters: Mapping[str, object] = field(default_factory=dict)

    @property
    def described(self) -> str:
        """A few words for logs: `ChatML template, stop <|im_end|>`."""
        if self.template == CHATML_TEMPLATE:
            kind = "ChatML template"
        elif self.template is None:
            kind = "the server's template for the GGUF"
        else:
            kind = "a custom template"
        stop = self.parameters.get("stop")
        if isinstance(stop, list | tuple) and stop:
            return f"{kind}, stop {' '.join(str(s) for s in stop)}"
        return kind


def chat_settings(chat_template: str | None, training_template: str | None = None) -> ModelSettings:
    """The Ollama settings that render prompts as the model was trained on.

    A ChatML Jinja template (the GGUF's `tokenizer.chat_template`, or a run
    trained with `chat_template: chatml`) becomes `CHATML_TEMPLATE` with the
    stop word `<|im_end|>`, and the system prompt the Jinja template adds when a
    conversation has none (SmolLM2's) becomes the model's default system
    prompt. Anything else is left to the server, which matches the GGUF's
    template to one it knows. Never fails.
    """
    is_chatml = chat_template is not None and all(m in chat_template for m in _CHATML_MARKERS)
    if not is_chatml and training_template != "chatml":
        return ModelSettings()
    system = None
    if chat_template is not None:
        found = _DEFAULT_SYSTEM.search(chat_template)
        if found and "{{" not in found.group(1) and "{%" not in found.group(1):
            system = found.group(1)
    return ModelSettings(
        template=CHATML_TEMPLATE, system=system, parameters={"stop": list(CHATML_STOP)}
    )


@dataclass(frozen=True)
class Pushed:
    """A model created on an Ollama server from a GGUF blob."""

    model: str
    digest: str
    """`sha256:<hex>` of the GGUF."""
    file_name: str
    uploaded: bool
    """Whether the blob was sent (False: the server already had it)."""
    statuses: list[str]


class OllamaClient:
    """An Ollama server's blob API (over httpx) and create API (through the
    official client). Use it as an async context manager; `transport` replaces
    the network (tests)."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        timeout: httpx.Timeout = TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.public = public_url(url)
        self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout, transport=transport)
        parts = urlsplit(self.url)  # the official client drops a user and password from its host
        auth = (unquote(parts.username), unquote(parts.password or "")) if parts.username else None
        self._ollama = ollama.AsyncClient(
            host=self.url, timeout=timeout, transport=transport, auth=auth
        )

    async def __aenter__(self) -> OllamaClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the connections. Never fails."""
        await self._client.aclose()
        await self._ollama.close()  # type: ignore[no-untyped-call]  # untyped in ollama 0.6

    async def has_blob(self, sha256: str) -> bool:
        """Whether the server holds the blob `sha256` (lowercase hex).

        Raises OllamaUnreachable when the server cannot be reached, OllamaRejected
        when it answers neither 200 nor 404.
        """
        response = await self._send("check a blob", "HEAD", _blob_path(sha256))
        if response.status_code == 404:
            return False
        if response.status_code != 200:
            raise self._rejected("check a blob", response.status_code, None)
        return True

    async def push_blob(self, path: Path, sha256: str) -> None:
        """Sends the file `path` as the blob `sha256`, streamed in `CHUNK` pieces;
        the server hashes what it receives and refuses it when it differs.

        Raises OllamaUnreachable or OllamaRejected; OSError when the file cannot be read.
        """
        size = path.stat().st_size
        response = await self._send(
            "store the GGUF",
            "POST",
            _blob_path(sha256),
            content=_file_chunks(path),
            headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
        )
        if response.status_code not in (200, 201):
            raise self._rejected("store the GGUF", response.status_code, _error_of(response))

    async def create(
        self, model: str, files: Mapping[str, str], settings: ModelSettings
    ) -> list[str]:
        """Creates (or replaces) the model `model` from blobs (`files` maps a file
        name to `sha256:<hex>`) with `settings`; returns the status lines the
        server streamed.

        Raises OllamaUnreachable, or OllamaRejected when the server refuses the
        request or streams an error.
        """
        step = f"create the model {model}"
        statuses: list[str] = []
        try:
            progress = await self._ollama.create(
                model=model,
                files=dict(files),
                template=settings.template,
                system=settings.system,
                parameters=dict(settings.parameters) or None,
                stream=True,
            )
            async for event in progress:
                if event.status is not None:
                    statuses.append(event.status)
        except ollama.ResponseError as error:
            status = error.status_code if error.status_code > 0 else 200  # -1: in the stream
            raise self._rejected(step, status, str(error.error) or None) from None
        except ValueError:  # a line that is not JSON
            raise self._rejected(step, 200, "an unreadable answer") from None
        except (httpx.TransportError, ConnectionError) as error:
            raise self._unreachable(error) from None
        if not statuses or statuses[-1] != "success":
            raise self._rejected(step, 200, "its answer ended before success")
        return statuses

    async def push_gguf(
        self, path: Path, sha256: str, model: str, settings: ModelSettings
    ) -> Pushed:
        """Makes the model `model` of the GGUF `path` whose SHA-256 is `sha256`:
        sends its blob unless the server already has it, then creates the model
        with `settings`, the GGUF named by its file name.

        Raises OllamaUnreachable or OllamaRejected; OSError when the file cannot be read.
        """
        if not _DIGEST.match(sha256):
            raise ValueError(f"{sha256!r} is not a SHA-256 in lowercase hex")
        uploaded = False
        if not await self.has_blob(sha256):
            await self.push_blob(path, sha256)
            uploaded = True
        digest = f"sha256:{sha256}"
        statuses = await self.create(model, {path.name: digest}, settings)
        return Pushed(
            model=model, digest=digest, file_name=path.name, uploaded=uploaded, statuses=statuses
        )

    async def _send(
        self,
        step: str,
        method: str,
        path: str,
        content: AsyncIterator[bytes] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        try:
            return await self._client.request(method, path, content=content, headers=headers)
        except httpx.TransportError as error:
            raise self._unreachable(error) from None

    def _unreachable(self, error: httpx.TransportError | ConnectionError) -> OllamaUnreachable:
        if isinstance(error, httpx.ConnectError | ConnectionError):
            why = "nothing answers there"
        elif isinstance(error, httpx.TimeoutException):
            why = "it did not answer in time"
        else:
            why = "the connection was lost"
        return OllamaUnreachable(f"cannot reach the Ollama server at {self.public} ({why})")

    def _rejected(self, step: str, status: int, error: str | None) -> OllamaRejected:
        detail = f"{status}: {_one_line(error)}" if error else str(status)
        return OllamaRejected(
            f"the Ollama server at {self.public} refused to {step} ({detail})", status
        )


def _blob_path(sha256: str) -> str:
    return f"/api/blobs/sha256:{sha256}"


async def _file_chunks(path: Path) -> AsyncIterator[bytes]:
    with open(path, "rb") as file:
        while chunk := await asyncio.to_thread(file.read, CHUNK):
            yield chunk


def _json_object(text: str) -> dict[str, object] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _error_of(response: httpx.Response) -> str | None:
    """The `error` field of an Ollama error answer (its API's message), if any."""
    event = _json_object(response.text) if response.content else None
    error = event.get("error") if event else None
    return str(error) if error is not None else None


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_ERROR_TEXT else f"{line[: MAX_ERROR_TEXT - 3]}..."
