"""Entry point of the `train` deployments (deployments/prefect.yaml):
fine-tunes a model on a target block.
"""

from overbrainer_prefect.flows.train import train

__all__ = ["train"]
