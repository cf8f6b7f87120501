"""The compare trainer: a fine-tune's GGUF and its base model's, asked the same questions.

A compare's directory (`runs/<run-id>/compares/<compare-id>/`, and its copy on
the target) holds what the job reads, with paths relative to it:

    models/base.gguf    the base model's GGUF, of the same quant type as the tuned one
    models/tuned.gguf   the run's GGUF, from its export
    questions.json      the questions
    scripts/            the job script, `overbrainer_compare.py`, and the generation
                        it shares with the evaluation, `overbrainer_generate.py`

The job (see `overbrainer_prefect/jobs/overbrainer_compare.py`) answers every
question with each model through its own chat template, greedily, with a fixed
seed and a token limit; it writes `answers.jsonl` and `metrics.jsonl`, which are
what a compare brings back and verifies.

The base model's GGUF is made once per base model, target and quant type by an
export of the plain base (`BaseExportTrainer`, the export job with `--base`),
kept under `<runs dir>/.bases/<key>/exports/<export-id>/` with the same record
and manifest as any export, and reused by every compare of every run of that
base.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, ValidationError

from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.trainers.base import METRICS_FILE, Artifacts, JobContext
from overbrainer_prefect.trainers.export import NAME_CHARS
from overbrainer_prefect.trainers.gguf_job import ANSWERS_FILE, GgufAsk, GgufJobTrainer

# what a compare's callers know by these names, explicitly re-exported
from overbrainer_prefect.trainers.gguf_job import MAX_TOKENS_LIMIT as MAX_TOKENS_LIMIT
from overbrainer_prefect.trainers.gguf_job import MODELS_DIR as MODELS_DIR
from overbrainer_prefect.trainers.gguf_job import GgufRef as GgufRef
from overbrainer_prefect.userfile import read_user_text

QUESTIONS_FILE = "questions.json"
COMPARE_MODULE = "overbrainer_compare"

VRAM_OVERHEAD_BYTES = 2 * 10**9  # the CUDA context, the KV cache and llama.cpp's buffers


class BadCompareInput(ValueError):
    """A compare's settings cannot be used. The message is one line."""


class BadQuestions(BadCompareInput):
    """The questions of a compare cannot be used. The message is one line."""


def load_questions(questions: Sequence[str] | None, questions_file: str | None) -> list[str]:
    """The questions of a compare: given as a list, or read from a file holding a
    JSON or YAML list of strings.

    Raises BadQuestions with one line when there are none, when both or neither
    are given, when the file cannot be read or is not a list of strings, or when
    a question is empty. The file's content is never quoted.
    """
    if questions and questions_file:
        raise BadQuestions(
            "give the questions either as a list (questions=[...]) or in a file "
            "(questions_file=...), not both"
        )
    if questions_file:
        found = _read_questions_file(Path(questions_file).expanduser())
    elif questions:
        found = list(questions)
        for index, question in enumerate(found, start=1):
            if not isinstance(question, str):
                raise BadQuestions(f"question {index} is not a string: give a list of strings")
    else:
        raise BadQuestions(
            "no questions: give questions=[...] or questions_file=<a JSON or YAML list of strings>"
        )
    for index, question in enumerate(found, start=1):
        if not question.strip():
            raise BadQuestions(f"question {index} is empty: remove it or write it out")
    return found


def _read_questions_file(path: Path) -> list[str]:
    shape = 'a JSON or YAML list of strings, like ["What is X?", "Who is Y?"]'
    text = read_user_text(path, "questions file", shape, BadQuestions)
    line: int | None = None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
    if line is not None:  # raised here, so the parser's message (which quotes the file) is dropped
        raise BadQuestions(f"the questions file {path} is not valid JSON or YAML (line {line})")
    if not isinstance(data, list) or not data:
        what = "empty" if not data else f"a {type(data).__name__}, not a list"
        raise BadQuestions(f"the questions file {path} is {what}: give {shape}")
    for index, question in enumerate(data, start=1):
        if not isinstance(question, str):
            raise BadQuestions(
                f"the questions file {path}: item {index} is not a string: give {shape}"
            )
    return list(data)


def check_max_tokens(max_tokens: int) -> int:
    """`max_tokens`, checked. Raises BadCompareInput with one line when it is out of range."""
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise BadCompareInput(
            f"max_tokens is {max_tokens}: give a number of tokens from 1 to {MAX_TOKENS_LIMIT}"
        )
    return max_tokens


