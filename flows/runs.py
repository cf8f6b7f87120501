"""Entry point of the `runs` deployment (deployments/prefect.yaml): lists the
runs with their kind, state, target, steps, final loss, spend, age and next step.
"""

from overbrainer_prefect.flows.runs import runs

__all__ = ["runs"]
