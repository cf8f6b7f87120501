"""Entry point of the `follow` deployment (deployments/prefect.yaml): the one
follower of the runs directory, which follows every job while the flow runs
that started them wait suspended, and resumes them.
"""

from overbrainer_prefect.flows.follow import follow

__all__ = ["follow"]
