"""The export job: a run's model turned into one GGUF file with llama.cpp.

Runs inside the job venv on the target (torch, transformers, peft, llama-cpp-python
and llama.cpp's HF->GGUF converter), in the export's directory, which holds:

    model/          the run's model: a LoRA adapter (adapter_config.json) or full weights
    axolotl.yaml    the run's config, whose `base_model` a LoRA is merged into
    scripts/        this script

With `--base MODEL` it exports a plain base model instead (a directory on the
target or a Hugging Face id, no LoRA, nothing staged but this script): what a
compare sets a fine-tune's GGUF against.

Three steps, each timed:

1. merge: a LoRA is loaded onto its base (a directory on the target or a Hugging
   Face id, unquantized even for a QLoRA) and merged in (`merge_and_unload`); the
   merged model is saved under `work/merged/` with the tokenizer and its chat
   template. Full weights are taken as they are (the step is skipped).
2. convert: llama.cpp's `convert_hf_to_gguf.py`, run with this Python, writes an
   f16 GGUF (the chat template travels in it).
3. quantize: `llama_cpp.llama_model_quantize` turns it into the asked type (skipped
   for f16). Tensors whose width the type cannot take fall back to another type,
   as llama.cpp decides.

The GGUF is moved into `gguf/<name>-<quant>.gguf` only once it is complete, and
`work/` is removed unless `--keep-intermediate`. One JSON object a line is
appended to `metrics.jsonl`, each with `time`:

    {"event": "begin", "quant": "q4_k_m", "kind": "lora", "base_model": "...", "time": ...}
    {"event": "phase", "name": "merge", "seconds": 4.1, "time": ...}
    {"event": "phase", "name": "convert", "seconds": 6.0, "size": 270933024, "time": ...}
    {"event": "phase", "name": "quantize", "seconds": 2.8, "size": 105454304, "time": ...}
    {"event": "end", "gguf": "gguf/x-q4_k_m.gguf", "size": 105454304, "seconds": 13.0, ...}

usage: python scripts/overbrainer_export.py --converter PATH --quant QUANT --name NAME
           [--title TITLE] [--threads N] [--keep-intermediate] [--base MODEL]

(the export trainer runs it as `python scripts/overbrainer_run.py
overbrainer_export ...`, which ends its process without Python's teardown
once it exited 0: see overbrainer_run.py)

Exits 2 with one line on stderr when an input is missing (no model, no base
model, no converter, an unknown quant type), 3 when llama.cpp fails to quantize;
a failing converter's exit code is returned as is.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import runpy
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

MODEL_DIR = Path("model")
CONFIG_FILE = Path("axolotl.yaml")
GGUF_DIR = Path("gguf")
WORK_DIR = Path("work")
METRICS_FILE = Path("metrics.jsonl")

FTYPES = {
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "f16": None,
}
"""The quant types, with llama.cpp's file type for each (f16 is what the converter writes)."""

TOKENIZER_FILES = ("tokenizer.model", "chat_template.jinja")
"""Files the converter reads that a tokenizer's save may not write: copied from the
run's model, else from the base, when the merged model lacks them."""


class ExportFailed(Exception):
    """An input is missing or a step failed; the message is one line, the exit code its own."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class Metrics:
    """Appends events to the metrics file, one flushed JSON line each."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def write(self, event: str, **fields: Any) -> None:
        """Appends one event with the current time."""
        self.file.write(json.dumps({"event": event, **fields, "time": time.time()}) + "\n")
        self.file.flush()


def base_model() -> str:
    """The base a LoRA is merged into: `base_model` of the run's axolotl.yaml,
    else the adapter's `base_model_name_or_path`."""
    base = None
    if CONFIG_FILE.is_file():
        import yaml

        config = yaml.safe_load(CONFIG_FILE.read_text(encoding="utf-8")) or {}
        base = config.get("base_model")
    if not base:
        adapter = json.loads((MODEL_DIR / "adapter_config.json").read_text(encoding="utf-8"))
        base = adapter.get("base_model_name_or_path")
    if not base:
        raise ExportFailed("neither axolotl.yaml nor the adapter names the base model")
    if base.startswith(("/", ".", "~")) and not Path(base).expanduser().is_dir():
        raise ExportFailed(
            f"the base model {base} is not a directory on this target: export the run on the "
            "target it trained on, or copy its base model there"
        )
    return str(Path(base).expanduser()) if base.startswith("~") else str(base)


