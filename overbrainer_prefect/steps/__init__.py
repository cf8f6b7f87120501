"""The steps of a job, whatever its target and its kind: create and start
(`start`), follow (`follow`), retrieve and verify (`retrieve`), cancel, stop
and fail (`end`). Every step is recorded in its record before it is taken, so a
job can be picked up again by another process from its record alone. Nothing
here knows about Prefect: the flows pass a `Reporter` that publishes what
happens."""