def vram_floor(gguf_size: int) -> int:
    """The GPU memory a compare needs for a GGUF of `gguf_size` bytes (the models are
    loaded one at a time): the file, a fifth more for the KV cache and activations,
    and 2 GB for the CUDA context and llama.cpp's buffers."""
    return gguf_size + gguf_size // 5 + VRAM_OVERHEAD_BYTES


class CompareSpec(GgufAsk):
    """What a compare asks and of which models: enough to repeat it exactly. It is
    the `spec` of a compare's record."""

    questions: list[str] = Field(min_length=1)

    def asks(
        self, questions: Sequence[str], max_tokens: int, seed: int, quant: str, tuned_sha256: str
    ) -> bool:
        """Whether this compare asks `questions` of the tuned GGUF `tuned_sha256` the
        same way (its base GGUF follows from the tuned one's base model and quant)."""
        return (
            self.questions == list(questions)
            and self.max_tokens == max_tokens
            and self.seed == seed
            and self.quant == quant
            and self.tuned.sha256 == tuned_sha256
        )


def spec_of(record_spec: Mapping[str, object] | None) -> CompareSpec | None:
    """The compare spec in a record, or None when it holds none or another shape."""
    if record_spec is None:
        return None
    try:
        return CompareSpec.model_validate(record_spec)
    except ValidationError:
        return None


class ModelAnswer(BaseModel):
    """One answer of one model, as the compare job wrote it in `answers.jsonl`."""

    index: int = Field(ge=0, description="The question's position, from 0.")
    question: str
    model: str = Field(description="`base` or `tuned`.")
    answer: str
    tokens: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    seconds: float
    prompt_seconds: float
    tokens_per_s: float | None = None
    cut: bool = Field(description="Cut at the token limit: the model never ended its answer.")
    template: bool = Field(default=True, description="Asked through the GGUF's chat template.")


def read_answers(text: str) -> list[ModelAnswer]:
    """The answers of an `answers.jsonl`'s text, in order. Lines that are not
    answers (a line cut by a crash) are skipped."""
    answers = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            answers.append(ModelAnswer.model_validate(json.loads(line)))
        except (ValueError, ValidationError):
            continue
    return answers


def base_key(base_model: str, target: str) -> str:
    """The directory, under `.bases/`, of the GGUFs of `base_model`: its last path
    part and a hash of what names it (a Hub id; a directory, with the target it is
    on, since two targets may hold different models at the same path)."""
    is_path = base_model.startswith(("/", ".", "~"))
    identity = f"{target}\n{base_model}" if is_path else base_model
    stem = NAME_CHARS.sub("-", posixpath.basename(base_model.rstrip("/"))).strip(".-") or "model"
    return f"{stem}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


def base_exports(runs: Runs, key: str) -> Runs:
    """The store of the exports of the base model `key`: `<runs dir>/.bases/<key>/exports/`."""
    return runs.top.bases(key)


class CompareTrainer(GgufJobTrainer):
    """A compare following `spec`, whose GGUFs are in the runs directory `runs`.
    `cpu_threads` sets llama.cpp's threads on a target without a GPU;
    on one with a GPU every layer is offloaded to it.

    Raises TrainError when `cpu_threads` is below 1."""

    name = "compare"
    script = COMPARE_MODULE

    def __init__(self, spec: CompareSpec, runs: Runs, cpu_threads: int | None = None) -> None:
        super().__init__(spec, runs, cpu_threads)
        self.spec = spec

    def prepare(self, local_run_dir: Path, ctx: JobContext) -> None:
        """Stages both GGUFs under `models/` (hard links when they can be), the
        questions in `questions.json` and the job scripts under `scripts/`.

        Raises TrainError when a GGUF is missing.
        """
        self.stage(local_run_dir)
        (local_run_dir / QUESTIONS_FILE).write_text(
            json.dumps(self.spec.questions, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
        )

    def artifacts(self) -> Artifacts:
        """The answers and the metrics (never the GGUFs it was given); a succeeded
        compare must have its answers."""
        return Artifacts(entries=(ANSWERS_FILE, METRICS_FILE), required=ANSWERS_FILE)
