#!/bin/sh
# Registers the block types of overbrainer-prefect on the Prefect server that
# PREFECT_API_URL (or the active profile) names, so the UI can create them.
# A server or worker with the package installed finds them by itself too,
# through the package's `prefect.collections` entry point.
set -eu
exec prefect block register -m overbrainer_prefect.blocks
