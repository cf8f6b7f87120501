"""A plain torch DDP training (gloo, on the CPU) under torchrun, as a shell
job: the launcher a training across nodes uses, without axolotl (whose
multi-process path wants GPUs). The training is scripts/ddp_step.py (the GPU
check's too): rank 0 writes the metrics (with each step's time) and the
output; every rank writes `rank-<N>.json` (its rank, the world size, its
node, its final weights' SHA-256); every `save_steps`, and at a stop, every
rank saves its part of the checkpoint on its own node, rank 0's marker last;
a run resumed from one has every rank load its own part."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tests.conftest import REPO, job_venv
from tests.shelljobs import ShellTrainer

DDP_STEP = REPO / "scripts" / "ddp_step.py"


class DdpTrainer(ShellTrainer):
    """scripts/ddp_step.py under torchrun, `steps` steps with `pause_s`
    after each, a checkpoint every `save_steps` (0: only for a stop), from
    the checkpoint `resume_from` (relative to the run directory; each node
    its own part there) when given: one process per node, the rendezvous
    from the node's environment (on one node alone, torchrun's standalone
    one). Its checkpoints are kept while it trains (`checkpoint_dir`)."""

    checkpoint_dir = "output"

    def __init__(
        self, steps: int, pause_s: float = 0.0, save_steps: int = 0, resume_from: str | None = None
    ) -> None:
        python = job_venv() / "bin" / "python"
        resume = f" --resume {resume_from}" if resume_from else ""
        super().__init__(
            # one node alone (no rendezvous in its environment): torchrun's own, on a free port
            f'[ -n "$PET_NNODES" ] || set -- --standalone; OMP_NUM_THREADS=1 {python} -m '
            f'torch.distributed.run "$@" --nproc_per_node=1 ddp_step.py '
            f"--steps {steps} --step-s {pause_s} --save-steps {save_steps}{resume}"
        )

    def prepare(self, local_run_dir: Path, ctx: Any) -> None:
        """Copies the training script next to the input."""
        super().prepare(local_run_dir, ctx)
        shutil.copyfile(DDP_STEP, local_run_dir / "ddp_step.py")
