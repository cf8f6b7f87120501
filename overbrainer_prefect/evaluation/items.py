"""Where an evaluation's items come from, and the plan that fixes them.

- an eval file (JSON lines): `{"prompt": ..., "expected": ..., "scorer": ...,
  "tolerance": ...}`, or `{"messages": [...]}` whose last message is the
  assistant's expected answer (a row of chat training data);
- the controls shipped with the package (`controls.jsonl`: general questions
  with checkable answers) and the user's own, in the same format;
- the run's held-out rows (`heldout/` of its local directory, recorded by
  trainers/holdout.py): chat rows (`messages`) and alpaca rows, the row's last
  answer as the expected one.

`plan_evaluation` puts them together with the GGUFs into the `EvaluationPlan`
an evaluation's record keeps. Every problem is one line, raised before
anything runs; a file's content is never quoted, only its name and line.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from overbrainer_prefect.evaluation.spec import (
    BadEvaluationInput,
    EvalItem,
    EvaluationPlan,
    EvaluationSpec,
    Group,
    JudgeModel,
)
from overbrainer_prefect.runs.store import Runs
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.trainers.base import TrainError
from overbrainer_prefect.trainers.export import UnknownQuant, check_quant
from overbrainer_prefect.trainers.gguf_job import GgufRef
from overbrainer_prefect.trainers.holdout import HOLDOUT_DIR, SPLIT_FILE, HoldoutSplit, read_split
from overbrainer_prefect.userfile import read_user_text

CONTROLS_FILE = "controls.jsonl"
"""The default controls, shipped in this package."""

ROW_SHAPE = '{"prompt": ..., "expected": ...} or {"messages": [...]} ending with the answer'


def _problem(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    message = str(first["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def read_row(row: object, where: str, group: Group) -> EvalItem:
    """The item of one eval-file row (`where` names it: `file line N`).

    Raises BadEvaluationInput with one line when the row has no expected answer
    or is not a valid item (a regex that does not compile, an unknown key...)."""
    if not isinstance(row, dict):
        raise BadEvaluationInput(f"{where} is not a JSON object: give {ROW_SHAPE}")
    row = dict(row)
    if "expected" not in row:
        messages = row.get("messages")
        last = messages[-1] if isinstance(messages, list) and messages else None
        if not (
            isinstance(messages, list)
            and isinstance(last, dict)
            and last.get("role") == "assistant"
        ):
            raise BadEvaluationInput(
                f'{where} has no expected answer: give it "expected", or end its messages '
                "with the assistant's answer"
            )
        row["expected"] = last.get("content")
        row["messages"] = messages[:-1]
        row.setdefault("reference", last.get("content"))
    row["group"] = group
    try:
        return EvalItem.model_validate(row)
    except ValidationError as error:
        raise BadEvaluationInput(f"{where}: {_problem(error)}") from None


def parse_items(text: str, name: str, group: Group) -> list[EvalItem]:
    """The items of a JSON-lines text (blank lines skipped), `name` naming it in
    messages. Raises BadEvaluationInput naming the first bad line."""
    items = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            row = json.loads(line)
        except ValueError:
            raise BadEvaluationInput(f"{where} is not valid JSON: give {ROW_SHAPE}") from None
        item = read_row(row, where, group)
        items.append(item.model_copy(update={"source": f"{Path(name).name}:{number}"}))
    return items


def load_items(path: str, group: Group, what: str = "eval file") -> list[EvalItem]:
    """The items of the JSON-lines file `path`. Raises BadEvaluationInput with one
    line when it cannot be read, is empty, or has a bad row (named by line)."""
    file = Path(path).expanduser()
    text = read_user_text(file, what, "a .jsonl file", BadEvaluationInput)
    items = parse_items(text, f"{what} {file}", group)
    if not items:
        raise BadEvaluationInput(f"the {what} {file} holds no items: give {ROW_SHAPE}, one a line")
    return items


def default_controls() -> list[EvalItem]:
    """The controls shipped with the package: general questions with checkable answers."""
    text = resources.files("overbrainer_prefect.evaluation").joinpath(CONTROLS_FILE).read_text()
    return parse_items(text, CONTROLS_FILE, "control")


def heldout_row(
    row: object, kind: str, field_messages: str | None, where: str
) -> dict[str, object]:
    """An eval-file row for one held-out training row of axolotl type `kind`: the
    conversation up to its last answer, and that answer expected.

    Raises BadEvaluationInput when the row cannot be asked (another type, no answer)."""
    if not isinstance(row, dict):
        raise BadEvaluationInput(f"{where} is not a JSON object")
    if kind == "alpaca":
        instruction, extra, output = row.get("instruction"), row.get("input"), row.get("output")
        if not isinstance(instruction, str) or not isinstance(output, str):
            raise BadEvaluationInput(f"{where} has no instruction and output: an alpaca row")
        prompt = f"{instruction}\n\n{extra}" if isinstance(extra, str) and extra else instruction
        return {"prompt": prompt, "expected": output}
    if kind != "chat_template":
        raise BadEvaluationInput(
            f"held-out rows of type {kind} cannot be asked: give an eval_file, or train on "
            "chat_template or alpaca rows"
        )
    messages = row.get(field_messages or "messages")
    if not isinstance(messages, list) or not messages:
        raise BadEvaluationInput(f"{where} has no {field_messages or 'messages'} list")
    last = max((i for i, m in enumerate(messages) if _role(m) == "assistant"), default=None)
    if last is None or last == 0:
        raise BadEvaluationInput(f"{where} has no assistant answer after a prompt")
    return {
        "messages": [{"role": _role(m), "content": m.get("content")} for m in messages[:last]],
        "expected": messages[last].get("content"),
    }


def _role(message: object) -> object:
    return message.get("role") if isinstance(message, dict) else None


def heldout_items(
    runs: Runs, run_id: str, scorer: str
) -> tuple[list[EvalItem], HoldoutSplit | None]:
    """The items of the held-out rows the run `run_id` recorded (none when it
    kept none), each scored by `scorer` against the row's answer, and the split.

    Raises BadEvaluationInput with one line when the split or a row is unusable."""
    try:
        split = read_split(runs, run_id)
    except TrainError as error:
        raise BadEvaluationInput(str(error)) from None
    if split is None:
        return [], None
    items = []
    for entry in split.files:
        path = runs.where_of(run_id, entry.heldout)
        try:
            lines = runs.read_text(run_id, entry.heldout).splitlines()
        except FileNotFoundError:
            raise BadEvaluationInput(f"cannot read the held-out rows {path}: none there") from None
        except RecordError as error:
            raise BadEvaluationInput(f"cannot read the held-out rows {path}: {error}") from None
        rows = [line for line in lines if line.strip()]
        for line, number in zip(rows, entry.lines, strict=False):
            where = f"held-out row {entry.source} line {number}"
            try:
                raw = json.loads(line)
            except ValueError:
                raise BadEvaluationInput(f"{where} is not valid JSON") from None
            row = heldout_row(raw, entry.type, entry.field_messages, where)
            row |= {"scorer": scorer, "reference": row["expected"]}
            item = read_row(row, where, "heldout")
            items.append(item.model_copy(update={"source": f"{entry.heldout}:{number}"}))
    return items, split


def sha256_of(path: Path) -> str:
    """The SHA-256 of the file at `path`, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def plan_evaluation(
    spec: EvaluationSpec,
    *,
    runs: Runs,
    run_id: str,
    base_model: str,
    tuned: GgufRef,
    base: GgufRef,
) -> EvaluationPlan:
    """The plan of an evaluation of the run `run_id` of `runs`:
    the held-out items (the run's held-out rows when `spec.heldout`, then the eval
    file's, then `spec.items`), the controls (the shipped ones when
    `spec.default_controls`, the controls file's, then `spec.controls`), each with
    an id (`H1`..., `C1`...), and the GGUFs `tuned` and `base` (the model it is
    measured against: the base model's GGUF, or the last delivered one).

    Raises BadEvaluationInput with one line when an input cannot be used: a bad
    eval-file row (file and line), a regex that does not compile, an unknown
    quant, a judge GGUF that is not there, or no held-out item at all. UnknownQuant
    is raised as BadEvaluationInput too.
    """
    try:
        quant = check_quant(spec.quant)
    except UnknownQuant as error:
        raise BadEvaluationInput(str(error)) from None
    heldout: list[EvalItem] = []
    split = None
    if spec.heldout:
        heldout, split = heldout_items(runs, run_id, spec.heldout_scorer)
    if spec.eval_file:
        heldout += load_items(spec.eval_file, "heldout")
    heldout += [item.model_copy(update={"group": "heldout"}) for item in spec.items]
    if not heldout:
        raise BadEvaluationInput(
            f"nothing held out to evaluate run {run_id} on: it kept no rows out of "
            "training and no eval_file or items are given; train with holdout (like 0.2) or "
            "give an eval_file"
        )
    controls = default_controls() if spec.default_controls else []
    if spec.controls_file:
        controls += load_items(spec.controls_file, "control", "controls file")
    controls += [item.model_copy(update={"group": "control"}) for item in spec.controls]
    items = [item.model_copy(update={"id": f"H{i}"}) for i, item in enumerate(heldout, 1)]
    items += [item.model_copy(update={"id": f"C{i}"}) for i, item in enumerate(controls, 1)]
    judge_model = None
    if spec.judge is not None and spec.judge.gguf is not None:
        path = Path(spec.judge.gguf).expanduser().absolute()
        if not path.is_file():
            raise BadEvaluationInput(f"the judge GGUF {path} does not exist: give a .gguf file")
        judge_model = JudgeModel(path=str(path), size=path.stat().st_size, sha256=sha256_of(path))
    return EvaluationPlan(
        items=items,
        max_tokens=spec.max_tokens,
        seed=spec.seed,
        quant=quant,
        base_model=base_model,
        tuned=tuned,
        base=base,
        judge=spec.judge,
        judge_model=judge_model,
        perplexity=spec.perplexity,
        confidence=spec.confidence,
        alpha=spec.alpha,
        heldout_split=f"{run_id}/{HOLDOUT_DIR}/{SPLIT_FILE}" if split else None,
    )
