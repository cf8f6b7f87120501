"""The flow runs that started jobs as the follower sees them
(`overbrainer_prefect.flowruns`), on the real (ephemeral) Prefect server:
which of the flow runs it follows were cancelled, asked in one request for
all of them."""

from __future__ import annotations

import asyncio
from uuid import UUID

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.states import Cancelled, Cancelling, Completed, Paused, Running, State

from overbrainer_prefect import flowruns
from overbrainer_prefect.flowruns import cancelled_among


@flow(name="stand-in-followed")
def followed() -> None:
    """A flow whose runs stand for the flow runs of followed jobs."""


async def _in(state: State[object]) -> UUID:
    async with get_client() as client:
        made = await client.create_flow_run(followed)
        answer = await client.set_flow_run_state(made.id, state, force=True)
        assert answer.state is not None and answer.state.type == state.type, answer
        return made.id


def test_the_cancelled_ones_among_the_followed_flow_runs_are_read_at_once(
    prefect_server: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        cancelling, cancelled = await _in(Cancelling()), await _in(Cancelled())
        others = [await _in(s) for s in (Running(), Paused(reschedule=True), Completed())]
        asked = [str(i) for i in (cancelling, cancelled, *others)]
        found = await cancelled_among([*asked, None, "not-a-flow-run"])
        assert set(found) == {str(cancelling), str(cancelled)}, found
        assert all(at > 0 for at in found.values())
        assert await cancelled_among([]) == {}
        # more than one request's worth: every one is asked
        monkeypatch.setattr(flowruns, "CANCELLED_READ_AT_ONCE", 2)
        assert set(await cancelled_among(asked)) == {str(cancelling), str(cancelled)}

    asyncio.run(scenario())
