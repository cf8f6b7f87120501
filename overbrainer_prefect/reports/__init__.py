"""What a job's outcome says, built from its records alone (no Prefect): the
results the flows return and the markdown they publish."""
