"""autoshard quickstart: plan a small GPT on a 2 x 2 mesh of 4 CPU gloo ranks, print the plan, train a few
steps and print each step's loss next to the single-device loss.

    python examples/quickstart.py            # 4 forked gloo ranks on this CPU, no GPU, nothing downloaded
    python examples/quickstart.py --steps 10 --backend eager
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import autoshard
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs

CFG = GPTConfig(n_layer=4, d_model=256, n_head=8, vocab=1024, seq_len=64, bias=False)
BATCH = 8


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def single_device_losses(steps: int, lr: float) -> list[float]:
    model = make_model()
    tokens, targets = gpt_example_inputs(CFG, BATCH)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def worker(rank: int, world: int, store_path: str, steps: int, lr: float, backend: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store_path, world))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tokens, targets = gpt_example_inputs(CFG, BATCH)
    sharded = autoshard.compile(
        make_model(), mesh, example_inputs=(tokens, targets), constraints={"inputs": {"dp": Shard(0)}}, backend=backend
    )
    if rank == 0:
        print(autoshard.report(sharded.plan), flush=True)
        reference = single_device_losses(steps, lr)
    opt = torch.optim.AdamW(sharded.parameters(), lr=lr)
    for step in range(steps):
        loss = sharded(*sharded.shard_inputs(tokens, targets))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(
                f"step {step}  loss {loss.item():.6f}  single-device {reference[step]:.6f}  "
                f"diff {abs(loss.item() - reference[step]):.2e}",
                flush=True,
            )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--backend", choices=("inductor", "eager"), default="inductor")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            worker,
            args=(4, os.path.join(tmp, "store"), args.steps, args.lr, args.backend),
            nprocs=4,
            start_method="fork",
        )


if __name__ == "__main__":
    main()
