"""`python -m overbrainer_prefect.axolotl_cloud train|preprocess|lm_eval REQUEST.json`: what the
`overbrainer` launcher of axolotl's `--cloud` runs in the orchestrator's Python."""

from __future__ import annotations

import sys

from overbrainer_prefect.axolotl_cloud.console import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
