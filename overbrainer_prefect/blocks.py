"""Prefect blocks: where runs run (targets) and the credentials they use.

A target block names a machine and how jobs run there; it builds the executor
the run flows drive; `target_named` finds the target block a flow names. Training
settings are not here: they are flow parameters.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from prefect.blocks.core import Block
from pydantic import BaseModel, Field, HttpUrl, SecretStr, ValidationError
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode

from overbrainer_prefect import executors  # its SshExecutor (asyncssh) imported on first use
from overbrainer_prefect.envfile import read_env_file
from overbrainer_prefect.executors.base import Executor
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.runpod.client import RunpodClient
from overbrainer_prefect.runpod.settings import (
    MAX_RESTARTS,
    RunpodSettingsFields,
    RunpodTargetSettings,
    SettingsError,
    one_line,
    settings_from,
)
from overbrainer_prefect.targets.base import Logger, Target
from overbrainer_prefect.targets.host import Bounds, HostTarget
from overbrainer_prefect.targets.pod import PodTarget
from overbrainer_prefect.targets.pool import PoolHost, PoolTarget, pool_problem

DOCS_URL = "https://github.com/overbrainer/overbrainer-prefect#readme"
LOGO_FILE = "overbrainer_prefect/logo.png"
"""The blocks' logo in this repository: a square 128 px PNG (Prefect's block
standards want a square image 45 to 1000 px wide)."""
LOGO_URL = f"https://raw.githubusercontent.com/overbrainer/overbrainer-prefect/main/{LOGO_FILE}"


class Branded:
    """The logo and documentation link every block of this package shows in the
    Prefect UI. A mixin, not a block: it registers no block type. Each block's
    slug is its `_block_type_name` slugified, and its code example (import and
    `.load("BLOCK_NAME")`) is the one Prefect generates."""

    _logo_url: ClassVar[HttpUrl | None] = HttpUrl(LOGO_URL)
    _documentation_url: ClassVar[HttpUrl | None] = HttpUrl(DOCS_URL)

    @classmethod
    def model_json_schema(
        cls,
        by_alias: bool | None = True,
        ref_template: str = "#/definitions/{model}",
        schema_generator: type[GenerateJsonSchema] = GenerateJsonSchema,
        mode: JsonSchemaMode = "validation",
        *,
        union_format: Literal["any_of", "primitive_type_array"] = "any_of",
    ) -> dict[str, Any]:
        """Prefect's JSON schema of the block (`Block.model_json_schema`), made
        once per class and arguments; a copy each call. Prefect asks for it
        once for each field when it saves or dumps a block (whether the field
        holds a secret): a `RunpodTarget.save` made it about 150 times, more than
        a second of a core. TypeError for a `union_format` other than pydantic's
        default, which Prefect's blocks do not take either."""
        if union_format != "any_of":
            raise TypeError(f"a block's JSON schema has no union_format {union_format!r}")
        key = (cls, by_alias is not False, ref_template, schema_generator, mode)
        schema = _BLOCK_SCHEMAS.get(key)
        if schema is None:
            schema = super().model_json_schema(  # type: ignore[misc]
                key[1], ref_template, schema_generator, mode
            )
            _BLOCK_SCHEMAS[key] = schema
        return copy.deepcopy(schema)


_BLOCK_SCHEMAS: dict[tuple[type, bool, str, type, str], dict[str, Any]] = {}
"""`Branded.model_json_schema`'s: Prefect's schema of a block class of this
package (the next class after `Branded` in its MRO), by class and arguments."""


class HuggingFaceCredentials(Branded, Block):
    """A Hugging Face token: it reaches jobs as `HF_TOKEN` through their
    environment only, and the Hub client when a model is pushed.
    """

    _block_type_name = "Overbrainer Hugging Face Credentials"

    token: SecretStr = Field(description="A Hugging Face access token (read, or write to push).")
    endpoint: str | None = Field(
        default=None,
        description="The Hub's URL when it is not huggingface.co (a mirror or a gateway).",
    )


