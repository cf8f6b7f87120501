"""The model card (`README.md`) a run's Hub repository gets, made with
huggingface_hub's `ModelCard` and `ModelCardData`: the metadata the Hub reads
(base model, library, tags, Hub datasets) and a body naming the base model,
the dataset files (by name and SHA-256, never their content), the training
settings, the final loss and each delivered file with its SHA-256."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from overbrainer_prefect.delivery.sources import ExportedGguf, LocalFile
from overbrainer_prefect.executors.manifest import sha256_file
from overbrainer_prefect.runs.metrics import stored_summary
from overbrainer_prefect.runs.store import RunRecord, Runs
from overbrainer_prefect.store import StoreError
from overbrainer_prefect.store.records import RecordError
from overbrainer_prefect.trainers.axolotl import DATA_DIR
from overbrainer_prefect.trainers.base import METRICS_FILE
from overbrainer_prefect.trainers.spec import HUB_ID, TrainingSpec

TAGS = ("overbrainer", "axolotl")
"""Tags every card has; `gguf` and `lora` are added when they apply."""

SETTINGS = (
    "adapter",
    "sequence_len",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "num_epochs",
    "max_steps",
    "learning_rate",
    "lr_scheduler",
    "warmup_steps",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "val_set_size",
    "save_steps",
    "seed",
    "chat_template",
)
"""The training settings a card lists, in this order (LoRA ones only for an adapter)."""

SECRET_LOOKING = re.compile(r"token|key|secret|password|credential", re.IGNORECASE)
"""`extra` keys whose values a card never shows: they may hold a credential."""


@dataclass(frozen=True)
class DatasetFile:
    """A dataset file the run trained on: its name in the run and its SHA-256."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class CardFacts:
    """Everything a card says about a delivered run."""

    title: str
    run_id: str
    base_model: str
    adapter: str
    settings: dict[str, object]
    dataset_files: list[DatasetFile] = field(default_factory=list)
    hub_datasets: list[str] = field(default_factory=list)
    steps: int = 0
    final_loss: float | None = None
    files: list[tuple[str, LocalFile]] = field(default_factory=list)
    """Each delivered file: its path in the repository, and the local file."""
    gguf: ExportedGguf | None = None
    includes_adapter: bool = True


def facts_of_run(
    runs: Runs,
    record: RunRecord,
    title: str,
    files: Sequence[tuple[str, LocalFile]],
    gguf: ExportedGguf | None,
    includes_adapter: bool,
) -> CardFacts:
    """The card facts of run `record` of `runs`: its spec, the dataset files it
    uploaded (hashed now, from `data/`), and its metrics. A missing metrics
    file or data directory leaves those parts empty.

    Raises ValueError when the record holds no valid training spec.
    """
    if record.spec is None:
        raise ValueError(f"run {record.id} has no training spec in its record")
    spec = TrainingSpec.model_validate(record.spec)
    values = spec.model_dump(mode="json")
    lora = spec.adapter in ("lora", "qlora")
    skipped = {"num_epochs"} if spec.max_steps is not None else set()  # max_steps wins
    settings = {
        key: values[key]
        for key in SETTINGS
        if values.get(key) is not None
        and key not in skipped
        and (lora or not key.startswith("lora_"))
    }
    settings.update({k: v for k, v in sorted(spec.extra.items()) if not SECRET_LOOKING.search(k)})
    summary = stored_summary(runs, record.id, METRICS_FILE)
    return CardFacts(
        title=title,
        run_id=record.id,
        base_model=spec.base_model,
        adapter=spec.adapter,
        settings=settings,
        dataset_files=_dataset_files(runs, record.id),
        hub_datasets=[d.path for d in spec.datasets if not d.is_local],
        steps=summary.last.step if summary.last else 0,
        final_loss=summary.final_loss,
        files=list(files),
        gguf=gguf,
        includes_adapter=includes_adapter,
    )


AXOLOTL = "[axolotl](https://github.com/axolotl-ai-cloud/axolotl)"

CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

{{ summary }} of {{ base }}, fine-tuned with {{ axolotl }} by {{ by }} (run `{{ run_id }}`).

## Files

| file | size | SHA-256 |
|---|---:|---|
{% for path, size, sha256 in files -%}
| `{{ path }}` | {{ size }} | `{{ sha256 }}` |
{% endfor %}
## Training data

{% if dataset_files -%}
| file | size | SHA-256 |
|---|---:|---|
{% for name, size, sha256 in dataset_files -%}
| `{{ name }}` | {{ size }} | `{{ sha256 }}` |
{% endfor %}{% if hub_datasets %}
{% endif %}{% endif -%}
{% for name in hub_datasets -%}
- Hub dataset `{{ name }}`
{% endfor -%}
{% if not dataset_files and not hub_datasets -%}
No dataset file was found in the run directory.
{% endif %}
## Training settings

