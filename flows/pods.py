"""Entry point of the `pods` deployments (deployments/prefect.yaml):
lists, removes or sweeps the Runpod pods of this project.
"""

from overbrainer_prefect.flows.pods import pods

__all__ = ["pods"]
