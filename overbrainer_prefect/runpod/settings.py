"""What a Runpod target sets: the GPU it asks for, the pod it creates and the
bounds that end the pod. A plain pydantic model, so the core reads it without
Prefect; the `RunpodTarget` block holds the same fields (one definition).

Every field is checked when the model is built; `settings_from` turns the
first problem into one line saying what to fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from overbrainer_prefect.runpod.models import Cloud

DEFAULT_RUNPOD_IMAGE = (
    "axolotlai/axolotl-cloud-term:0.19.0-py3.12-cu130-2.12.1"
    "@sha256:f7b94da82913920a003e28e091d8528f57f76da7360fca87e95faf62fa32a680"
)
"""axolotl 0.19.0's cloud image for CUDA 13 (NVIDIA driver 580 or newer),
pinned by its index digest."""

DEFAULT_RUNPOD_VENV = "/workspace/axolotl-venv"
"""The virtual environment holding axolotl in `DEFAULT_RUNPOD_IMAGE`."""

AUTO: Literal["auto"] = "auto"

DEFAULT_DISK_GB = 50
"""The container disk of a target that sets none (Runpod's own default)."""
MAX_RESTARTS = 10  # a training lost more often than this has a cause a new pod will not mend

MIN_DISK_GB = 20
"""The least container disk a pod is given: the image's own files need room."""


class RunpodSettingsFields(BaseModel):
    """The fields of a Runpod target's settings, with their constraints: held
    once, by the checked settings below and by the `RunpodTarget` block.

    `gpu_types` is a list of Runpod GPU type ids tried in its order, or
    `"auto"`: every type that has the VRAM (`min_vram_gb`, or the estimate of
    the run's needs) and costs at most `max_price_per_hour`, cheapest first.
    The pod is deleted once its run's files are retrieved and verified, and
    its watchdog deletes it at `max_hours` (unless a following client renews
    its lease), at `max_cost_usd`, `retrieve_grace_s` after its job ended
    unretrieved, and `boot_grace_s` after it started without a job;
    `keep_pod` turns all of that off.
    """

    gpu_types: list[str] | Literal["auto"] = Field(
        default=AUTO,
        description='Runpod GPU type ids tried in order (like "NVIDIA GeForce RTX 4090"), or '
        '"auto": the cheapest types with enough VRAM.',
    )
    min_vram_gb: float | None = Field(
        default=None,
        gt=0,
        description="Least VRAM per GPU in GB; unset: estimated from the base model for auto.",
    )
    max_price_per_hour: float | None = Field(
        default=None,
        gt=0,
        description="Most the pod may cost per hour in USD, all its GPUs together; unset: "
        "no limit.",
    )
    gpu_count: int = Field(default=1, ge=1, le=16, description="GPUs of the pod.")
    cloud: Literal["secure", "community"] = Field(
        default="secure",
        description="secure: Runpod's data centers; community: hosts of the community "
        "(cheaper, slower to start).",
    )
    image: str = Field(
        default=DEFAULT_RUNPOD_IMAGE,
        description="The pod's Docker image: Python, sshd and the job venv.",
    )
    job_venv: str = Field(
        default=DEFAULT_RUNPOD_VENV,
        description="The virtual environment on the pod that runs jobs (torch, axolotl).",
    )
    container_disk_gb: int | Literal["auto"] = Field(
        default=DEFAULT_DISK_GB,
        description="The pod's container disk in GB (wiped with the pod), at least 20; or "
        '"auto": sized before the pod is asked for, from the weights its jobs hold at their '
        "peak, with headroom. A fixed size smaller than that need is refused before any pod.",
    )
    max_hours: float = Field(
        default=6.0,
        gt=0,
        le=720,
        description="Hours after which the pod's watchdog deletes the pod, unless a client "
        "following a progressing job renews its lease.",
    )
    max_cost_usd: float | None = Field(
        default=None,
        gt=0,
        description="Most the pod may cost in USD (hours × its rate): the watchdog deletes it "
        "there. Unset: only max_hours bounds it.",
    )
    boot_grace_s: float = Field(
        default=1800.0,
        gt=0,
        description="Seconds the watchdog waits for a job to start before deleting the pod.",
    )
    retrieve_grace_s: float = Field(
        default=3600.0,
        gt=0,
        description="Seconds the watchdog keeps a pod whose ended job was not retrieved.",
    )
    max_restarts: int = Field(
        default=2,
        ge=0,
        le=MAX_RESTARTS,
        description="How many times a training whose pod is lost under it (terminated by "
        "Runpod, its container restarted, its host silent) goes on, by itself, from its last "
        "kept checkpoint (see checkpoints_on; from where it started when none was kept yet), on a "
        f"new pod; 0: the run fails with the loss; at most {MAX_RESTARTS}.",
    )
    data_center_ids: list[str] = Field(
        default_factory=list,
        description="Runpod data centers the pod may be placed in, like EU-RO-1; empty: any.",
    )
    network_volume_id: str | None = Field(
        default=None,
        description="A network volume to mount at /workspace; needs exactly one data center, "
        "the volume's.",
    )
    checkpoints_on: Literal["store", "volume"] = Field(
        default="store",
        description="Where a training's checkpoints are kept as it saves them, for a new pod to "
        "go on from when its pod is lost: `store` (copied into the runs store) or `volume` "
        "(left on the network volume, where the job wrote them, and checked by SHA-256 there: "
        "nothing is copied while it trains; a new pod in the volume's data center links them "
        "in). `volume` needs a network_volume_id.",
    )
    max_volume_gb: int | None = Field(
        default=None,
        ge=1,
        description="Largest size in GB the network volume may be grown to, before a job's pod "
        "is asked for, when what the job will write there (estimated) does not fit (a grow is "
        "permanent); unset: never grown.",
    )
    keep_pod: bool = Field(
        default=False,
        description="Keep the pod once the run ends, with no time or cost limit: only the pods "
        "flow deletes it.",
    )

    @field_validator("gpu_types", mode="before")
    @classmethod
    def _gpu_types(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text == AUTO:
                return AUTO
            return [item.strip() for item in text.split(",") if item.strip()]
        if isinstance(value, list | tuple):
            items = [str(item).strip() for item in value]
            if AUTO in items:
                raise ValueError('"auto" is not a GPU type: set gpu_types to "auto" alone')
            if any(not item for item in items):
                raise ValueError("gpu_types holds an empty name: remove it")
            return items
        return value

    @field_validator("gpu_types")
    @classmethod
    def _some_gpu_types(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError('gpu_types is empty: list GPU type ids, or set it to "auto"')
        return value

    @field_validator("container_disk_gb", mode="before")
    @classmethod
    def _disk(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip().lower()
            if text == AUTO:
                return AUTO
            if not text.isdigit():
                raise ValueError(f'is "{value}": give a number of GB (at least 20), or "auto"')
            return int(text)
        return value

    @field_validator("container_disk_gb")
    @classmethod
    def _disk_floor(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < MIN_DISK_GB:
            raise ValueError(
                f"is {value} GB: it should be greater than or equal to {MIN_DISK_GB}, or "
                '"auto" (sized from the jobs)'
            )
        return value

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        value = value.strip()
        if not value:
            raise ValueError(
                f"the image is missing: set image to a Docker image with Python and sshd, "
                f"like {DEFAULT_RUNPOD_IMAGE.split('@')[0]}"
            )
        return value

    @field_validator("job_venv")
    @classmethod
    def _job_venv(cls, value: str) -> str:
        value = value.strip()
        if not value.startswith("/"):
            raise ValueError(f"job_venv {value!r} is not an absolute path on the pod")
        return value

    @field_validator("data_center_ids", mode="before")
    @classmethod
    def _data_centers(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list | tuple):
            return [str(item).strip() for item in value if str(item).strip()]
        return value

    @model_validator(mode="after")
    def _volume(self) -> Self:
        if self.network_volume_id is not None and len(self.data_center_ids) != 1:
            raise ValueError(
                "a network volume needs exactly one data center: set data_center_ids to the "
                "volume's data center"
            )
        if self.max_volume_gb is not None and self.network_volume_id is None:
            raise ValueError("max_volume_gb needs a network_volume_id: set one, or unset it")
        if self.checkpoints_on == "volume" and self.network_volume_id is None:
            raise ValueError(
                "checkpoints_on 'volume' needs a network_volume_id: set one, or keep the "
                "checkpoints in the runs store (checkpoints_on 'store')"
            )
        return self

    @property
    def checkpoints_volume(self) -> str | None:
        """The network volume a training's checkpoints are kept on, where its
        job writes them (`checkpoints_on: volume`); None: in the runs store."""
        return self.network_volume_id if self.checkpoints_on == "volume" else None

    @property
    def is_auto(self) -> bool:
        """Whether the GPU types are chosen from the catalog when the run starts."""
        return self.gpu_types == AUTO

    @property
    def disk_gb(self) -> int:
        """The container disk in GB a pod is asked with: the fixed size, or
        for `auto` settings not yet sized for a job (`targets.disk`), the
        default."""
        disk = self.container_disk_gb
        return disk if isinstance(disk, int) else DEFAULT_DISK_GB

    @property
    def api_cloud(self) -> Cloud:
        """The cloud as the Runpod API spells it."""
        return "SECURE" if self.cloud == "secure" else "COMMUNITY"


class RunpodTargetSettings(RunpodSettingsFields):
    """The checked settings of a Runpod target (frozen), as the core reads them."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SettingsError(ValueError):
    """Runpod target settings that cannot be used; the message is one line."""


def settings_from(data: Mapping[str, object] | RunpodTargetSettings) -> RunpodTargetSettings:
    """`data` as checked settings. Raises SettingsError with one line naming
    the first field in error and what to do."""
    if isinstance(data, RunpodTargetSettings):
        return data
    try:
        return RunpodTargetSettings.model_validate(dict(data))
    except ValidationError as exc:
        raise SettingsError(one_line(exc)) from None


def one_line(exc: ValidationError) -> str:
    """The first problem of a validation error as one line: `field: message`."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if not isinstance(part, int))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message
