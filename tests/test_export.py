"""Exports: a real fine-tune of the tiny model (trained once for the session, with
the `train` flow's export option, tests/tiny_runs.py) merged, converted and quantized by real
llama.cpp on the local target and on an SSH target; the GGUFs retrieved,
verified, loaded by llama-cpp-python and asked a question. Also: reuse,
following an export again, a failing export job, the refusals that start
nothing, and the sizing of an export's disk."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from overbrainer_prefect.flows import ExportResult, RunResult, export
from overbrainer_prefect.kinds.export import NotExportable
from overbrainer_prefect.runs import InvalidRunId, Runs, RunState
from overbrainer_prefect.runs.ids import new_run_id
from overbrainer_prefect.sizing import disk_warning, export_disk, safetensors_weights
from overbrainer_prefect.trainers.export import (
    QUANTS,
    ExportSpec,
    UnknownQuant,
    check_quant,
    gguf_name,
    phases,
)
from overbrainer_prefect.trainers.spec import TrainingSpec
from tests.conftest import job_venv
from tests.flowrun import run
from tests.sshd import Sshd
from tests.test_ssh_flows import saved, ssh_target
from tests.tiny_runs import TinyRun

ASK_TIMEOUT_S = 120  # loading a tiny GGUF and 8 tokens take about a second
MAX_TOKENS = 8  # generation is capped by the caller: llama-cpp-python's own cap can be skipped

# Loads a GGUF with llama-cpp-python and asks it one question through its chat template,
# driving generation itself: a garbage model's byte-fallback tokens can make
# create_chat_completion ignore max_tokens until the KV cache is full.
ASK = """
import json, sys
import llama_cpp
path, question, cap = sys.argv[1], sys.argv[2], int(sys.argv[3])
llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=1, seed=0, verbose=False)
template = llm.metadata.get("tokenizer.chat_template", "")
prompt = "<|im_start|>user\\n" + question + "<|im_end|>\\n<|im_start|>assistant\\n"
tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
out = []
for token in llm.generate(tokens, temp=0.0, top_k=1):
    if token == llm.token_eos() or len(out) >= cap:
        break
    out.append(token)
print(json.dumps({"tokens": out, "text": llm.detokenize(out).decode(errors="replace"),
                  "template": "<|im_start|>" in template, "prompt_tokens": len(tokens)}))
"""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ask(gguf: Path, question: str) -> dict[str, Any]:
    """The tokens a GGUF answers `question` with, through llama-cpp-python in the job venv."""
    done = subprocess.run(
        [str(job_venv() / "bin" / "python"), "-c", ASK, str(gguf), question, str(MAX_TOKENS)],
        capture_output=True,
        text=True,
        timeout=ASK_TIMEOUT_S,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


@dataclass
class Trained:
    """The module's fine-tune: its target block, runs directory, and the result of
    the train flow that exported it to q8_0 after training."""

    target: str
    runs_dir: Path
    work: Path
    result: RunResult

    @property
    def run_id(self) -> str:
        return self.result.run_id

    def exports(self) -> list[Any]:
        return Runs(self.runs_dir).children(self.run_id, "export").list()


@pytest.fixture(scope="module")
def trained(tiny_run: TinyRun, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """A copy of the session's fine-tune of the tiny model (6 steps, exported to
    q8_0 by the train flow), for this module's exports."""
    copy = tiny_run.copied(tmp_path_factory.mktemp("export"))
    return Trained(target=copy.target, runs_dir=copy.runs_dir, work=copy.work, result=copy.result)


def read_artifact(key: str) -> Any:
    async def go() -> Any:
        async with get_client() as client:
            found = await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
            )
            return found[0] if found else None

    return run(go())


