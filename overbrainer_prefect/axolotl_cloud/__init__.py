"""axolotl's `--cloud` on this product's targets: `axolotl train config.yml
--cloud cloud.yml` with `provider: overbrainer` in cloud.yml.

`launcher` is what axolotl loads (its `axolotl.cloud_providers` entry point):
a thin shim in axolotl's environment that imports nothing of Prefect, torch or
the rest of this package, and hands the work to the orchestrator's Python
(`python -m overbrainer_prefect.axolotl_cloud`). `cloud` checks the cloud
YAML, `mapping` turns axolotl's YAML into a `TrainingSpec`, `console` runs the
`train` flow and streams it to the terminal.
"""
