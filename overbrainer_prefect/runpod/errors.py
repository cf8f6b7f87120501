"""What can go wrong talking to Runpod, in words a user can act on.

A `RunpodError` keeps the HTTP status and a short reason of our own, never the
answer's body (Runpod's bodies can quote the request, and the request can hold
a secret). `str(error)` is one line that says what to do next; `run_message`
is the shorter text a run record keeps ("Runpod answered 401").
"""

from __future__ import annotations

from collections.abc import Iterable

from overbrainer_prefect.steps.errors import TargetError

CAPACITY_MARKERS = (
    "no instances currently available",
    "no longer any instances available",
    "does not have the resources",
    "not enough free gpus",
    "out of stock",
    "could not be placed",
)
"""Lower-case fragments of Runpod's capacity refusals, across its API surfaces:
v1 answers 500 "There are no instances currently available", GraphQL 200 and
v2 400 "There are no longer any instances available with the requested
specifications" (research/runpod.md §2.7, §6)."""

REASONS: dict[int, tuple[str, str]] = {
    400: ("request refused", "check the target's settings (GPU type, data center, image, disk)"),
    401: ("unauthorized", "check the API key of the RunpodCredentials block"),
    402: ("insufficient balance", "add credit to the Runpod account"),
    403: ("forbidden", "check that the API key of the RunpodCredentials block may manage pods"),
    404: ("not found", "it may already be gone"),
    409: ("conflict", "the resource is not in a state that allows this"),
    410: ("gone", "this Runpod API was retired: point the RunpodCredentials URLs at REST v2"),
    413: ("request too large", "send fewer or shorter environment variables"),
    422: ("invalid request", "check the target's settings"),
    429: ("rate limited", "wait a minute and try again"),
}
"""Our reason and next step for each status Runpod is known to answer."""


class RunpodError(TargetError):
    """Runpod could not be reached, or answered with an error.

    `status` is the HTTP status (None when no answer came), `reason` a short
    phrase of ours, `hint` the next step. `detail` holds at most 200 characters
    of Runpod's own explanation, cleaned of every secret the client knows, for
    a debug log only: it is never part of `str(error)`.
    """

    def __init__(
        self,
        status: int | None,
        reason: str,
        hint: str = "",
        *,
        detail: str = "",
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.reason = reason
        self.hint = hint
        self.detail = detail
        self.retry_after = retry_after
        super().__init__(self._line())

    def _line(self) -> str:
        head = (
            f"Runpod answered {self.status} ({self.reason})"
            if self.status is not None
            else f"cannot reach Runpod ({self.reason})"
        )
        return f"{head}: {self.hint}" if self.hint else head

    @property
    def kept(self) -> str:
        """What a record keeps of this error: its `run_message`."""
        return self.run_message

    @property
    def run_message(self) -> str:
        """What a run record keeps of this error: only the status ("Runpod
        answered 500"), or that Runpod could not be reached."""
        if self.status is None:
            return "cannot reach Runpod"
        return f"Runpod answered {self.status}"

    @classmethod
    def for_status(
        cls,
        status: int,
        *,
        detail: str = "",
        retry_after: float | None = None,
        hint: str | None = None,
    ) -> RunpodError:
        """The error of an answer with `status`, with our reason and next step."""
        if status >= 500:
            reason, default_hint = "server error", "Runpod is having trouble: try again later"
        else:
            reason, default_hint = REASONS.get(status, ("unexpected answer", ""))
        return cls(
            status,
            reason,
            default_hint if hint is None else hint,
            detail=detail,
            retry_after=retry_after,
        )


class NoCapacity(RunpodError):
    """Runpod has no machine for this GPU type (in the requested cloud and data
    centers) right now: the caller moves on to its next GPU type."""

    def __init__(
        self,
        gpu_type: str,
        status: int | None = 400,
        *,
        detail: str = "",
        hint: str | None = None,
    ) -> None:
        self.gpu_type = gpu_type
        super().__init__(
            status,
            "no capacity",
            hint or f"no {gpu_type} is available right now: try another GPU type, or later",
            detail=detail,
        )


class PodNotGone(RunpodError):
    """A deleted pod's deletion could not be confirmed in time: it may still
    exist, and bill. It is never declared gone on a guess."""

    def __init__(self, pod_id: str, waited_s: float) -> None:
        self.pod_id = pod_id
        super().__init__(
            None,
            "deletion not confirmed",
            f"pod {pod_id} still shows after {waited_s:.0f} s; it may still bill: remove it "
            "with the pods flow, or in the Runpod console",
        )

    def _line(self) -> str:
        return f"cannot confirm that pod {self.pod_id} is deleted: {self.hint}"

    @property
    def run_message(self) -> str:
        """What a run record keeps: that the pod may still exist."""
        return f"pod {self.pod_id} may still exist"


class PodError(TargetError):
    """A step with a run's pod failed. The message is one line saying what
    happened to the run and its pod, and what to do next; it never quotes an
    answer of the API."""


class PodGone(PodError):
    """The run's pod no longer exists (deleted by its watchdog at one of its
    bounds, or by someone else); `kept` is the reason its run fails with."""


def is_capacity_text(text: str) -> bool:
    """Whether Runpod's `text` is its capacity refusal."""
    lowered = text.lower()
    return any(marker in lowered for marker in CAPACITY_MARKERS)


REDACTED = "[redacted]"


def scrub(text: str, secrets: Iterable[str]) -> str:
    """`text` with every occurrence of each of `secrets` (of 4 characters or
    more) replaced by `[redacted]`."""
    for secret in secrets:
        if len(secret) >= 4:
            text = text.replace(secret, REDACTED)
    return text


def short_detail(text: str, secrets: Iterable[str], limit: int = 200) -> str:
    """Runpod's explanation `text` on one line, scrubbed of `secrets`, at most
    `limit` characters: what a debug log may show."""
    one_line = " ".join(scrub(text, secrets).split())
    return one_line if len(one_line) <= limit else one_line[: limit - 1] + "…"
