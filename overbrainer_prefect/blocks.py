"""Prefect blocks: where runs run (targets) and the credentials they use.

A target block names a machine and how jobs run there; it builds the executor
the run flows drive. Training settings are not here: they are flow parameters.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Literal

from prefect.blocks.core import Block
from pydantic import Field, HttpUrl, SecretStr

from overbrainer_prefect.envfile import read_env_file
from overbrainer_prefect.executors.base import ExecError, Executor
from overbrainer_prefect.executors.local import LocalExecutor
from overbrainer_prefect.executors.ssh import SshExecutor
from overbrainer_prefect.runpod.client import RunpodClient
from overbrainer_prefect.runpod.settings import (
    DEFAULT_RUNPOD_IMAGE,
    DEFAULT_RUNPOD_VENV,
    RunpodTargetSettings,
    settings_from,
)

DOCS_URL = "https://github.com/overbrainer/overbrainer-prefect#readme"
LOGO_FILE = "overbrainer_prefect/logo.png"
"""The blocks' logo in this repository: a square 128 px PNG (Prefect's block
standards want a square image 45 to 1000 px wide)."""
LOGO_URL = f"https://raw.githubusercontent.com/overbrainer/overbrainer-prefect/main/{LOGO_FILE}"


class HuggingFaceCredentials(Block):
    """A Hugging Face token: it reaches jobs as `HF_TOKEN` through their
    environment only, and the Hub client when a model is pushed.

    Example:
        Load saved Hugging Face credentials:
        ```python
        from overbrainer_prefect.blocks import HuggingFaceCredentials

        hugging_face_credentials_block = HuggingFaceCredentials.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "Overbrainer Hugging Face Credentials"
    _block_type_slug = "overbrainer-hugging-face-credentials"
    _logo_url = HttpUrl(LOGO_URL)
    _documentation_url = HttpUrl(DOCS_URL)

    token: SecretStr = Field(description="A Hugging Face access token (read, or write to push).")
    endpoint: str | None = Field(
        default=None,
        description="The Hub's URL when it is not huggingface.co (a mirror or a gateway).",
    )


class TargetBlock(Block):
    """What every target has: the job environment, the bounds of a job, and
    how to build its executor."""

    _logo_url = HttpUrl(LOGO_URL)
    _documentation_url = HttpUrl(DOCS_URL)
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

    @abstractmethod
    def executor(self, name: str) -> Executor:
        """The executor of this target, named `name` in messages."""


class LocalTarget(TargetBlock):
    """This machine: jobs run as detached processes in a venv, in a work
    directory of their own, and their files are copied back and verified like
    any target's.

    Example:
        Load a saved local target:
        ```python
        from overbrainer_prefect import LocalTarget

        local_target_block = LocalTarget.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "Overbrainer Local Target"
    _block_type_slug = "overbrainer-local-target"
    kind: ClassVar[str] = "local"

    work_dir: str = Field(
        default="~/.overbrainer/work",
        description="The directory that holds the run directories of the jobs.",
    )

    def executor(self, name: str) -> Executor:
        """A `LocalExecutor` over `work_dir`."""
        return LocalExecutor(Path(self.work_dir).expanduser(), name=name)


class SshTarget(TargetBlock):
    """A machine reached over SSH (a GPU box you own or rent): jobs run there
    detached, outlive the connection, and their files come back over SFTP,
    verified against a SHA-256 manifest computed on the machine.

    The host's public key must be pinned (`host_key`): a host whose key cannot
    be checked is refused before anything is sent.

    Example:
        Load a saved SSH target:
        ```python
        from overbrainer_prefect.blocks import SshTarget

        ssh_target_block = SshTarget.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "Overbrainer SSH Target"
    _block_type_slug = "overbrainer-ssh-target"
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
        return SshExecutor(
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


class OllamaServer(Block):
    """An Ollama server that delivered models are created on: the `deliver`
    flow pushes a run's verified GGUF to it as a blob named by its SHA-256
    and creates the model with its chat template through the REST API.

    Example:
        Load a saved Ollama server:
        ```python
        from overbrainer_prefect.blocks import OllamaServer

        ollama_server_block = OllamaServer.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "Overbrainer Ollama Server"
    _block_type_slug = "overbrainer-ollama-server"
    _logo_url = HttpUrl(LOGO_URL)
    _documentation_url = HttpUrl(DOCS_URL)

    url: str = Field(
        default="http://127.0.0.1:11434",
        description="The server's base URL (`OLLAMA_HOST`), e.g. http://gpu-box:11434.",
    )
    model_prefix: str | None = Field(
        default=None,
        description="Put before the name of every model created here (a namespace like "
        "`team/`, or `ft-`).",
    )


class RunpodCredentials(Block):
    """A Runpod API key, and the URLs of the API it is sent to.

    The key goes only in the `Authorization` header of requests to `rest_url`
    and `graphql_url`; it never appears in a log, an error, a file or a pod's
    environment. The URLs are Runpod's by default; point them at a gateway,
    or at the simulator in tests.

    Example:
        Load saved Runpod credentials:
        ```python
        from overbrainer_prefect.blocks import RunpodCredentials

        runpod_credentials_block = RunpodCredentials.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "Overbrainer Runpod Credentials"
    _block_type_slug = "overbrainer-runpod-credentials"
    _logo_url = HttpUrl(LOGO_URL)
    _documentation_url = HttpUrl(DOCS_URL)

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


