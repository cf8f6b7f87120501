"""Entry point of the `stop` deployments (deployments/prefect.yaml):
asks a run's job for a checkpoint and a stop.
"""

from overbrainer_prefect.flows.train import stop

__all__ = ["stop"]
