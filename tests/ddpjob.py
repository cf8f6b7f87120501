"""A plain torch DDP training (gloo, on the CPU) under torchrun, as a shell
job: the launcher a training across nodes uses, without axolotl (whose
multi-process path wants GPUs). Rank 0 writes the metrics (with each step's
time) and the output; every rank writes `rank<N>.json`: its rank, the world
size, its node and whether its weights equal every other rank's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.conftest import job_venv
from tests.shelljobs import ShellTrainer

DDP_STEP = """
import json, os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
steps = int(sys.argv[1])
pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
log = open("metrics.jsonl", "a") if rank == 0 else None
if log:
    log.write(json.dumps({"event": "begin", "max_steps": steps}) + "\\n")
for step in range(1, steps + 1):
    x = torch.randn(8, 4) + rank  # each rank its own data: DDP averages their gradients
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if log:
        line = {"event": "log", "step": step, "loss": loss.item(), "time": time.time()}
        log.write(json.dumps(line) + "\\n")
        log.flush()
    time.sleep(pause)
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
every = [torch.zeros_like(weights) for _ in range(world)]
dist.all_gather(every, weights)
same = all(torch.equal(w, every[0]) for w in every)
node = os.environ.get("PET_NODE_RANK", "0")
with open(f"rank{rank}.json", "w") as out:
    json.dump({"rank": rank, "world": world, "node": node, "same": same}, out)
if rank == 0:
    os.makedirs("output", exist_ok=True)
    torch.save(model.module.state_dict(), "output/adapter_model.safetensors")
dist.destroy_process_group()
"""


class DdpTrainer(ShellTrainer):
    """A plain torch DDP training (gloo, on the CPU) under torchrun: one
    process per node, the rendezvous from the node's environment (on one
    node alone, torchrun's standalone one)."""

    def __init__(self, steps: int, pause_s: float = 0.0) -> None:
        python = job_venv() / "bin" / "python"
        super().__init__(
            # one node alone (no rendezvous in its environment): torchrun's own, on a free port
            f'[ -n "$PET_NNODES" ] || set -- --standalone; OMP_NUM_THREADS=1 {python} -m '
            f'torch.distributed.run "$@" --nproc_per_node=1 ddp_step.py {steps} {pause_s}'
        )

    def prepare(self, local_run_dir: Path, ctx: Any) -> None:
        """Writes the training script next to the input."""
        super().prepare(local_run_dir, ctx)
        (local_run_dir / "ddp_step.py").write_text(DDP_STEP)
