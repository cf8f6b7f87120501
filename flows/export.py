"""Entry point of the `export` deployments (deployments/prefect.yaml):
exports a succeeded run to a GGUF.
"""

from overbrainer_prefect.flows.export import export

__all__ = ["export"]
