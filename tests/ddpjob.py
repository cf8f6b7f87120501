"""A plain torch DDP training (gloo, on the CPU) under torchrun, as a shell
job: the launcher a training across nodes uses, without axolotl (whose
multi-process path wants GPUs). The training is scripts/ddp_step.py (the GPU
check's too): rank 0 writes the metrics (with each step's time) and the
output; every rank writes `rank-<N>.json` (its rank, the world size, its
node, its final weights' SHA-256); a stop makes every rank save its part of
the checkpoint on its own node."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tests.conftest import REPO, job_venv
from tests.shelljobs import ShellTrainer

DDP_STEP = REPO / "scripts" / "ddp_step.py"


class DdpTrainer(ShellTrainer):
    """scripts/ddp_step.py under torchrun, `steps` steps with `pause_s`
    after each: one process per node, the rendezvous from the node's
    environment (on one node alone, torchrun's standalone one)."""

    def __init__(self, steps: int, pause_s: float = 0.0) -> None:
        python = job_venv() / "bin" / "python"
        super().__init__(
            # one node alone (no rendezvous in its environment): torchrun's own, on a free port
            f'[ -n "$PET_NNODES" ] || set -- --standalone; OMP_NUM_THREADS=1 {python} -m '
            f'torch.distributed.run "$@" --nproc_per_node=1 ddp_step.py '
            f"--steps {steps} --step-s {pause_s}"
        )

    def prepare(self, local_run_dir: Path, ctx: Any) -> None:
        """Copies the training script next to the input."""
        super().prepare(local_run_dir, ctx)
        shutil.copyfile(DDP_STEP, local_run_dir / "ddp_step.py")