| setting | value |
|---|---|
{% for key, value in settings -%}
| {{ key }} | `{{ value }}` |
{% endfor %}
## Results

- steps: {{ steps }}
- final training loss: {{ final_loss }}
{% if gguf %}
## GGUF

- file: `{{ gguf.name }}`
- quant: `{{ gguf.quant }}`
- SHA-256: `{{ gguf.sha256 }}`
- export: `{{ gguf.export_id }}` of run `{{ gguf.run_id }}`
{% endif %}"""
"""The card's Markdown, a Jinja template `ModelCard.from_template` renders: the
metadata block, then the body. Every value it is given is already one line with
no `|` or backtick (`_text`), so it is safe in a table cell or a code span."""


def card_data(facts: CardFacts) -> ModelCardData:
    """The card's metadata, as the Hub reads it: `base_model` (when it is a Hub
    id), `library_name` (`peft` for an adapter, `transformers` for full
    weights), the tags, and the Hub datasets. Never fails."""
    lora = facts.adapter in ("lora", "qlora")
    tags = list(TAGS)
    if facts.gguf is not None:
        tags.append("gguf")
    if lora and facts.includes_adapter:
        tags.append("lora")
    library = ("peft" if lora else "transformers") if facts.includes_adapter else None
    return ModelCardData(
        base_model=facts.base_model if HUB_ID.match(facts.base_model) else None,
        library_name=library,
        tags=tags,
        datasets=list(facts.hub_datasets) or None,
    )


def model_card(facts: CardFacts) -> ModelCard:
    """The card (`README.md` of the repository): `card_data`'s metadata, then
    the body in Markdown (`CARD_TEMPLATE`); its text is `card.content`. Never fails."""
    what = []
    if facts.includes_adapter:
        what.append(
            "a LoRA adapter" if facts.adapter in ("lora", "qlora") else "the fine-tuned weights"
        )
    if facts.gguf is not None:
        what.append(f"a GGUF ({facts.gguf.quant}) of the merged model")
    gguf = facts.gguf
    card: ModelCard = ModelCard.from_template(
        card_data(facts),
        template_str=CARD_TEMPLATE,
        title=_text(facts.title),
        summary=_sentence(" and ".join(what)),
        base=_base_link(facts.base_model),
        axolotl=AXOLOTL,
        by="overbrainer-prefect",
        run_id=facts.run_id,
        files=[(_text(path), f.size, f.sha256) for path, f in facts.files],
        dataset_files=[(_text(d.name), d.size, d.sha256) for d in facts.dataset_files],
        hub_datasets=[_text(name) for name in facts.hub_datasets],
        settings=[(_text(k), _text(_value(v))) for k, v in facts.settings.items()],
        steps=facts.steps,
        final_loss=_loss(facts.final_loss),
        gguf=None
        if gguf is None
        else {
            "name": _text(gguf.file.name),
            "quant": gguf.quant,
            "sha256": gguf.file.sha256,
            "export_id": gguf.export_id,
            "run_id": gguf.run_id,
        },
    )
    return card


def _dataset_files(runs: Runs, run_id: str) -> list[DatasetFile]:
    """The dataset files the run uploaded (`data/`), hashed now: where they
    are in a local runs directory, fetched into this process's staging
    directory from an object store (the user's rows, not a model)."""
    try:
        stored = runs.files(run_id, DATA_DIR)
    except RecordError:
        return []
    found = []
    for info in stored:
        path = runs.run_dir(run_id) / info.key
        try:
            if runs.store.local_path(runs.key(run_id, info.key)) is None:
                runs.store.get_file(runs.key(run_id, info.key), path)
            if path.is_symlink():
                continue
            size, sha256 = sha256_file(path)
        except (OSError, StoreError):
            continue
        name = info.key[len(DATA_DIR) + 1 :]
        found.append(DatasetFile(name=name, size=size, sha256=sha256))
    return found


def _base_link(base_model: str) -> str:
    if HUB_ID.match(base_model):
        return f"[{base_model}](https://huggingface.co/{base_model})"
    return f"`{_text(Path(base_model).name or base_model)}`"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] if text else "A model"


def _value(value: object) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value)
    return str(value)


def _loss(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def _text(text: str) -> str:
    """`text` safe in a table cell or a code span: one line, no `|` or backtick."""
    return " ".join(text.split()).replace("|", "/").replace("`", "'")
