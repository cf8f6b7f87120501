"""overbrainer-prefect."""
