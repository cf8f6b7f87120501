"""Entry point of the `collect` deployments (deployments/prefect.yaml):
finishes the runs whose follower is gone.
"""

from overbrainer_prefect.flows.collect import collect

__all__ = ["collect"]