class RunpodTarget(TargetBlock):
    """A Runpod pod created for each run and deleted once the run's files are
    retrieved and verified. A watchdog on the pod deletes it by itself at
    `max_hours` (unless the flow following a progressing job renews its
    lease), at `max_cost_usd`, `retrieve_grace_s` after its job ended
    unretrieved, and `boot_grace_s` after it started without a job: nothing
    bills past its bound, whatever dies on this side. `keep_pod` turns all of
    that off.

    The settings are checked when a run starts: each problem (an unknown GPU
    type or data center, a price limit nothing meets, a missing image) is one
    line, before any pod is created.

    Example:
        Load a saved Runpod target:
        ```python
        from overbrainer_prefect.blocks import RunpodTarget

        runpod_target_block = RunpodTarget.load("BLOCK_NAME")
        ```
    """

    _block_type_name = "Overbrainer Runpod Target"
    _block_type_slug = "overbrainer-runpod-target"
    kind: ClassVar[str] = "runpod"

    credentials: RunpodCredentials = Field(description="The Runpod account pods are created in.")
    job_venv: str = Field(
        default=DEFAULT_RUNPOD_VENV,
        description="The virtual environment on the pod that runs jobs (torch, axolotl).",
    )
    max_hours: float = Field(
        default=6.0,
        description="Hours after which the pod's watchdog deletes the pod, unless the flow "
        "following a progressing job renews its lease.",
    )
    gpu_types: list[str] | Literal["auto"] = Field(
        default="auto",
        description='Runpod GPU type ids tried in order (like "NVIDIA GeForce RTX 4090"), or '
        '"auto": the cheapest types with enough VRAM.',
    )
    min_vram_gb: float | None = Field(
        default=None,
        description="Least VRAM per GPU in GB; unset: estimated from the base model for auto.",
    )
    max_price_per_hour: float | None = Field(
        default=None,
        description="Most the pod may cost per hour in USD, all its GPUs together; unset: "
        "no limit.",
    )
    gpu_count: int = Field(default=1, description="GPUs of the pod.")
    cloud: Literal["secure", "community"] = Field(
        default="secure",
        description="secure: Runpod's data centers; community: hosts of the community.",
    )
    image: str = Field(
        default=DEFAULT_RUNPOD_IMAGE,
        description="The pod's Docker image: Python, sshd and the job venv.",
    )
    container_disk_gb: int = Field(
        default=50, description="The pod's container disk in GB (wiped with the pod)."
    )
    max_cost_usd: float | None = Field(
        default=None,
        description="Most the pod may cost in USD (hours × its rate): its watchdog deletes it "
        "there. Unset: only max_hours bounds it.",
    )
    boot_grace_s: float = Field(
        default=1800.0,
        description="Seconds a pod may take to answer SSH, and its watchdog waits for a job "
        "to start, before the pod is deleted.",
    )
    retrieve_grace_s: float = Field(
        default=3600.0,
        description="Seconds the watchdog keeps a pod whose ended job was not retrieved.",
    )
    data_center_ids: list[str] = Field(
        default_factory=list,
        description="Runpod data centers the pod may be placed in, like EU-RO-1; empty: any.",
    )
    network_volume_id: str | None = Field(
        default=None,
        description="A network volume to mount at /workspace; needs exactly one data center.",
    )
    max_volume_gb: int | None = Field(
        default=None,
        description="Largest size in GB the network volume may be grown to, before a job's pod "
        "is asked for, when what the job will write there (estimated) does not fit; a volume "
        "only grows. Unset: never grown (a warning says when it is too small).",
    )
    keep_pod: bool = Field(
        default=False,
        description="Keep the pod once the run ends, with no time or cost limit: only the pods "
        "flow deletes it.",
    )

    def settings(self) -> RunpodTargetSettings:
        """The checked settings of this target. Raises SettingsError with one
        line naming the first field in error and what to do."""
        values: dict[str, Any] = {
            name: getattr(self, name) for name in RunpodTargetSettings.model_fields
        }
        return settings_from(values)

    def executor(self, name: str) -> Executor:
        """A Runpod target has no executor of its own: each run's pod is
        reached over SSH once it exists. Raises ExecError saying so."""
        raise ExecError(
            "connect",
            f"Runpod target {name!r} has no machine until a run creates its pod: train on it "
            "with the train flow, or follow a run with the attach flow",
        )