@pytest.mark.slow
def test_export_after_training_puts_a_verified_q8_0_gguf_in_the_run_result(
    trained: Trained,
) -> None:
    result = trained.result
    (record,) = trained.exports()
    assert record.state == RunState.SUCCEEDED and record.parent == trained.run_id
    assert record.trainer == "export" and record.spec == {
        "quant": "q8_0",
        "keep_intermediate": False,
    }
    assert result.export_id == record.id and result.gguf is not None
    assert result.gguf.path.startswith(f"exports/{record.id}/gguf/") and result.gguf.path.endswith(
        "-q8_0.gguf"
    )
    gguf = Path(result.run_dir) / result.gguf.path
    assert gguf.read_bytes()[:4] == b"GGUF"
    assert sha256(gguf) == result.gguf.sha256 and gguf.stat().st_size == result.gguf.size
    # the job ran in the target's exports dir and removed what it made on the way
    remote = Path(record.remote_dir)
    assert remote.parent == trained.work / "exports"
    assert (remote / "model" / "adapter_model.safetensors").is_file()
    assert not (remote / "work").exists() and not (remote / "export.json").exists()
    local = Runs(trained.runs_dir).children(trained.run_id, "export").run_dir(record.id)
    events = [json.loads(line) for line in (local / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["begin", "phase", "phase", "phase", "end"]
    assert [e["name"] for e in events if e["event"] == "phase"] == ["merge", "convert", "quantize"]
    assert all(e["seconds"] > 0 for e in events if e["event"] == "phase")
    # the run's summary shows the GGUF; the export has its own, with the SHA-256
    run_summary = read_artifact(f"run-{trained.run_id}-summary")
    assert result.gguf.sha256 in run_summary.data
    export_summary = read_artifact(f"export-{record.id}-summary")
    assert result.gguf.sha256 in export_summary.data and "q8_0" in export_summary.data


@pytest.mark.slow
def test_the_q8_0_gguf_loads_in_llama_cpp_and_answers_a_question(trained: Trained) -> None:
    assert trained.result.gguf is not None
    gguf = Path(trained.result.run_dir) / trained.result.gguf.path
    answer = ask(gguf, "What colour is the sky?")
    assert answer["template"], "the chat template did not travel into the GGUF"
    assert answer["prompt_tokens"] > 5
    assert 1 <= len(answer["tokens"]) <= MAX_TOKENS


@pytest.mark.slow
def test_a_second_export_of_the_same_run_and_quant_is_reused(trained: Trained) -> None:
    before = trained.exports()
    exports_dir = Runs(trained.runs_dir).children(trained.run_id, "export").root
    entries = sorted(p.name for p in exports_dir.iterdir())
    result = run(export(run_id=trained.run_id, quant="Q8_0", runs_dir=str(trained.runs_dir)))
    assert isinstance(result, ExportResult)
    assert result.reused and result.state == RunState.SUCCEEDED
    assert result.export_id == trained.result.export_id
    assert result.gguf is not None and trained.result.gguf is not None
    assert result.gguf.sha256 == trained.result.gguf.sha256
    assert set(result.phases) == {"merge", "convert", "quantize"}
    assert [r.id for r in trained.exports()] == [r.id for r in before]
    assert sorted(p.name for p in exports_dir.iterdir()) == entries


@pytest.mark.slow
def test_an_ended_export_followed_again_is_reported_from_its_record(trained: Trained) -> None:
    export_id = trained.result.export_id
    assert export_id is not None
    result = run(export(run_id=trained.run_id, export_id=export_id, runs_dir=str(trained.runs_dir)))
    assert isinstance(result, ExportResult)
    assert result.export_id == export_id and result.state == RunState.SUCCEEDED
    assert result.gguf is not None and result.gguf.path.endswith("-q8_0.gguf")


@pytest.mark.slow
def test_the_default_q4_k_m_export_falls_back_per_tensor_and_still_answers(
    trained: Trained,
) -> None:
    result = run(export(run_id=trained.run_id, runs_dir=str(trained.runs_dir)))
    assert isinstance(result, ExportResult)
    assert result.state == RunState.SUCCEEDED and not result.reused
    assert result.quant == "q4_k_m" and result.gguf is not None and result.gguf_path is not None
    assert result.gguf.path.endswith("-q4_k_m.gguf")
    gguf = Path(result.gguf_path)
    assert sha256(gguf) == result.gguf.sha256
    # 64-wide rows cannot take 256-wide k-quant blocks: llama.cpp falls back per tensor
    log = (Path(result.export_dir) / "job.log").read_text(errors="replace")
    assert "required fallback quantization" in log
    assert trained.result.gguf is not None
    assert result.gguf.size <= trained.result.gguf.size  # no larger than the q8_0 one
    answer = ask(gguf, "What colour is the grass?")
    assert 1 <= len(answer["tokens"]) <= MAX_TOKENS


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    server = Sshd.create(tmp_path / "sshd")
    with server:
        yield server


@pytest.mark.slow
def test_an_export_on_an_ssh_target_is_retrieved_and_verified(
    trained: Trained, sshd: Sshd, tmp_path: Path
) -> None:
    remote = tmp_path / "remote"
    name = saved(ssh_target(sshd, remote))
    result = run(
        export(run_id=trained.run_id, quant="f16", target=name, runs_dir=str(trained.runs_dir))
    )
    assert isinstance(result, ExportResult)
    assert result.state == RunState.SUCCEEDED, result.message
    assert result.target == f"overbrainer-ssh-target/{name}"
    assert result.gguf is not None and result.gguf_path is not None
    assert "quantize" in result.phases and result.phases["quantize"] == 0.0  # f16: not quantized
    there = remote / "exports" / result.export_id / result.gguf.path
    assert Path(result.gguf_path).read_bytes() == there.read_bytes()
    assert sha256(there) == result.gguf.sha256
    record = Runs(trained.runs_dir).children(trained.run_id, "export").load(result.export_id)
    assert record.target_kind == "ssh" and record.parent == trained.run_id
    assert len(ask(Path(result.gguf_path), "What colour is the sun?")["tokens"]) >= 1


def copy_run(trained: Trained, **changes: Any) -> str:
    """A copy of the module's run under a new ID, with its record changed."""
    runs = Runs(trained.runs_dir)
    new_id = new_run_id()
    shutil.copytree(
        runs.run_dir(trained.run_id), runs.run_dir(new_id), ignore=shutil.ignore_patterns("exports")
    )
    record = runs.load(trained.run_id).model_copy(update={"id": new_id, **changes})
    runs.save(record)
    return new_id


def rewrite_manifest(run_dir: Path, rel: str) -> None:
    """Records `rel`'s current content in the run's manifest, as if retrieved so."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for entry in manifest:
        if entry["path"] == rel:
            entry["sha256"] = sha256(run_dir / rel)
            entry["size"] = (run_dir / rel).stat().st_size
    (run_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.slow
def test_an_export_job_that_fails_fails_the_flow_naming_the_export_and_its_log(
    trained: Trained,
) -> None:
    run_id = copy_run(trained)
    run_dir = Runs(trained.runs_dir).run_dir(run_id)
    config = run_dir / "axolotl.yaml"
    config.write_text(
        config.read_text().replace(str(spec_base(trained)), "/nonexistent/base-model")
    )
    rewrite_manifest(run_dir, "axolotl.yaml")
    with pytest.raises(
        Exception, match=r"export \S+ of run \S+ failed: the job exited with code 2"
    ):
        run(export(run_id=run_id, quant="q8_0", runs_dir=str(trained.runs_dir)))
    (record,) = Runs(trained.runs_dir).children(run_id, "export").list()
    assert record.state == RunState.FAILED
    assert f"runs/{run_id}/exports/{record.id}/job.log" in (record.message or "")
    log = Runs(trained.runs_dir).children(run_id, "export").run_dir(record.id) / "job.log"
    assert "/nonexistent/base-model is not a directory on this target" in log.read_text()


def spec_base(trained: Trained) -> str:
    record = Runs(trained.runs_dir).load(trained.run_id)
    assert record.spec is not None
    return str(TrainingSpec.model_validate(record.spec).base_model)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("failed", r"is failed: only a succeeded run can be exported"),
        ("stopped", r"is stopped: only a succeeded run can be exported \(resume it"),
        ("not-retrieved", r"were not retrieved: retrieve them with the attach flow"),
        ("no-output", r"has no model in runs/\S+/output/"),
        ("changed-file", r"output/adapter_model.safetensors differs from the file retrieved"),
        ("missing-file", r"output/adapter_model.safetensors is missing on this machine"),
    ],
)
def test_a_run_that_cannot_be_exported_is_refused_in_one_line_and_nothing_is_created(
    trained: Trained, case: str, expected: str
) -> None:
    changes: dict[str, Any] = {}
    if case in ("failed", "stopped"):
        changes = {"state": RunState(case)}
    if case == "not-retrieved":
        changes = {"not_retrieved": "cannot reach the target"}
    run_id = copy_run(trained, **changes)
    run_dir = Runs(trained.runs_dir).run_dir(run_id)
    adapter = run_dir / "output" / "adapter_model.safetensors"
    if case == "no-output":
        shutil.rmtree(run_dir / "output")
        (run_dir / "manifest.json").write_text("[]")
    if case == "changed-file":
        adapter.write_bytes(adapter.read_bytes()[:-1] + b"\0")
    if case == "missing-file":
        adapter.unlink()
    with pytest.raises(NotExportable, match=expected) as caught:
        run(export(run_id=run_id, runs_dir=str(trained.runs_dir)))
    assert "\n" not in str(caught.value)
    assert not (run_dir / "exports").exists()


@pytest.mark.slow
def test_an_unknown_quant_is_refused_with_the_known_ones_before_anything(
    trained: Trained,
) -> None:
    before = [r.id for r in trained.exports()]
    with pytest.raises(UnknownQuant, match="'q3_k': use one of q4_k_m, q5_k_m, q8_0, f16"):
        run(export(run_id=trained.run_id, quant="q3_k", runs_dir=str(trained.runs_dir)))
    assert [r.id for r in trained.exports()] == before


def test_an_invalid_run_id_touches_nothing(prefect_server: None, tmp_path: Path) -> None:
    with pytest.raises(InvalidRunId):
        run(export(run_id="../etc", runs_dir=str(tmp_path / "runs")))
    assert not (tmp_path / "runs").exists()


# The parts that need no job: quant names, the spec, the GGUF's name, phases, sizing.


def test_quant_types_are_checked_and_spelled_lowercase() -> None:
    assert check_quant(" Q4_K_M ") == "q4_k_m"
    assert ExportSpec().quant == "q4_k_m"
    assert ExportSpec(quant="F16").quant == "f16"
    with pytest.raises(UnknownQuant, match="use one of q4_k_m, q5_k_m, q8_0, f16"):
        check_quant("iq2_xs")
    with pytest.raises(ValueError, match="unknown quant type 'q2_k'"):
        ExportSpec(quant="q2_k")


def test_the_gguf_is_named_for_its_base_and_run_in_file_safe_characters() -> None:
    run_id = "20261130-184143-h2vk"
    assert gguf_name(run_id, "/work/.cache/smollm2-base/") == f"smollm2-base-{run_id}"
    assert gguf_name(run_id, "HuggingFaceTB/SmolLM2-135M-Instruct") == (
        f"SmolLM2-135M-Instruct-{run_id}"
    )
    assert gguf_name(run_id, "../we ird:name") == f"we-ird-name-{run_id}"
    assert gguf_name(run_id, None) == f"model-{run_id}"


def test_phases_are_read_from_the_metrics_and_other_lines_ignored() -> None:
    text = "\n".join(
        [
            '{"event": "begin", "time": 1}',
            '{"event": "phase", "name": "merge", "seconds": 2.5}',
            "not json",
            '{"event": "phase", "name": "convert", "seconds": 6}',
            '{"event": "phase", "name": "quantize", "seconds": 0.0, "skipped": true}',
            '{"event": "end"}',
        ]
    )
    assert phases(text) == {"merge": 2.5, "convert": 6.0, "quantize": 0.0}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        count = 1
        for dim in shape:
            count *= dim
        size = count * {"F32": 4, "BF16": 2}[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * offset)


def test_an_exports_disk_is_sized_from_the_safetensors_headers(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    write_safetensors(base / "model-1.safetensors", {"a": ("BF16", [1000, 1000])})
    write_safetensors(base / "model-2.safetensors", {"b": ("BF16", [1000, 1000])})
    weights = safetensors_weights(base)
    assert weights is not None and weights.parameters == 2_000_000
    adapter = tmp_path / "output"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 1000)
    need = export_disk(adapter, str(base), "q4_k_m")
    assert need is not None
    assert need.base == need.merged == weights.size
    assert need.f16 == 4_000_000 and need.quantized == int(2_000_000 * QUANTS["q4_k_m"] / 8)
    assert need.total == 2 * weights.size + need.model + need.f16 + need.quantized
    assert "q4_k_m" in need.describe() and "2.0M parameters" in need.describe()
    assert disk_warning(need, None, "box") is None
    assert disk_warning(need, need.total, "box") is None
    warning = disk_warning(need, need.total - 1, "pod x")
    assert warning is not None and warning.startswith("pod x has") and "\n" not in warning
    # f16 needs no quantized copy; full weights need no base and no merge
    assert export_disk(adapter, str(base), "f16").quantized == 0  # type: ignore[union-attr]
    full = export_disk(base, None, "q8_0")
    assert full is not None and full.base == full.merged == 0 and full.parameters == 2_000_000
    # a base named by a Hub id is not at hand
    assert export_disk(adapter, "HuggingFaceTB/SmolLM2-135M-Instruct", "q8_0") is None


def test_the_tiny_model_is_sized_exactly(tiny: tuple[Path, Path]) -> None:
    model, _ = tiny
    weights = safetensors_weights(model)
    assert weights is not None
    assert 100_000 < weights.parameters < 200_000
    assert weights.size > weights.parameters * 4  # fp32 weights plus the header


@pytest.mark.slow
def test_an_export_whose_follower_died_is_finished_by_the_collector(
    trained: Trained, tmp_path: Path
) -> None:
    from overbrainer_prefect.flows.collect import collect
    from tests.test_runpod_pipeline import export_in_child
    from tests.test_train_flow import kill, wait_until

    run_id = copy_run(trained)
    exports = Runs(trained.runs_dir).children(run_id, "export")
    child = export_in_child(run_id, trained.target, trained.runs_dir, tmp_path / "child.log")

    def started() -> Any:
        return next((r for r in exports.list() if r.job is not None), None)

    try:
        wait_until(lambda: started() is not None, 120, "the export's job to start")
    finally:
        kill(child)  # its follower dies without a trace; the job runs on in its own session
    record = exports.load(started().id)
    assert record.state == RunState.RUNNING
    rows = run(collect(runs_dir=str(trained.runs_dir)))
    (row,) = [r for r in rows if r.run_id == record.id]
    assert row.kind == f"export {record.id} of run {run_id}" and row.retrieved
    assert row.action == "followed to its end" and row.state == RunState.SUCCEEDED
    saved = exports.load(record.id)
    assert saved.state == RunState.SUCCEEDED and saved.message is None
    local = exports.run_dir(record.id)
    manifest = json.loads((local / "manifest.json").read_text())
    (gguf,) = [e for e in manifest if e["path"].endswith(".gguf")]
    assert sha256(local / gguf["path"]) == gguf["sha256"]
    # the collected export is reused by the next export of the same quant
    again = run(export(run_id=run_id, quant="q8_0", runs_dir=str(trained.runs_dir)))
    assert again.reused and again.export_id == record.id


@pytest.mark.parametrize(
    ("body", "code", "said"),
    [
        ("import sys\nsys.exit(3)", 3, "the converter exited with code 3"),
        ("raise ValueError('no tensor')", 1, "the converter failed: ValueError: no tensor"),
        ("import sys\nopen(sys.argv[sys.argv.index('--outfile') + 1], 'w').write('x')", 0, ""),
    ],
)
def test_the_converter_runs_in_the_export_job_and_its_failure_is_one_line_with_its_code(
    tmp_path: Path, body: str, code: int, said: str
) -> None:
    from overbrainer_prefect.jobs.overbrainer_export import ExportFailed, convert

    converter = tmp_path / "convert_hf_to_gguf.py"
    converter.write_text(body + "\n")
    out = tmp_path / "out.gguf"
    argv, path = list(sys.argv), list(sys.path)
    if code:
        with pytest.raises(ExportFailed) as failed:
            convert(converter, tmp_path / "model", out, "t")
        assert failed.value.code == code and str(failed.value) == said
    else:
        convert(converter, tmp_path / "model", out, "t")
        assert out.read_text() == "x"
    assert sys.argv == argv and sys.path == path  # the job's own state is left as it was