class TargetBlock(Branded, Block, ABC):
    """What every target has: the job environment, the bounds of a job, and
    the `Target` (in the core) the flows drive. Not a block type of its own:
    save a `LocalTarget`, an `SshTarget` or a `RunpodTarget`."""

    kind: ClassVar[str] = "target"

    job_venv: str = Field(
        description="The virtual environment on the target that runs jobs (torch, axolotl).",
    )
    env_file: str | None = Field(
        default=None,
        description="A KEY=VALUE file on this machine whose values reach the job through its "
        "environment only (never a file on the target).",
    )
    max_hours: float = Field(
        default=24.0,
        gt=0,
        description="How long a job may run before it is cancelled and its run failed.",
    )
    stall_minutes: float = Field(
        default=15.0,
        gt=0,
        description="Minutes without a new metric before a job is reported as stalled.",
    )
    poll_seconds: float = Field(
        default=2.0, gt=0, description="Seconds between two looks at a running job."
    )
    huggingface: HuggingFaceCredentials | None = Field(
        default=None,
        description="Hugging Face credentials whose token the job gets as HF_TOKEN.",
    )
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        description="Threads a job may use on a target without a GPU (OMP_NUM_THREADS); "
        "unset lets torch decide.",
    )

    @property
    def python(self) -> str:
        """The job venv's Python on the target."""
        return f"{self.job_venv.rstrip('/')}/bin/python"

    def secrets(self) -> dict[str, SecretStr]:
        """The values of `env_file` and the Hugging Face token (`HF_TOKEN`), for the
        job's environment. Raises ValueError
        with one line when the file cannot be read or is malformed."""
        secrets = read_env_file(Path(self.env_file).expanduser()) if self.env_file else {}
        if self.huggingface is not None:
            secrets["HF_TOKEN"] = self.huggingface.token
        return secrets

    def bounds(self) -> Bounds:
        """How a job's steps are bounded on this target."""
        return Bounds(
            python=self.python,
            poll_s=self.poll_seconds,
            max_hours=self.max_hours,
            stall_s=self.stall_minutes * 60,
        )

    @abstractmethod
    def target(self, ref: str, log: Logger) -> Target:
        """The `Target` the flows drive, named `ref` in records and messages,
        logging to `log`. Raises SettingsError (one line) for settings that
        cannot be used."""


def host_target(block: LocalTarget | SshTarget, ref: str, log: Logger) -> HostTarget:
    """A machine you own, as the flows drive it: its executor, named `ref`."""
    return HostTarget(
        ref,
        block.kind,
        lambda: block.executor(ref),
        block.bounds(),
        secrets=block.secrets,
        cpu_threads=block.cpu_threads,
        log=log,
    )


class LocalTarget(TargetBlock):
    """This machine: jobs run as detached processes in a venv, in a work
    directory of their own, and their files are copied back and verified like
    any target's.
    """

    _block_type_name = "Overbrainer Local Target"
    kind: ClassVar[str] = "local"

    work_dir: str = Field(
        default="~/.overbrainer/work",
        description="The directory that holds the run directories of the jobs.",
    )

    def executor(self, name: str) -> Executor:
        """A `LocalExecutor` over `work_dir`."""
        return LocalExecutor(Path(self.work_dir).expanduser(), name=name)

    def target(self, ref: str, log: Logger) -> Target:
        """This machine as a `HostTarget`."""
        return host_target(self, ref, log)


