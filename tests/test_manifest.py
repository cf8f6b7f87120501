"""The SHA-256 manifest of a run directory and the verification of a download."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from overbrainer_prefect.executors import ExecError, FileDigest
from overbrainer_prefect.executors.manifest import (
    is_excluded,
    local_manifest,
    manifest_files,
    verify,
)


def write(root: Path, rel: str, content: bytes) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


def digest(rel: str, content: bytes) -> FileDigest:
    return FileDigest(path=rel, size=len(content), sha256=hashlib.sha256(content).hexdigest())


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    write(root, "output/adapter.bin", b"weights")
    write(root, "output/config.json", b"{}")
    write(root, "output/checkpoint-10/state.bin", b"state")
    write(root, "output/logs/events.txt", b"events")
    write(root, "output/tmp.part", b"partial")
    write(root, "job.log", b"line 1\n")
    write(root, "config.yml", b"base_model: x\n")
    return root


def test_patterns_match_a_component_the_whole_path_or_a_leading_directory() -> None:
    assert is_excluded("output/checkpoint-10/state.bin", ["checkpoint-*"])
    assert is_excluded("output/tmp.part", ["*.part"])
    assert is_excluded("output/a/b.tmp", ["output/*.tmp"])
    assert is_excluded("output/logs/events.txt", ["output/logs"])
    assert not is_excluded("output/adapter.bin", ["checkpoint-*", "*.part", "output/logs"])
    assert not is_excluded("output/adapter.bin", [])
    assert not is_excluded("output/Adapter.BIN", ["*.bin"])


def test_the_manifest_lists_every_file_once_with_its_size_and_sha256(run_dir: Path) -> None:
    manifest = local_manifest(run_dir, ["output", "job.log", "output/adapter.bin"], [])
    assert [file.path for file in manifest] == [
        "job.log",
        "output/adapter.bin",
        "output/checkpoint-10/state.bin",
        "output/config.json",
        "output/logs/events.txt",
        "output/tmp.part",
    ]
    assert manifest[1] == digest("output/adapter.bin", b"weights")
    assert manifest[0] == digest("job.log", b"line 1\n")


def test_the_manifest_leaves_out_excluded_files_and_missing_entries(run_dir: Path) -> None:
    manifest = local_manifest(
        run_dir, ["output", "job.log", "missing", "missing/too"], ["checkpoint-*", "*.part", "logs"]
    )
    assert [file.path for file in manifest] == [
        "job.log",
        "output/adapter.bin",
        "output/config.json",
    ]
    assert local_manifest(run_dir, ["output/tmp.part"], ["*.part"]) == []


def test_the_run_directory_itself_is_an_entry(run_dir: Path) -> None:
    paths = manifest_files(run_dir, ["."], ["output"])
    assert paths == ["config.yml", "job.log"]


def test_a_large_file_is_hashed_in_pieces(tmp_path: Path) -> None:
    content = os.urandom(9 << 20) + b"tail"  # more than two hash chunks
    write(tmp_path, "model.safetensors", content)
    assert local_manifest(tmp_path, ["model.safetensors"], []) == [
        digest("model.safetensors", content)
    ]


@pytest.mark.parametrize("entry", ["../secrets", "/etc", "output/../../x"])
def test_an_entry_outside_the_run_directory_is_refused(run_dir: Path, entry: str) -> None:
    with pytest.raises(ExecError) as raised:
        local_manifest(run_dir, [entry], [])
    assert raised.value.action == "manifest"
    assert "relative path without '..'" in str(raised.value)


def test_links_out_of_the_run_directory_are_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    write(outside, "private.key", b"key")
    root = tmp_path / "run"
    write(root, "output/adapter.bin", b"weights")
    (root / "output" / "key.link").symlink_to(outside / "private.key")
    (root / "output" / "dir.link").symlink_to(outside)
    (root / "output" / "inside.link").symlink_to(root / "output" / "adapter.bin")
    (root / "escape").symlink_to(outside)
    assert manifest_files(root, ["output", "escape", "escape/private.key"], []) == [
        "output/adapter.bin",
        "output/inside.link",
    ]
    assert local_manifest(root, ["output/inside.link"], []) == [
        digest("output/inside.link", b"weights")
    ]


def test_verify_accepts_exactly_the_files_of_the_manifest(run_dir: Path) -> None:
    manifest = local_manifest(run_dir, ["output", "job.log"], ["checkpoint-*"])
    verify(run_dir, ["output", "job.log"], ["checkpoint-*"], manifest)


def test_verify_names_a_file_missing_locally(tmp_path: Path) -> None:
    write(tmp_path, "job.log", b"w")
    manifest = [digest("job.log", b"w"), digest("output/adapter.bin", b"w")]
    with pytest.raises(ExecError) as raised:
        verify(tmp_path, ["output", "job.log"], [], manifest)
    assert str(raised.value) == 'cannot verify: "output/adapter.bin" is missing locally'
    assert raised.value.action == "verify"


def test_verify_names_a_file_that_differs_from_the_target(tmp_path: Path) -> None:
    write(tmp_path, "job.log", b"w")
    write(tmp_path, "output/adapter.bin", b"x")
    manifest = [digest("job.log", b"w"), digest("output/adapter.bin", b"w")]
    with pytest.raises(ExecError) as raised:
        verify(tmp_path, ["output", "job.log"], [], manifest)
    assert str(raised.value) == (
        'cannot verify: "output/adapter.bin" differs from the target (SHA-256 mismatch)'
    )


def test_verify_names_a_local_file_that_is_not_on_the_target(tmp_path: Path) -> None:
    for rel in ("job.log", "output/adapter.bin", "output/extra.bin"):
        write(tmp_path, rel, b"w")
    write(tmp_path, "output/checkpoint-1/x.bin", b"excluded, so not extra")
    manifest = [digest("job.log", b"w"), digest("output/adapter.bin", b"w")]
    with pytest.raises(ExecError) as raised:
        verify(tmp_path, ["output", "job.log"], ["checkpoint-*"], manifest)
    assert str(raised.value) == 'cannot verify: "output/extra.bin" is not on the target'
