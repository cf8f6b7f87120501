"""cloud.yml, the file axolotl's `--cloud` names, as the `overbrainer` launcher
reads it:

```yaml
provider: overbrainer
target: runpod            # a target block (local, SSH, Runpod)
deployment: train/runpod  # optional: a run of this deployment (else the flow runs here)
runs_dir: s3://team/runs  # optional, else the deployment's / OVERBRAINER_RUNS_DIR
max_hours: 4              # optional overrides of the target's bounds
max_cost_usd: 20
python: ~/venvs/prefect/bin/python   # optional: the orchestrator's Python
resume_from: 20260101-120000-abcd    # optional: a stopped run to go on from
run_id: 20260101-120000-abcd         # optional: the run `axolotl lm-eval --cloud` evaluates
evaluation: {eval_file: evals.jsonl} # optional: the evaluate flow's settings for lm-eval
```
"""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class CloudConfig(BaseModel):
    """The `overbrainer` launcher's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    provider: Literal["overbrainer"] = "overbrainer"
    target: str = Field(min_length=1, description="The target block the run goes to.")
    deployment: str | None = Field(
        default=None,
        description="`flow/deployment` to run the training as a run of (on its worker); "
        "else the `train` flow runs in the orchestrator's process.",
    )
    runs_dir: str | None = Field(default=None, description="Where the run's files land.")
    max_hours: float | None = Field(default=None, gt=0, description="The target's max_hours.")
    max_cost_usd: float | None = Field(
        default=None, gt=0, description="The target's max_cost_usd (a Runpod target)."
    )
    python: str | None = Field(default=None, description="The orchestrator's Python.")
    resume_from: str | None = Field(
        default=None, description="A stopped run whose checkpoint the new run starts from."
    )
    run_id: str | None = Field(
        default=None,
        description="The run `axolotl lm-eval --cloud` evaluates (else the newest succeeded "
        "training of the YAML's base model in runs_dir).",
    )
    evaluation: dict[str, object] | None = Field(
        default=None,
        description="`axolotl lm-eval --cloud`'s settings: the `evaluate` flow's evaluation "
        "(eval_file, relative to cloud.yml's directory; quant; max_tokens...).",
    )

    @field_validator("deployment")
    @classmethod
    def _flow_slash_name(cls, deployment: str | None) -> str | None:
        if deployment is not None and deployment.count("/") != 1:
            raise ValueError(f"deployment {deployment!r} is not `flow/deployment`, e.g. train/gpu")
        return deployment

    def bounds(self) -> dict[str, float]:
        """The target's bounds this file overrides, by field name."""
        found = {"max_hours": self.max_hours, "max_cost_usd": self.max_cost_usd}
        return {key: value for key, value in found.items() if value is not None}


class CloudConfigError(ValueError):
    """cloud.yml cannot be used; the message is one line saying what to fix."""


def read_cloud(values: dict[str, object]) -> CloudConfig:
    """cloud.yml's `values`, checked.

    Raises CloudConfigError with one line for the first problem: an unknown key
    (with the nearest known one), a missing target, a value out of range."""
    known = sorted(CloudConfig.model_fields)
    for key in values:
        if key not in CloudConfig.model_fields:
            near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"did you mean `{near[0]}`?" if near else f"the keys are {', '.join(known)}"
            raise CloudConfigError(f"cloud.yml: unknown key `{key}`: {hint}")
    try:
        return CloudConfig.model_validate(values)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "cloud.yml"
        message = str(first["msg"]).removeprefix("Value error, ")
        if first["type"] == "missing":
            message = "missing: name the target block to run on, e.g. `target: my-runpod`"
        raise CloudConfigError(f"cloud.yml: {where}: {message}") from None
