"""Code that runs inside a job, on the target, in the job venv: the run directory
gets a copy of these modules. The orchestrator imports only the judge prompt's
`render` from `overbrainer_generate` (evaluation/template.py), so that both
ends render it alike."""
