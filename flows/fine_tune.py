"""Entry point of the `fine_tune` deployments (deployments/prefect.yaml):
trains, exports, then compares.
"""

from overbrainer_prefect.flows.pipeline import fine_tune

__all__ = ["fine_tune"]
