"""Deployment steps for `prefect.yaml` (deployments/prefect.yaml)."""
