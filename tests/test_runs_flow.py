"""The `runs` flow lists runs, exports and compares with their kind, state,
target, steps, final loss, spend, age and next step, filtered by state; a bare
target name that two block types share is refused in one line naming both.
On the session's real Prefect server (the test harness)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest

from overbrainer_prefect.blocks import AmbiguousTarget, LocalTarget, SshTarget, load_target
from overbrainer_prefect.flows.runs import runs
from overbrainer_prefect.kinds.listing import age_text
from overbrainer_prefect.runpod.pod import PodRecord
from overbrainer_prefect.runs.store import Runs, RunState
from overbrainer_prefect.steps import start as start_step
from overbrainer_prefect.timestamps import rfc3339

pytestmark = pytest.mark.usefixtures("prefect_server")


def made(
    root: Path,
    state: RunState,
    *,
    losses: list[float] = (),
    kind: str = "training",
    target_kind: str = "local",
) -> str:
    """A run recorded in `root` in `state`, with a metrics file of `losses`."""
    store = Runs(root)
    record = start_step.create(store, target="local/box", target_kind=target_kind, workdir="/w")
    record.state = state
    store.save(record)
    lines = [json.dumps({"event": "begin", "step": 0, "max_steps": len(losses)})]
    lines += [
        json.dumps({"event": "log", "step": i, "loss": loss})
        for i, loss in enumerate(losses, start=1)
    ]
    (store.run_dir(record.id) / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return record.id


def test_the_runs_flow_lists_runs_and_their_exports_newest_first_filtered_by_state(
    tmp_path: Path,
) -> None:
    done = made(tmp_path, RunState.SUCCEEDED, losses=[2.0, 1.23456])
    time.sleep(1.1)  # IDs and creation times are to the second
    stopped = made(tmp_path, RunState.STOPPED, losses=[3.0], target_kind="runpod")
    store = Runs(tmp_path)
    exports = store.children(done, "export")
    export = start_step.create(
        exports,
        target="local/box",
        target_kind="local",
        workdir="/w",
        trainer="export",
        parent=done,
    )
    pod = PodRecord(run_id=stopped, host_key="ssh-ed25519 AAAA", cost_per_hour=0.5)
    pod.created_unix = int(time.time()) - 3600
    pod.deleted_unix = pod.created_unix + 1800
    pod.save(store)

    everything = asyncio.run(runs(runs_dir=str(tmp_path)))
    assert [(r.id, r.kind, r.state) for r in everything.rows] == [
        (export.id, "export", RunState.PREPARING),
        (stopped, "training", RunState.STOPPED),
        (done, "training", RunState.SUCCEEDED),
    ]
    by_id = {r.id: r for r in everything.rows}
    assert (by_id[done].steps, by_id[done].final_loss) == (2, 1.23456)
    assert by_id[stopped].spend_usd == pytest.approx(0.25)
    assert f"resume_from={stopped}" in by_id[stopped].next
    assert by_id[export.id].parent == done and f"export_id={export.id}" in by_id[export.id].next

    only = asyncio.run(runs(state=[RunState.SUCCEEDED], runs_dir=str(tmp_path)))
    assert [r.id for r in only.rows] == [done]
    capped = asyncio.run(runs(runs_dir=str(tmp_path), limit=1))
    assert len(capped.rows) == 1 and capped.left_out == 2


def test_the_runs_flow_on_an_empty_directory_lists_nothing(tmp_path: Path) -> None:
    listing = asyncio.run(runs(runs_dir=str(tmp_path / "none")))
    assert listing.rows == [] and listing.left_out == 0


def test_age_reads_as_a_person_says_it() -> None:
    now = time.time()
    created = rfc3339()
    assert age_text(created, now + 5).endswith(" s")
    assert age_text(created, now + 600) == "10 min"
    assert age_text(created, now + 5 * 3600) == "5 h"
    assert age_text(created, now + 3 * 86400) == "3 d"


def test_a_bare_target_name_two_block_types_share_is_refused_naming_both(tmp_path: Path) -> None:
    name = f"box-{uuid.uuid4().hex[:6]}"
    LocalTarget(job_venv="/v", work_dir=str(tmp_path)).save(name, overwrite=True)
    SshTarget(host="127.0.0.1", job_venv="/v", work_dir="/w").save(name, overwrite=True)
    with pytest.raises(AmbiguousTarget) as refused:
        asyncio.run(load_target(name))
    message = str(refused.value)
    assert "\n" not in message
    assert f"{LocalTarget.get_block_type_slug()}/{name}" in message
    assert f"{SshTarget.get_block_type_slug()}/{name}" in message
    ref, block = asyncio.run(load_target(f"{LocalTarget.get_block_type_slug()}/{name}"))
    assert isinstance(block, LocalTarget) and ref.endswith(f"/{name}")
