"""Entry point of the `evaluate` deployment (deployments/prefect.yaml): scores a
run's GGUF against its base model's on held-out items and controls.
"""

from overbrainer_prefect.flows.evaluate import evaluate

__all__ = ["evaluate"]
