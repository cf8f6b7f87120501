"""Entry point of the `deliver` deployment (deployments/prefect.yaml): pushes a
run's GGUF to an Ollama server and/or its adapter and GGUF to the Hugging Face Hub.
"""

from overbrainer_prefect.flows.deliver import deliver

__all__ = ["deliver"]
