"""Pretrain the small GPT-2-style model data-parallel: one process per device, launched by torchrun.

    torchrun --standalone --nproc_per_node 2 train_ddp.py --steps 20     # 2 gloo ranks on the CPU, nccl on GPUs
    python train_ddp.py --steps 3                                         # one process, no process group

Each rank draws its own batches (the run seed and its rank pick the text); DistributedDataParallel
averages the gradients, so every rank takes the same optimizer step. Rank 0 logs the loss averaged
over the ranks.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig
from train import configure_optimizer, make_get_batch, train_step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps to run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    distributed = "RANK" in os.environ  # set by torchrun
    if distributed:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
        rank, world_size, local_rank = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    else:
        rank, world_size, local_rank = 0, 1, 0
    device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    cfg = GPTConfig()
    model = GPT(cfg).to(device)
    optimizer = configure_optimizer(model)
    if distributed:
        model = DDP(model, device_ids=[local_rank] if device.startswith("cuda") else None)
    get_batch = make_get_batch(args.seed * world_size + rank, device, cfg)
    model.train()
    for step in range(args.steps):
        batch = get_batch(step)
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, batch)
        if distributed:
            dist.all_reduce(loss)
            loss = loss / world_size
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} time_ms {elapsed_ms:.1f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