def base_dir(base: str) -> Path:
    """The directory of the plain base model `base` to export: a directory on this
    target, or a Hugging Face id fetched into the cache (`HF_HOME`)."""
    if base.startswith(("/", ".", "~")):
        path = Path(base).expanduser()
        if not path.is_dir():
            raise ExportFailed(
                f"the base model {base} is not a directory on this target: compare on the "
                "target the run trained on, or copy its base model there"
            )
        return path
    from huggingface_hub import snapshot_download

    print(f"export: fetching the base model {base}", flush=True)
    return Path(snapshot_download(base))


def merge(base: str, out: Path) -> None:
    """Merges the LoRA of `model/` into `base` and saves the result, its tokenizer
    and its chat template in `out`."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    has_tokenizer = (MODEL_DIR / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR) if has_tokenizer else base)
    device = "auto" if torch.cuda.is_available() else "cpu"  # "auto": across the GPUs
    print(f"export: loading the base model {base} on {device}", flush=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto", device_map=device)
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:  # the run added tokens: its adapter holds the larger embeddings
        model.resize_token_embeddings(len(tokenizer))
    print(f"export: merging the LoRA of {MODEL_DIR}/", flush=True)
    merged = PeftModel.from_pretrained(model, str(MODEL_DIR)).merge_and_unload()
    merged.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    base_path = Path(base) if Path(base).is_dir() else None
    for name in TOKENIZER_FILES:
        if (out / name).exists():
            continue
        for source in (MODEL_DIR, base_path):
            if source is not None and (source / name).is_file():
                shutil.copyfile(source / name, out / name)
                break


def byte_level(pre_tokenizer: Any) -> bool:
    """Whether a tokenizer.json pre-tokenizer is (or holds) a ByteLevel one."""
    if not isinstance(pre_tokenizer, dict):
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return True
    return any(byte_level(p) for p in pre_tokenizer.get("pretokenizers") or [])


def repair_tokenizer(model: Path) -> None:
    """Clears `byte_fallback` in the tokenizer.json of `model` (a working copy) when
    its pre-tokenizer is byte-level. Such a tokenizer never falls back to bytes (every
    byte is a token already), but the flag makes llama.cpp's converter take it for a
    SentencePiece-style vocabulary (LlamaHfVocab), whose GGUF then crashes llama.cpp
    on the first newline; transformers writes it so when it builds a tokenizer from a
    GGUF (SmolLM2's, for one). Without the flag the converter reads it as the byte-level
    BPE it is."""
    path = model / "tokenizer.json"
    if not path.is_file():
        return
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    bpe = tokenizer.get("model") or {}
    if (
        bpe.get("type") == "BPE"
        and bpe.get("byte_fallback")
        and byte_level(tokenizer.get("pre_tokenizer"))
    ):
        bpe["byte_fallback"] = False
        if path.is_symlink():
            path.unlink()
        path.write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
        print(
            "export: byte-level BPE tokenizer: byte_fallback cleared for the converter", flush=True
        )


def working_copy(model: Path, out: Path) -> Path:
    """`out` holding links to the files of `model`, so the converter's inputs can be
    repaired without touching the run's files."""
    out.mkdir(parents=True, exist_ok=True)
    for source in model.iterdir():
        if source.is_file():
            (out / source.name).symlink_to(source.resolve())
    return out


def convert(converter: Path, model: Path, out: Path, title: str) -> None:
    """Converts the Hugging Face model in `model` into the f16 GGUF `out`, whose
    `general.name` is `title`, with llama.cpp's converter run in this process:
    the torch and transformers the merge imported are not imported a second
    time (seconds a pod bills). Its output goes to the job log; raises
    ExportFailed with its exit code when it exits with one, or with 1 and its
    error when it fails."""
    argv = [str(converter), str(model), "--outtype", "f16", "--outfile", str(out)]
    argv += ["--model-name", title]
    print(f"export: {sys.executable} {' '.join(argv)}", flush=True)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = argv
    sys.path.insert(0, str(converter.parent))  # its `conversion` package, as a script has
    try:
        runpy.run_path(str(converter), run_name="__main__")
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else (0 if exited.code is None else 1)
        if code != 0:
            raise ExportFailed(f"the converter exited with code {code}", code) from None
    except Exception as error:
        traceback.print_exc()
        raise ExportFailed(f"the converter failed: {type(error).__name__}: {error}", 1) from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        sys.stdout.flush()
        sys.stderr.flush()


def quantize(source: Path, out: Path, quant: str, threads: int) -> None:
    """Quantizes the GGUF `source` into `out` as `quant` with llama.cpp."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[quant])
    params.nthread = threads
    print(f"export: quantizing to {quant}", flush=True)
    code = llama_cpp.llama_model_quantize(
        str(source).encode(), str(out).encode(), ctypes.byref(params)
    )
    if code != 0:
        raise ExportFailed(f"llama.cpp could not quantize to {quant} (code {code})", 3)


def export(args: argparse.Namespace, metrics: Metrics) -> None:
    """The three steps, timed, and the GGUF moved into place."""
    started = time.monotonic()
    converter = Path(args.converter)
    if not converter.is_file():
        raise ExportFailed(
            f"llama.cpp's converter is not at {converter}: install it with "
            "scripts/job-env.sh in the job venv"
        )
    source = MODEL_DIR
    if args.base is not None:  # a plain base model: nothing to merge
        source, base = base_dir(args.base), None
        metrics.write("begin", quant=args.quant, kind="base", base_model=args.base)
    else:
        if not MODEL_DIR.is_dir():
            raise ExportFailed(f"no {MODEL_DIR}/ in {Path.cwd()}: the run's model was not staged")
        lora = (MODEL_DIR / "adapter_config.json").is_file()
        if not lora and not (MODEL_DIR / "config.json").is_file():
            raise ExportFailed(f"{MODEL_DIR}/ holds neither a LoRA adapter nor a model config")
        base = base_model() if lora else None
        kind = "lora" if lora else "full"
        metrics.write("begin", quant=args.quant, kind=kind, base_model=base)
    WORK_DIR.mkdir(exist_ok=True)
    GGUF_DIR.mkdir(exist_ok=True)

    mark = time.monotonic()
    if base is not None:
        merged = WORK_DIR / "merged"
        merge(base, merged)
        gc.collect()  # the merged model's memory, before the converter loads it again
        metrics.write("phase", name="merge", seconds=round(time.monotonic() - mark, 3))
    else:
        merged = working_copy(source, WORK_DIR / "model")
        metrics.write("phase", name="merge", seconds=0.0, skipped=True)
    repair_tokenizer(merged)

    mark = time.monotonic()
    f16 = WORK_DIR / f"{args.name}-f16.gguf"
    convert(converter, merged, f16, args.title or args.name)
    metrics.write(
        "phase", name="convert", seconds=round(time.monotonic() - mark, 3), size=f16.stat().st_size
    )

    mark = time.monotonic()
    if args.quant == "f16":
        result = f16
        metrics.write("phase", name="quantize", seconds=0.0, skipped=True)
    else:
        result = WORK_DIR / f"{args.name}-{args.quant}.gguf"
        quantize(f16, result, args.quant, args.threads)
        metrics.write(
            "phase",
            name="quantize",
            seconds=round(time.monotonic() - mark, 3),
            size=result.stat().st_size,
        )
    final = GGUF_DIR / f"{args.name}-{args.quant}.gguf"
    os.replace(result, final)
    metrics.write(
        "end",
        gguf=final.as_posix(),
        size=final.stat().st_size,
        seconds=round(time.monotonic() - started, 3),
    )


def main() -> int:
    """Entry point: parses the arguments, exports, and returns the exit code."""
    parser = argparse.ArgumentParser(description="Merges, converts and quantizes a run's model.")
    parser.add_argument("--converter", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--quant", required=True)
    parser.add_argument("--name", required=True, help="the GGUF's name, without the quant")
    parser.add_argument("--title", help="the GGUF's general.name (default: --name)")
    parser.add_argument("--threads", type=int, default=0, help="0: as many as the cores")
    parser.add_argument("--keep-intermediate", action="store_true")
    parser.add_argument("--base", help="export this plain base model (a directory or a Hub id)")
    args = parser.parse_args()
    if args.quant not in FTYPES:
        print(
            f"export: unknown quant {args.quant!r}: use one of {', '.join(FTYPES)}", file=sys.stderr
        )
        return 2
    if "/" in args.name or args.name.startswith("."):
        print(f"export: {args.name!r} is not a file name", file=sys.stderr)
        return 2
    metrics = Metrics(METRICS_FILE)
    try:
        export(args, metrics)
    except ExportFailed as failure:
        print(f"export failed: {failure}", file=sys.stderr, flush=True)
        return failure.code
    finally:
        if not args.keep_intermediate:
            shutil.rmtree(WORK_DIR, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
