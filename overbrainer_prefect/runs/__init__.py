"""Runs: their IDs, their records in `runs/<id>/`, and the steps of a run."""

from overbrainer_prefect.runs.ids import is_valid_run_id, new_run_id
from overbrainer_prefect.runs.store import (
    RECORD_FILE,
    InvalidRunId,
    ResumedFrom,
    RunNotFound,
    RunRecord,
    Runs,
    RunsError,
    RunState,
)
from overbrainer_prefect.store.records import InvalidRecord, RecordError, RecordIoError

__all__ = [
    "RECORD_FILE",
    "InvalidRecord",
    "InvalidRunId",
    "RecordError",
    "RecordIoError",
    "ResumedFrom",
    "RunNotFound",
    "RunRecord",
    "RunState",
    "Runs",
    "RunsError",
    "is_valid_run_id",
    "new_run_id",
]
