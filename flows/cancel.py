"""Entry point of the `cancel` deployments (deployments/prefect.yaml):
cancels a run's job.
"""

from overbrainer_prefect.flows.train import cancel

__all__ = ["cancel"]
