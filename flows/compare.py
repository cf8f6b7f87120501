"""Entry point of the `compare` deployments (deployments/prefect.yaml):
asks the base and the tuned model the same questions.
"""

from overbrainer_prefect.flows.compare import compare

__all__ = ["compare"]
