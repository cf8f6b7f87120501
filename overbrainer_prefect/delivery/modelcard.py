"""The model card (`README.md`) a run's Hub repository gets: YAML front matter
the Hub reads (base model, library, tags) and a body naming the base model,
the dataset files (by name and SHA-256, never their content), the training
settings, the final loss and each delivered file with its SHA-256."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from overbrainer_prefect.delivery.sources import ExportedGguf, LocalFile
from overbrainer_prefect.executors.manifest import sha256_file
from overbrainer_prefect.runs.metrics import MetricsSummary
from overbrainer_prefect.runs.store import RunRecord
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
    settings: dict[str, Any]
    dataset_files: list[DatasetFile] = field(default_factory=list)
    hub_datasets: list[str] = field(default_factory=list)
    steps: int = 0
    final_loss: float | None = None
    files: list[tuple[str, LocalFile]] = field(default_factory=list)
    """Each delivered file: its path in the repository, and the local file."""
    gguf: ExportedGguf | None = None
    includes_adapter: bool = True


def facts_of_run(
    run_dir: Path,
    record: RunRecord,
    title: str,
    files: Sequence[tuple[str, LocalFile]],
    gguf: ExportedGguf | None,
    includes_adapter: bool,
) -> CardFacts:
    """The card facts of run `record` whose local directory is `run_dir`: its
    spec, the dataset files it uploaded (hashed now, from `data/`), and its
    metrics. A missing metrics file or data directory leaves those parts empty.

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
    try:
        text = (run_dir / METRICS_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    summary = MetricsSummary.of_text(text)
    return CardFacts(
        title=title,
        run_id=record.id,
        base_model=spec.base_model,
        adapter=spec.adapter,
        settings=settings,
        dataset_files=_dataset_files(run_dir / DATA_DIR),
        hub_datasets=[d.path for d in spec.datasets if not d.is_local],
        steps=summary.last.step if summary.last else 0,
        final_loss=summary.final_loss,
        files=list(files),
        gguf=gguf,
        includes_adapter=includes_adapter,
    )


def front_matter(facts: CardFacts) -> dict[str, Any]:
    """The card's metadata: `base_model` (when it is a Hub id), `library_name`
    (`peft` for an adapter, `transformers` for full weights), the tags, and the
    Hub datasets."""
    meta: dict[str, Any] = {}
    if HUB_ID.match(facts.base_model):
        meta["base_model"] = facts.base_model
    lora = facts.adapter in ("lora", "qlora")
    if facts.includes_adapter:
        meta["library_name"] = "peft" if lora else "transformers"
    tags = list(TAGS)
    if facts.gguf is not None:
        tags.append("gguf")
    if lora and facts.includes_adapter:
        tags.append("lora")
    meta["tags"] = tags
    if facts.hub_datasets:
        meta["datasets"] = list(facts.hub_datasets)
    return meta


def model_card(facts: CardFacts) -> str:
    """The card's text: front matter, then the body in Markdown. Never fails."""
    meta = yaml.safe_dump(front_matter(facts), sort_keys=False, allow_unicode=True)
    base = _base_link(facts.base_model)
    what = []
    if facts.includes_adapter:
        what.append(
            "a LoRA adapter" if facts.adapter in ("lora", "qlora") else "the fine-tuned weights"
        )
    if facts.gguf is not None:
        what.append(f"a GGUF ({facts.gguf.quant}) of the merged model")
    lines = [
        "---",
        meta.rstrip("\n"),
        "---",
        "",
        f"# {_text(facts.title)}",
        "",
        f"{_sentence(' and '.join(what))} of {base}, fine-tuned with "
        f"[axolotl](https://github.com/axolotl-ai-cloud/axolotl) by overbrainer-prefect "
        f"(run `{facts.run_id}`).",
        "",
        "## Files",
        "",
        "| file | size | SHA-256 |",
        "|---|---:|---|",
    ]
    lines += [f"| `{_text(path)}` | {f.size} | `{f.sha256}` |" for path, f in facts.files]
    lines += ["", "## Training data", ""]
    if facts.dataset_files:
        lines += ["| file | size | SHA-256 |", "|---|---:|---|"]
        lines += [f"| `{_text(d.name)}` | {d.size} | `{d.sha256}` |" for d in facts.dataset_files]
    if facts.hub_datasets:
        lines += [""] if facts.dataset_files else []
        lines += [f"- Hub dataset `{_text(name)}`" for name in facts.hub_datasets]
    if not facts.dataset_files and not facts.hub_datasets:
        lines.append("No dataset file was found in the run directory.")
    lines += ["", "## Training settings", "", "| setting | value |", "|---|---|"]
    lines += [f"| {_text(k)} | `{_text(_value(v))}` |" for k, v in facts.settings.items()]
    lines += [
        "",
        "## Results",
        "",
        f"- steps: {facts.steps}",
        f"- final training loss: {_loss(facts.final_loss)}",
    ]
    if facts.gguf is not None:
        gguf = facts.gguf
        lines += [
            "",
            "## GGUF",
            "",
            f"- file: `{_text(gguf.file.name)}`",
            f"- quant: `{gguf.quant}`",
            f"- SHA-256: `{gguf.file.sha256}`",
            f"- export: `{gguf.export_id}` of run `{gguf.run_id}`",
        ]
    lines.append("")
    return "\n".join(lines)


def _dataset_files(data_dir: Path) -> list[DatasetFile]:
    if not data_dir.is_dir():
        return []
    found = []
    for path in sorted(p for p in data_dir.rglob("*") if p.is_file() and not p.is_symlink()):
        try:
            size, sha256 = sha256_file(path)
        except OSError:
            continue
        found.append(
            DatasetFile(name=path.relative_to(data_dir).as_posix(), size=size, sha256=sha256)
        )
    return found


def _base_link(base_model: str) -> str:
    if HUB_ID.match(base_model):
        return f"[{base_model}](https://huggingface.co/{base_model})"
    return f"`{_text(Path(base_model).name or base_model)}`"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] if text else "A model"


def _value(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value)
    return str(value)


def _loss(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def _text(text: str) -> str:
    """`text` safe in a table cell or a code span: one line, no `|` or backtick."""
    return " ".join(text.split()).replace("|", "/").replace("`", "'")