class SshTarget(TargetBlock):
    """A machine reached over SSH (a GPU box you own or rent): jobs run there
    detached, outlive the connection, and their files come back over SFTP,
    verified against a SHA-256 manifest computed on the machine.

    The host's public key must be pinned (`host_key`): a host whose key cannot
    be checked is refused before anything is sent.
    """

    _block_type_name = "Overbrainer SSH Target"
    kind: ClassVar[str] = "ssh"

    host: str = Field(description="The machine's host name or address.")
    port: int = Field(default=22, ge=1, le=65535, description="Its SSH port.")
    user: str = Field(default="root", description="The user jobs run as.")
    private_key: SecretStr | None = Field(
        default=None, description="The client's private key (OpenSSH text), or use key_file."
    )
    key_file: str | None = Field(
        default=None, description="A file on this machine holding the client's private key."
    )
    host_key: str | None = Field(
        default=None,
        description="The host's public key as `ssh-keyscan -p PORT HOST` prints it; required "
        "to connect.",
    )
    work_dir: str = Field(
        default="/root/overbrainer",
        description="The absolute directory on the host that holds the run directories.",
    )
    connect_timeout: float = Field(default=15.0, gt=0, description="Seconds to connect.")

    def executor(self, name: str) -> Executor:
        """An `SshExecutor` to this host. Raises ExecError when no host key is
        pinned or the client key cannot be read."""
        return executors.SshExecutor(
            self.host,
            port=self.port,
            user=self.user,
            client_key=self.private_key,
            key_path=self.key_file,
            known_host_key=self.host_key,
            workdir=self.work_dir,
            name=name,
            connect_timeout=self.connect_timeout,
        )

    def target(self, ref: str, log: Logger) -> Target:
        """The SSH box as a `HostTarget`."""
        return host_target(self, ref, log)


class SshPoolHost(BaseModel):
    """One machine of an `SshPool`: how it is reached and where its jobs' run
    directories are."""

    name: str | None = Field(
        default=None,
        description="Its name in messages and run records; `host:port` when unset.",
    )
    host: str = Field(description="The machine's host name or address.")
    port: int = Field(default=22, ge=1, le=65535, description="Its SSH port.")
    user: str = Field(default="root", description="The user jobs run as.")
    private_key: SecretStr | None = Field(
        default=None,
        description="The client's private key for this machine (OpenSSH text); the pool's "
        "when unset.",
    )
    key_file: str | None = Field(
        default=None,
        description="A file on this machine holding the client's private key for it; the "
        "pool's when unset.",
    )
    host_key: str | None = Field(
        default=None,
        description="The machine's public key as `ssh-keyscan -p PORT HOST` prints it; "
        "required to connect.",
    )
    work_dir: str = Field(
        default="/root/overbrainer",
        description="The absolute directory on the machine that holds the run directories "
        "(and its lease: one job of this product at a time).",
    )

    @property
    def label(self) -> str:
        """Its name, or `host:port`."""
        return self.name or f"{self.host}:{self.port}"

    @property
    def address(self) -> str:
        """`user@host:port`."""
        return f"{self.user}@{self.host}:{self.port}"


class SshPool(TargetBlock):
    """Several machines reached over SSH (GPU boxes you own), as one target:
    each run goes to a free one, a machine that answers, has what the job
    needs and holds no job of this product (decided on the machine itself, so
    two workers never put two jobs on one box). A machine that does not
    answer is skipped; when none is free the run waits up to `wait_minutes`.
    Every machine's host key must be pinned; its job venv is at `job_venv`.
    """

    _block_type_name = "Overbrainer SSH Pool"
    kind: ClassVar[str] = "pool"

    hosts: list[SshPoolHost] = Field(
        description="The machines of the pool, tried in this order; each listed once."
    )
    private_key: SecretStr | None = Field(
        default=None,
        description="The client's private key (OpenSSH text) for the machines without one of "
        "their own.",
    )
    key_file: str | None = Field(
        default=None,
        description="A file on this machine holding the client's private key, for the "
        "machines without one of their own.",
    )
    wait_minutes: float = Field(
        default=30.0,
        ge=0,
        description="How long a run waits for a free machine before it fails (0: not at all).",
    )
    max_restarts: int = Field(
        default=2,
        ge=0,
        le=MAX_RESTARTS,
        description="How many times a training across nodes that lost a node (its job gone, "
        "its machine silent) goes on, by itself, from its last complete checkpoint (every "
        "node's part kept; from where it started when none was) on free machines of the pool; "
        f"0: the run fails with the loss; at most {MAX_RESTARTS}.",
    )
    connect_timeout: float = Field(default=15.0, gt=0, description="Seconds to connect.")

    def executor(self, machine: SshPoolHost, name: str) -> Executor:
        """An `SshExecutor` to `machine`, named `name`. Raises ExecError when
        no host key is pinned or the client key cannot be read."""
        own = machine.private_key is not None or machine.key_file is not None
        return executors.SshExecutor(
            machine.host,
            port=machine.port,
            user=machine.user,
            client_key=machine.private_key if own else self.private_key,
            key_path=machine.key_file if own else self.key_file,
            known_host_key=machine.host_key,
            workdir=machine.work_dir,
            name=name,
            connect_timeout=self.connect_timeout,
        )

    def target(self, ref: str, log: Logger) -> Target:
        """The pool as a `PoolTarget`. Raises SettingsError (one line) for a
        pool without machines or with one listed twice."""
        problem = pool_problem(ref, [(m.label, m.address) for m in self.hosts])
        if problem is not None:
            raise SettingsError(problem)
        return PoolTarget(
            ref,
            [
                PoolHost(
                    m.label,
                    m.address,
                    m.work_dir,
                    lambda m=m: self.executor(m, f"{ref}:{m.label}"),  # type: ignore[misc]
                    reach_at=m.host,
                )
                for m in self.hosts
            ],
            self.bounds(),
            wait_s=self.wait_minutes * 60,
            max_restarts=self.max_restarts,
            secrets=self.secrets,
            cpu_threads=self.cpu_threads,
            log=log,
        )


