"""Committing a run's files to a Hugging Face Hub repository with
huggingface_hub's own client: the token is checked (`whoami`), the repository
created (private by default; one that exists is kept as it is), then every
file and the model card go in one commit.

The token reaches the Hub in the `Authorization` header only. Errors are
reported by their HTTP status and what it means, never with the client's
message (which quotes URLs and server text), and any text that would carry
the token has it masked.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from huggingface_hub import CommitOperationAdd, HfApi, constants
from huggingface_hub.errors import HfHubHTTPError
from pydantic import SecretStr

from overbrainer_prefect import __version__
from overbrainer_prefect.delivery import DeliveryError, public_url
from overbrainer_prefect.delivery.sources import LocalFile

CARD_FILE = "README.md"
REPO_NAME = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}$")
"""A Hub repository (or user) name: letters, digits, `-`, `_`, `.`."""


class HubError(DeliveryError):
    """The Hub refused a step or could not be reached."""


@dataclass(frozen=True)
class HubFile:
    """A file to commit: its path in the repository and the verified local file."""

    path_in_repo: str
    file: LocalFile


@dataclass(frozen=True)
class Committed:
    """What one delivery to the Hub made."""

    repo_id: str
    url: str
    """The repository's page."""
    commit: str
    private: bool | None
    """Whether the repository is private, as the Hub reports it."""
    files: list[HubFile]


def check_repo_id(repo: str) -> str:
    """`repo` (`org/name`, or a bare `name` for the token's own namespace) once
    checked. Raises HubError with one line when it cannot name a repository."""
    parts = repo.strip().split("/")
    if len(parts) > 2 or not all(REPO_NAME.match(p) for p in parts) or repo.endswith(".git"):
        raise HubError(
            f"{repo!r} is not a Hub repository id: give org/name (letters, digits, - _ .)"
        )
    return repo.strip()


def commit_to_hub(
    repo: str,
    files: Sequence[HubFile],
    card: str,
    *,
    token: SecretStr,
    endpoint: str | None = None,
    private: bool = True,
    message: str,
) -> Committed:
    """Creates the model repository `repo` if needed (`private` when it does
    not exist yet) and commits `files` and the model card `card` (as
    `README.md`) in one commit with `message`. A bare name goes under the
    token's own namespace. Blocking: call it from a thread in async code.

    Raises HubError with one line (never quoting the token) when the Hub is
    offline by configuration, cannot be reached, refuses the token, or refuses
    a step.
    """
    repo = check_repo_id(repo)
    if constants.is_offline_mode():
        raise HubError(
            "HF_HUB_OFFLINE is set, so nothing can be sent to the Hub: unset it in the "
            "environment of the worker that delivers"
        )
    secret = token.get_secret_value()
    api = HfApi(
        endpoint=endpoint,
        token=secret,
        library_name="overbrainer-prefect",
        library_version=__version__,
    )
    step = "check the token"
    try:
        who = api.whoami()
        if "/" not in repo:
            repo = f"{who['name']}/{repo}"
        step = f"create the repository {repo}"
        url = str(api.create_repo(repo, private=private, exist_ok=True, repo_type="model"))
        operations = [
            CommitOperationAdd(path_in_repo=f.path_in_repo, path_or_fileobj=str(f.file.path))
            for f in files
        ]
        operations.append(CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=card.encode()))
        step = f"commit to {repo}"
        info = api.create_commit(repo, operations, commit_message=message, repo_type="model")
    except HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        raise HubError(_masked(_refused(step, status, repo), secret)) from None
    except HubError:
        raise
    except Exception as error:
        raise HubError(_masked(_failed(step, error, public_url(api.endpoint)), secret)) from None
    try:
        private_now = api.model_info(repo).private
    except Exception:  # only informative: the commit is made
        private_now = None
    return Committed(repo_id=repo, url=url, commit=info.oid, private=private_now, files=list(files))


def _refused(step: str, status: int | None, repo: str) -> str:
    if status == 401:
        why = "the token was refused: check the Hugging Face credentials block holds a valid token"
    elif status == 403:
        why = f"the token may not write to {repo}: give it write access to that namespace"
    elif status == 404:
        why = f"{repo} was not found: check the repository id and the token's access"
    elif status == 409:
        why = "the repository changed meanwhile: deliver again"
    elif status == 429:
        why = "too many requests: deliver again later"
    elif status is not None and status >= 500:
        why = "the Hub failed: deliver again later"
    else:
        why = "check the repository id and what is committed"
    return f"the Hub refused to {step} ({status}): {why}"


def _failed(step: str, error: Exception, endpoint: str) -> str:
    name = type(error).__name__
    if "Connect" in name or "Timeout" in name or "Network" in name or "Protocol" in name:
        return f"cannot reach the Hub at {endpoint} to {step} ({name}): check the endpoint"
    if isinstance(error, OSError):
        return f"cannot read a file to {step} ({error.strerror or name})"
    return f"cannot {step} ({name})"


def _masked(text: str, secret: str) -> str:
    return text.replace(secret, "***") if secret else text
