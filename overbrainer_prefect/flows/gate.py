"""What Prefect shows of a fine-tune's gate: a night whose model the gate kept
back ends in a `Completed` state of its own name, `Not delivered`, so that it
is told apart at a glance in the flow runs list and the run's page, and can be
filtered on by state name; its message says
why once, and the refusal is kept in the run's `deliveries.json`, where the
`runs` flow reads it.

A state name rather than a tag: in Prefect a state's type drives the
orchestration and its name is for people to read, so a
`Completed` named `Not delivered` stays a success for automations, retries and
the parent flow, shows in the state badge where people look, and is set by
the same return that ends the flow run, where a tag would need a second call
to the API after the run is created.
"""

from __future__ import annotations

import asyncio

from prefect.runtime import flow_run
from prefect.states import Completed

from overbrainer_prefect.delivery.deliver import keep_back
from overbrainer_prefect.evaluation.gate import GateDecision
from overbrainer_prefect.flows.results import AnyState
from overbrainer_prefect.runs.store import Runs

NOT_DELIVERED = "Not delivered"
"""The name of the `Completed` state of a fine-tune whose model the gate kept back."""


async def not_delivered(
    runs: Runs, run_id: str, gate: GateDecision, again: str, data: object
) -> AnyState:
    """Records the gate's refusal in run `run_id`'s `deliveries.json` and returns
    the flow run's final state: `Completed`, named `Not delivered`, its message
    `not delivered: <reason>; ...` with what was kept and `again`, the command
    that delivers it anyway, and `data` its result.

    Raises RecordError when the refusal cannot be recorded.
    """
    line = await asyncio.to_thread(keep_back, runs, run_id, gate, again, flow_run.id)
    return Completed(name=NOT_DELIVERED, message=line, data=data)
