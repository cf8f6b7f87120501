"""Entry point of the `attach` deployments (deployments/prefect.yaml):
follows a started run again, then retrieves and verifies its files.
"""

from overbrainer_prefect.flows.train import attach

__all__ = ["attach"]
