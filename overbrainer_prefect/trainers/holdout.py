"""The held-out split: rows of a run's training data kept out of its training.

With `TrainingSpec.holdout` set (a share below 1, or a number of rows), the
rows of the run's local JSON-lines datasets are split before upload: the rows
drawn (by the spec's seed, so the same spec and data always give the same
split) are removed from the run's copy of each dataset, `data/<name>`, and
written to `heldout/<name>`, with the split recorded in `heldout/split.json`.
`heldout/` is local only (`steps.start.LOCAL_ONLY`): it is never uploaded,
so the job never sees those rows; the evaluation asks them.

Hub datasets are trained on whole (they are not on this machine to split).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store.local import write_atomic
from overbrainer_prefect.store.records import RecordError, record_bytes
from overbrainer_prefect.trainers.base import TrainError
from overbrainer_prefect.trainers.spec import DatasetSpec, TrainingSpec

HOLDOUT_DIR = "heldout"
"""In a local run directory: the held-out rows and the split's record (never uploaded)."""

SPLIT_FILE = "split.json"
SPLITTABLE = frozenset({".jsonl"})


class HeldOutFile(BaseModel):
    """The held-out rows of one dataset file."""

    model_config = ConfigDict(extra="forbid")

    data: str = Field(description="The run's training copy, relative to the run directory.")
    heldout: str = Field(description="The held-out rows, relative to the run directory.")
    source: str = Field(description="The dataset file the rows came from, on this machine.")
    type: str = Field(description="axolotl's dataset format (chat_template, alpaca...).")
    field_messages: str | None = None
    rows: int = Field(ge=0, description="Rows of the source file.")
    lines: list[int] = Field(description="The source file's line numbers held out, from 1.")


class HoldoutSplit(BaseModel):
    """`heldout/split.json`: which rows a run kept out of its training."""

    model_config = ConfigDict(extra="forbid")

    holdout: float
    seed: int
    rows: int = Field(ge=0, description="Rows of every splittable dataset together.")
    held_out: int = Field(ge=0)
    files: list[HeldOutFile]


def holdout_count(holdout: float, rows: int) -> int:
    """How many of `rows` rows `holdout` keeps out: a share (at least one row when
    it is above 0) or a number of rows."""
    if holdout <= 0:
        return 0
    if holdout < 1:
        return max(1, round(holdout * rows))
    return int(holdout)


def _rows(path: Path) -> list[tuple[int, str]]:
    """The non-blank lines of `path`, with their line numbers from 1."""
    with path.open(encoding="utf-8") as file:
        return [(number, line) for number, line in enumerate(file, start=1) if line.strip()]


def _splittable(spec: TrainingSpec) -> list[DatasetSpec]:
    return [d for d in spec.datasets if d.is_local]


def holdout_problem(spec: TrainingSpec) -> str | None:
    """One line saying why `spec`'s held-out split cannot be made from this
    machine's datasets, or None (also when it keeps nothing out): a local dataset
    that is not a JSON-lines file, none to split, or a split that leaves no row
    to train on."""
    if spec.holdout <= 0:
        return None
    local = _splittable(spec)
    if not local:
        return (
            "holdout needs a local JSON-lines dataset to split, and every dataset is on the "
            "Hub: give a local .jsonl file, or set holdout to 0"
        )
    total = 0
    for dataset in local:
        path = Path(dataset.path).expanduser()
        if path.suffix.lower() not in SPLITTABLE or not path.is_file():
            return (
                f"holdout splits JSON-lines files, and dataset {dataset.path} is not one: "
                "convert it to .jsonl, or set holdout to 0"
            )
        try:
            total += len(_rows(path))
        except (OSError, UnicodeDecodeError) as error:
            return f"cannot read dataset {dataset.path} to split it: {error}"
    count = holdout_count(spec.holdout, total)
    if count >= total:
        return (
            f"holdout keeps {count} rows out of training, and the local datasets hold {total}: "
            "keep fewer out (a share below 1, or fewer rows) or add data"
        )
    return None


def split_heldout(
    run_dir: Path, data_paths: Sequence[str], spec: TrainingSpec
) -> HoldoutSplit | None:
    """Removes the held-out rows from the run's copies of its local datasets
    (`data_paths`, relative to `run_dir`, in the order of the local datasets) and
    writes them, with the split's record, under `heldout/`. Returns the split, or
    None when the spec keeps nothing out.

    Raises TrainError with one line when the split cannot be made (see
    `holdout_problem`).
    """
    problem = holdout_problem(spec)
    if problem is not None:
        raise TrainError(problem)
    if spec.holdout <= 0:
        return None
    local = _splittable(spec)
    files = [_rows(Path(d.path).expanduser()) for d in local]
    total = sum(len(rows) for rows in files)
    count = holdout_count(spec.holdout, total)
    drawn = set(random.Random(f"overbrainer-holdout-{spec.seed}").sample(range(total), count))
    entries: list[HeldOutFile] = []
    outdir = run_dir / HOLDOUT_DIR
    outdir.mkdir(parents=True, exist_ok=True)
    offset = 0
    for dataset, rows, data_path in zip(local, files, data_paths, strict=True):
        kept = [line for i, (_, line) in enumerate(rows) if offset + i not in drawn]
        out = [(n, line) for i, (n, line) in enumerate(rows) if offset + i in drawn]
        offset += len(rows)
        name = Path(data_path).name
        (run_dir / data_path).write_text("".join(_ended(line) for line in kept), encoding="utf-8")
        (outdir / name).write_text("".join(_ended(line) for _, line in out), encoding="utf-8")
        entries.append(
            HeldOutFile(
                data=data_path,
                heldout=f"{HOLDOUT_DIR}/{name}",
                source=str(Path(dataset.path).expanduser().absolute()),
                type=dataset.type,
                field_messages=dataset.field_messages,
                rows=len(rows),
                lines=[n for n, _ in out],
            )
        )
    split = HoldoutSplit(
        holdout=spec.holdout, seed=spec.seed, rows=total, held_out=count, files=entries
    )
    write_atomic(outdir, SPLIT_FILE, record_bytes(split))
    return split


def read_split(runs: Runs, run_id: str) -> HoldoutSplit | None:
    """The held-out split the run `run_id` recorded, or None when it kept nothing out.

    Raises TrainError with one line when the record is there but unreadable."""
    path = runs.where_of(run_id, HOLDOUT_DIR, SPLIT_FILE)
    try:
        text = runs.read_text(run_id, f"{HOLDOUT_DIR}/{SPLIT_FILE}")
    except FileNotFoundError:
        return None
    except RecordError as error:
        raise TrainError(f"cannot read the held-out split {path}: {error}") from None
    try:
        return HoldoutSplit.model_validate_json(text)
    except ValueError:
        raise TrainError(
            f"the held-out split {path} is not a valid record: train the run again"
        ) from None


def _ended(line: str) -> str:
    return line if line.endswith("\n") else line + "\n"