class OllamaServer(Branded, Block):
    """An Ollama server that delivered models are created on: the `deliver`
    flow pushes a run's verified GGUF to it as a blob named by its SHA-256
    and creates the model with its chat template through the REST API.
    """

    _block_type_name = "Overbrainer Ollama Server"

    url: str = Field(
        default="http://127.0.0.1:11434",
        description="The server's base URL (`OLLAMA_HOST`), e.g. http://gpu-box:11434.",
    )
    model_prefix: str | None = Field(
        default=None,
        description="Put before the name of every model created here (a namespace like "
        "`team/`, or `ft-`).",
    )


class RunpodCredentials(Branded, Block):
    """A Runpod API key, and the URLs of the API it is sent to.

    The key goes only in the `Authorization` header of requests to `rest_url`
    and `graphql_url`; it never appears in a log, an error, a file or a pod's
    environment. The URLs are Runpod's by default; point them at a gateway,
    or at the simulator in tests.
    """

    _block_type_name = "Overbrainer Runpod Credentials"

    api_key: SecretStr = Field(
        description="A Runpod API key that may manage pods and secrets (Settings > API Keys)."
    )
    rest_url: str = Field(
        default="https://api.runpod.io/v2",
        description="The Runpod REST API (v2): pods, secrets and the GPU catalog.",
    )
    graphql_url: str = Field(
        default="https://api.runpod.io/graphql",
        description="Runpod's GraphQL API: its GPU catalog, used when REST has none.",
    )

    def client(self) -> RunpodClient:
        """A new API client with this key; close it with `aclose()` or use it
        with `async with`. Raises ValueError when the key is empty."""
        return RunpodClient(self.api_key, rest_url=self.rest_url, graphql_url=self.graphql_url)


class RunpodTarget(RunpodSettingsFields, TargetBlock):
    """A Runpod pod created for each run and deleted once the run's files are
    retrieved and verified. A watchdog on the pod deletes it by itself at
    `max_hours` (unless the flow following a progressing job renews its
    lease), at `max_cost_usd`, `retrieve_grace_s` after its job ended
    unretrieved, and `boot_grace_s` after it started without a job: nothing
    bills past its bound, whatever dies on this side. `keep_pod` turns all of
    that off.

    The settings are `RunpodTargetSettings`' own fields, with their
    constraints; what only Runpod can tell (an unknown GPU type or data
    center, a price limit nothing meets) is checked when a job starts, in one
    line, before any pod is created.
    """

    _block_type_name = "Overbrainer Runpod Target"
    kind: ClassVar[str] = "runpod"

    credentials: RunpodCredentials = Field(description="The Runpod account pods are created in.")

    def settings(self) -> RunpodTargetSettings:
        """The checked settings of this target. Raises SettingsError with one
        line naming the first field in error and what to do."""
        values: dict[str, object] = {
            name: getattr(self, name) for name in RunpodTargetSettings.model_fields
        }
        return settings_from(values)

    def target(self, ref: str, log: Logger) -> Target:
        """A `PodTarget`: a pod of this account made for each job."""
        credentials = self.credentials
        hub = self.huggingface
        return PodTarget(
            ref,
            self.settings(),
            credentials.client,
            api_url=credentials.rest_url,
            bounds=self.bounds(),
            secrets=self.secrets,
            cpu_threads=self.cpu_threads,
            hub_token=hub.token if hub is not None else None,
            hub_endpoint=hub.endpoint if hub is not None else None,
            log=log,
        )


