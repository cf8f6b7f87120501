"""Entry point of the `spend` deployment (deployments/prefect.yaml): where the
money went in the last 30 days (by day, deployment and target) and what is
left of today's and this month's budgets.
"""

from overbrainer_prefect.flows.spend import spend

__all__ = ["spend"]
