"""How a trainer puts what its job reads into the local run directory: the
job script this package ships (`overbrainer_prefect/jobs/<module>.py`, under
`scripts/`), and the files it is given (a model, GGUFs), hard-linked when they
can be so that a multi-GB file is not copied."""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

SCRIPTS_DIR = "scripts"
"""Where a run directory holds its job scripts."""


def copy_job_script(local_run_dir: Path, module: str) -> None:
    """Copies the job script `overbrainer_prefect/jobs/<module>.py` under `scripts/`."""
    scripts = local_run_dir / SCRIPTS_DIR
    scripts.mkdir(parents=True, exist_ok=True)
    script = resources.files("overbrainer_prefect.jobs").joinpath(f"{module}.py")
    (scripts / f"{module}.py").write_bytes(script.read_bytes())


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link to `source` at `target` (free for a multi-GB file), else a
    copy (another file system). Raises OSError when neither can be made."""
    target.unlink(missing_ok=True)
    try:
        target.hardlink_to(source)
    except OSError:
        shutil.copyfile(source, target)
