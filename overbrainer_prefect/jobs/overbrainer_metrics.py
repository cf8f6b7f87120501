"""The axolotl plugin that reports a training job's progress and stops it on request.

Runs inside the job (it imports axolotl and transformers, which only the job
venv has): the trainer copies this file into `<run>/plugins/` and puts that
directory on the job's PYTHONPATH, and its config names
`overbrainer_metrics.MetricsPlugin` in `plugins:`.

It appends one JSON object a line to the metrics file, flushed at each line,
each with `time` (epoch seconds):

    {"event": "begin", "step": 0, "max_steps": 40, "processes": 2, "gpus": 2, "time": ...}
    {"event": "log", "step": 3, "loss": 5.6, "learning_rate": 0.001, "grad_norm": 1.2,
     "epoch": 0.19, "max_steps": 40, "time": ...}
    {"event": "end", "step": 40, "stopped": false, "checkpoint": null, "train_loss": 5.5,
     "train_runtime": 1.9, "time": ...}

After each optimizer step, when the stop file exists in the job's directory,
it asks the trainer for a checkpoint (`output/checkpoint-N`, with the optimizer
state, so training can resume from it) and to stop; the end event then says
`stopped: true` and names that checkpoint.

In a run of N processes (torchrun), only the main process (rank 0) writes the
metrics file; the begin event says how many processes trained and on how many
GPUs, and the main process's stop decision is broadcast to every process so
that all of them save the checkpoint and stop at the same step.

Once registered, it also makes axolotl's save of its prepared dataset write in
the job's own process (`save_in_process`).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from axolotl.integrations.base import BasePlugin
from pydantic import BaseModel
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

LOG_KEYS = ("loss", "eval_loss", "learning_rate", "grad_norm", "epoch")
"""What a `log` event carries of the trainer's logs, when present."""

SUMMARY_KEYS = ("train_loss", "train_runtime")
"""What the trainer's closing summary gives the `end` event."""


class MetricsArgs(BaseModel):
    """The plugin's config keys: where it writes and what asks it to stop."""

    overbrainer_metrics_file: str = "metrics.jsonl"
    overbrainer_stop_file: str = "stop.request"


class MetricsCallback(TrainerCallback):
    """Writes the begin, log and end events and turns the stop file into a
    checkpoint and a stop. Only the main process writes; in a multi-process run
    the main process's decision to stop is shared with every process."""

    def __init__(self, metrics_file: str, stop_file: str) -> None:
        self.metrics_path = Path(metrics_file)
        self.stop_path = Path(stop_file)
        self.stopped = False
        self.summary: dict[str, float] = {}
        self._out: TextIO | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        """Writes the begin event, with the processes and GPUs that train."""
        processes = int(getattr(args, "world_size", 1) or 1)
        on_gpu = getattr(getattr(args, "device", None), "type", "cpu") == "cuda"
        gpus = processes * max(1, int(getattr(args, "n_gpu", 1) or 1)) if on_gpu else 0
        self._write(
            state,
            {
                "event": "begin",
                "step": state.global_step,
                "max_steps": state.max_steps,
                "processes": processes,
                "gpus": gpus,
            },
        )

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **_: Any,
    ) -> None:
        """Writes a log event for a step's losses; keeps the closing summary for the end."""
        logs = logs or {}
        if any(key in logs for key in SUMMARY_KEYS):
            self.summary.update(
                {k: float(logs[k]) for k in SUMMARY_KEYS if _is_number(logs.get(k))}
            )
            return
        values = {k: float(logs[k]) for k in LOG_KEYS if _is_number(logs.get(k))}
        if not values:
            return
        event = {"event": "log", "step": state.global_step, **values, "max_steps": state.max_steps}
        self._write(state, event)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> TrainerControl:
        """Asks for a checkpoint and a stop when the stop file exists."""
        requested = state.is_world_process_zero and self.stop_path.exists()
        requested = _shared_decision(args, requested)
        if requested:
            self.stopped = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        """Writes the end event: the last step, whether a stop ended it and its checkpoint."""
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        event: dict[str, Any] = {
            "event": "end",
            "step": state.global_step,
            "stopped": self.stopped,
            "checkpoint": _relative(checkpoint) if checkpoint.is_dir() else None,
            **self.summary,
        }
        self._write(state, event)
        if self._out is not None:
            self._out.close()
            self._out = None

    def _write(self, state: TrainerState, event: dict[str, Any]) -> None:
        if not state.is_world_process_zero:
            return
        if self._out is None:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self._out = self.metrics_path.open("a", encoding="utf-8")
        self._out.write(json.dumps({**event, "time": time.time()}) + "\n")
        self._out.flush()


class MetricsPlugin(BasePlugin):
    """Adds `MetricsCallback` to axolotl's trainer, configured by `MetricsArgs`."""

    def register(self, cfg: dict[str, Any]) -> None:
        """Says on stderr that the plugin loaded: a job log without this line ran
        without metrics (axolotl only logs a plugin that fails to import). Then
        `save_in_process`: registering comes before any dataset is loaded."""
        print("overbrainer metrics plugin loaded", file=sys.stderr, flush=True)
        from datasets import Dataset

        save_in_process(Dataset)

    def get_input_args(self) -> str:
        """The pydantic model of the plugin's config keys."""
        return f"{__name__}.MetricsArgs"

    def add_callbacks_post_trainer(self, cfg: Any, trainer: Any) -> list[TrainerCallback]:
        """The metrics callback, writing where the config says."""
        metrics = cfg.overbrainer_metrics_file or MetricsArgs().overbrainer_metrics_file
        stop = cfg.overbrainer_stop_file or MetricsArgs().overbrainer_stop_file
        return [MetricsCallback(metrics, stop)]


def save_in_process(dataset_class: Any) -> None:
    """Makes `dataset_class.save_to_disk(..., num_proc=1)` write in the calling
    process. For num_proc=1 datasets starts a spawned pool of one and its
    manager (two Pythons that import datasets: 3 to 4 s of a core and 7 to 9 s
    of a job's wall time on a 2-core machine, billed on a pod), and axolotl
    passes at least 1 when it saves the prepared dataset of every job. A
    larger num_proc is left as it is. Patching twice changes nothing."""
    save = dataset_class.save_to_disk
    if getattr(save, "in_process", False):
        return

    @functools.wraps(save)
    def in_process(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("num_proc") == 1:
            kwargs["num_proc"] = None
        return save(self, *args, **kwargs)

    in_process.in_process = True  # type: ignore[attr-defined]
    dataset_class.save_to_disk = in_process


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _relative(path: Path) -> str:
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def _shared_decision(args: TrainingArguments, decided: bool) -> bool:
    """The main process's decision, in every process of a distributed run."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return decided
    import torch

    flag = torch.tensor(1 if decided else 0, dtype=torch.long, device=args.device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())
