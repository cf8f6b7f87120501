"""Code that runs inside a job, on the target, in the job venv: the run directory
gets a copy of these modules. Nothing in the orchestrator imports them."""
