"""What a prepare step wrote: the files its output names, become the night's data.

A prepare step (the user's export script) says what it wrote with lines of
its own output, each alone on its line:

    OVERBRAINER_DATASET=/data/nightly/chats.jsonl
    OVERBRAINER_EVAL=/data/nightly/eval.jsonl

Every `OVERBRAINER_DATASET=` line names a training dataset (one or more, in
order); one `OVERBRAINER_EVAL=` line may name an evaluation file (the
evaluation's `eval_file`). A relative path is taken from the step's working
directory. The named files take the place of `training.datasets`, each with
the settings (`type`, `field_messages`...) of the first dataset the spec
gives. Every named file must exist and hold at least one row.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from overbrainer_prefect.evaluation.spec import EvaluationSpec
from overbrainer_prefect.trainers.spec import DatasetSpec, TrainingSpec

DATASET_LINE = "OVERBRAINER_DATASET="
EVAL_LINE = "OVERBRAINER_EVAL="
SHOWN_LINES = 5  # output lines a failed prepare's message ends with
SHOWN_LINE = 200  # characters of each of those lines, at most
PREPARE_TIMEOUT_S = 3600.0  # an export that runs past an hour is stopped (a parameter)


class PrepareError(ValueError):
    """A prepare step failed, or what it wrote cannot be trained on. The message
    is one line ending with the step's last output lines where it has some."""


@dataclass(frozen=True)
class Prepared:
    """The files a prepare step named: its datasets, in order, and its eval file."""

    datasets: tuple[Path, ...]
    eval_file: Path | None = None


def last_lines(lines: Sequence[str], count: int = SHOWN_LINES) -> str:
    """The last `count` non-blank lines of `lines`, quoted and joined on one line
    (`"a" / "b"`), each cut at 200 characters; `no output` when there is none."""
    kept = [line.strip() for line in lines if line.strip()][-count:]
    if not kept:
        return "no output"
    return " / ".join(json.dumps(line[:SHOWN_LINE], ensure_ascii=False) for line in kept)


def parse_output(lines: Sequence[str], working_dir: Path, block: str) -> Prepared:
    """The files the output `lines` of the prepare block `block` name (relative
    paths from `working_dir`).

    Raises PrepareError with one line when no line names a dataset, a line names
    an empty path, or two lines name an eval file.
    """
    datasets: list[Path] = []
    evals: list[Path] = []
    for line in lines:
        text = line.strip()
        for mark, found in ((DATASET_LINE, datasets), (EVAL_LINE, evals)):
            if text.startswith(mark):
                value = text.removeprefix(mark).strip()
                if not value:
                    raise PrepareError(
                        f"prepare block {block!r} printed {mark} with no path: print "
                        f"{mark}<path of the file it wrote>"
                    )
                found.append(working_dir / Path(value).expanduser())
    if not datasets:
        raise PrepareError(
            f"prepare block {block!r} named no file it wrote: end its commands with "
            f"`echo {DATASET_LINE}<path>` for each dataset; its last output lines: "
            f"{last_lines(lines)}"
        )
    if len(evals) > 1:
        raise PrepareError(
            f"prepare block {block!r} named {len(evals)} eval files: print {EVAL_LINE} once"
        )
    return Prepared(datasets=tuple(datasets), eval_file=evals[0] if evals else None)


def check_rows(prepared: Prepared, block: str) -> None:
    """Checks that each file `prepared` names exists and holds at least one row
    (a non-blank line of a JSON-lines file, an element of a JSON array, a byte
    of any other format).

    Raises PrepareError with one line naming the first that does not.
    """
    named = [*prepared.datasets, *([prepared.eval_file] if prepared.eval_file else [])]
    for path in named:
        try:
            rows = _has_rows(path)
        except FileNotFoundError:
            raise PrepareError(
                f"prepare block {block!r} named {path}, which does not exist: check where "
                "its commands write"
            ) from None
        except (OSError, EOFError, UnicodeDecodeError, ValueError) as error:
            raise PrepareError(
                f"prepare block {block!r} wrote {path}, which cannot be read "
                f"({type(error).__name__}): check the export"
            ) from None
        if not rows:
            raise PrepareError(
                f"prepare block {block!r} wrote no rows to {path}: nothing to train on; "
                "check the export's query"
            )


def apply(
    training: TrainingSpec, evaluation: EvaluationSpec | None, prepared: Prepared, block: str
) -> tuple[TrainingSpec, EvaluationSpec | None]:
    """`training` with the prepared files as its datasets (each with the settings
    of its first dataset), and `evaluation` with the prepared eval file.

    Raises PrepareError with one line when the prepare named an eval file and
    there is no evaluation to use it.
    """
    settings = training.datasets[0].model_dump(exclude={"path"}, exclude_none=True)
    settings.pop("revision", None)  # a Hub dataset's: not the prepared files'
    datasets = [DatasetSpec.model_validate({**settings, "path": str(p)}) for p in prepared.datasets]
    training = training.model_copy(update={"datasets": datasets})
    if prepared.eval_file is not None:
        if evaluation is None:
            raise PrepareError(
                f"prepare block {block!r} wrote an eval file ({prepared.eval_file}) but the "
                "fine-tune has no evaluation: set evaluation, or stop printing "
                f"{EVAL_LINE}"
            )
        evaluation = evaluation.model_copy(update={"eval_file": str(prepared.eval_file)})
    return training, evaluation


def _has_rows(path: Path) -> bool:
    if path.is_dir():
        return any(p.is_file() and p.stat().st_size for p in path.rglob("*"))
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
        with _open(path) as file:
            for line in file:  # the first non-blank line, never the whole file
                if line.strip():
                    if line.lstrip().startswith("[") and name.endswith((".json", ".json.gz")):
                        return bool(json.loads(line + file.read()))
                    return True
        return False
    return path.stat().st_size > 0


def _open(path: Path) -> IO[str]:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def take_prepared(
    lines: Sequence[str],
    working_dir: Path,
    block: str,
    training: TrainingSpec,
    evaluation: EvaluationSpec | None,
) -> tuple[TrainingSpec, EvaluationSpec | None, str]:
    """The night's training and evaluation once the prepare block `block` ran
    in `working_dir` and printed `lines`: its files (checked to hold rows) as
    the datasets and the eval file (see `apply`), and the line that says what
    it wrote. Raises PrepareError with one line."""
    prepared = parse_output(lines, working_dir, block)
    check_rows(prepared, block)
    training, evaluation = apply(training, evaluation, prepared, block)
    wrote = ", ".join(str(p) for p in prepared.datasets)
    if prepared.eval_file:
        wrote += f" and the eval file {prepared.eval_file}"
    return training, evaluation, f"prepare {block!r} wrote {wrote}"