TARGET_TYPES: tuple[type[TargetBlock], ...] = (LocalTarget, SshTarget, RunpodTarget, SshPool)
"""The target block types, in the order a bare name is looked up."""


class UnknownTarget(ValueError):
    """No target block has the name a flow was given."""


class TargetGone(UnknownTarget):
    """No target block of any type has the name (it was never saved, or was
    deleted): nothing can reach what a job of it left."""


class AmbiguousTarget(ValueError):
    """A bare name that blocks of two target types share: the message names both."""


async def load_target(name: str) -> tuple[str, TargetBlock]:
    """The target block `name` (`<block-type-slug>/<name>` or a bare block name,
    looked up in each target type) and its qualified reference.

    Raises UnknownTarget with one line saying how to create it, and
    AmbiguousTarget, naming each, when a bare name is saved in two target types.
    """
    slug, sep, bare = name.rpartition("/")
    types = [t for t in TARGET_TYPES if not sep or t.get_block_type_slug() == slug]
    if sep and not types:
        known = ", ".join(t.get_block_type_slug() for t in TARGET_TYPES)
        raise UnknownTarget(f"{slug!r} is not a target block type: use one of {known}")
    found: list[tuple[type[TargetBlock], TargetBlock]] = []
    for block_type in types:
        try:
            found.append((block_type, await block_type.aload(bare)))
        except ValidationError as error:
            raise UnknownTarget(
                f"the {block_type.get_block_type_name()} block {bare!r} holds a setting that is "
                f"not valid ({one_line(error)}): fix it in the Prefect UI under Blocks"
            ) from None
        except ValueError:
            continue
    if len(found) > 1:
        refs = " and ".join(f"{t.get_block_type_slug()}/{bare}" for t, _ in found)
        raise AmbiguousTarget(
            f"{len(found)} target blocks are named {bare!r} ({refs}): name the one to use "
            f"with its type, like {found[0][0].get_block_type_slug()}/{bare}, or save one "
            "under another name"
        )
    if found:
        block_type, block = found[0]
        return f"{block_type.get_block_type_slug()}/{bare}", block
    kinds = " or ".join(f"'{t.get_block_type_name()}'" for t in types)
    raise TargetGone(
        f"no target block named {bare!r} ({kinds}): create it with "
        f"`python blocks/create_blocks.py` or in the Prefect UI under Blocks"
    )


async def target_named(name: str, log: Logger, bounds: Mapping[str, float] | None = None) -> Target:
    """The `Target` of the block `name` (see `load_target`), logging to `log`,
    with `bounds` (`max_hours`, `max_cost_usd`) in place of the block's own for
    this run. Raises UnknownTarget, or SettingsError for settings that cannot
    be used or a bound the block does not have, each with one line."""
    ref, block = await load_target(name)
    if bounds:
        for field, value in bounds.items():
            if field not in type(block).model_fields:
                raise SettingsError(
                    f"target {ref} has no {field}: remove it (only a Runpod target's cost "
                    "is bounded)"
                )
            if value <= 0:
                raise SettingsError(f"{field} is {value}: give a number above 0")
        block = block.model_copy(update=dict(bounds))
    return block.target(ref, log)
