"""A few DDP training steps of a tiny linear model: one process of a torchrun
job, for the checks of a multi-process or multi-node launch (the CPU tests
through tests/ddpjob.py, the GPU check, the multi-node bench). Runs in the
job venv (torch).

usage: torchrun ... scripts/ddp_step.py [--steps N] [--step-s S] [--save-steps K]
                                       [--resume DIR]

Joins the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR... in
its environment): NCCL on a GPU, gloo on a CPU. Each step trains on data of
its own rank, so the gradients differ until DDP's all-reduce makes them one.
Writes, in the working directory:

- `rank-<global rank>.json`: the rank, the local rank, the world size, the
  backend, the node's rank (torchrun's GROUP_RANK), the step it resumed
  at (0: none), each step's loss, the
  SHA-256 of the final weights (equal on every rank when DDP synchronised
  them) and when the first step ended (epoch seconds);
- `metrics.jsonl`, on global rank 0 only (the metrics plugin's rule): a
  begin event, one log event a step, an end event;
- `output/adapter_model.safetensors`, on global rank 0 only: the final
  weights (the run's required output, as an adapter is).

`--step-s` sleeps that long after each step (a run long enough to be
stopped or lost mid-way). A checkpoint is saved every `--save-steps` steps,
and when rank 0 finds `stop.request` in the working directory after a step
(it tells every rank: the metrics plugin's rule; then all stop at that
step): every rank saves its part, its model, optimizer and data state, in
`output/checkpoint-<step>/rank-<global rank>.pt` on its own node (a shard
per node, as a sharded checkpoint is), then, once every rank saved,
rank 0 writes `trainer_state.json` there last (its marker: the checkpoint
is complete, as axolotl's trainer writes it last). `--resume DIR` has every
rank load its own part, `DIR/rank-<global rank>.pt`, and go on from the
step after it (a rank without its part exits 1). Exits 1 when a collective
fails (a peer is gone).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

STOP_FILE = "stop.request"  # as the trainer names it (trainers/base.py)
MARKER = "trainer_state.json"  # written last into a complete checkpoint (steps/checkpoints.py)
TIMEOUT_S = 60  # a collective whose peer is gone fails after this at the latest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Linear(8, 1).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
    metrics = open("metrics.jsonl", "a", encoding="utf-8") if rank == 0 else None  # noqa: SIM115

    def event(**fields: object) -> None:
        if metrics is not None:
            metrics.write(json.dumps({**fields, "time": time.time()}) + "\n")
            metrics.flush()

    start = 0
    if args.resume is not None:  # this rank's own part of the checkpoint
        state = torch.load(f"{args.resume}/rank-{rank}.pt", map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        data.set_state(state["data"])
        start = int(state["step"])

    def save(step: int) -> str:
        checkpoint = f"output/checkpoint-{step}"
        os.makedirs(checkpoint, exist_ok=True)
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "data": data.get_state(),
            "step": step,
        }
        torch.save(state, f"{checkpoint}/rank-{rank}.pt")
        dist.barrier()  # every rank's part is written before the marker
        if rank == 0:
            with open(f"{checkpoint}/{MARKER}", "w", encoding="utf-8") as out:
                json.dump({"global_step": step, "world_size": world}, out)
        return checkpoint

    event(
        event="begin", step=start, max_steps=args.steps, processes=world, gpus=world if cuda else 0
    )
    losses: list[float] = []
    first_step_at = None
    checkpoint = None
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(16, 8, generator=data).to(device)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients across every rank here
        optimizer.step()
        losses.append(loss.item())
        first_step_at = first_step_at or time.time()
        event(event="log", step=step, loss=losses[-1], max_steps=args.steps)
        stop = torch.tensor([int(rank == 0 and os.path.exists(STOP_FILE))], device=device)
        dist.broadcast(stop, src=0)  # rank 0's decision, for every rank
        if stop.item():
            checkpoint = save(step)
            break
        if args.save_steps and step % args.save_steps == 0:
            save(step)
        if args.step_s:
            time.sleep(args.step_s)
    dist.barrier()
    weights = repr([p.detach().cpu().tolist() for p in model.parameters()]).encode()
    result = {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world,
        "backend": backend,
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),
        "resumed_at": start,
        "losses": losses,
        "weights_sha256": hashlib.sha256(weights).hexdigest(),
        "first_step_at": first_step_at,
    }
    with open(f"rank-{rank}.json", "w", encoding="utf-8") as out:
        json.dump(result, out)
    if rank == 0:
        os.makedirs("output", exist_ok=True)
        torch.save(model.state_dict(), "output/adapter_model.safetensors")
    stopped = checkpoint is not None
    event(
        event="end",
        step=start + len(losses),
        stopped=stopped,
        checkpoint=checkpoint,
        train_loss=losses[-1] if losses else None,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
