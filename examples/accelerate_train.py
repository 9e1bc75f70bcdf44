"""A training loop written with Accelerate, on a model autoshard compiled: one line added.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py              # autoshard's plan
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --reference  # Accelerate's DDP
    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py --recipe fsdp    # torchrun works too
    torchrun --standalone --nproc-per-node 4 examples/accelerate_train.py --mesh 2x2 --recipe fsdp+tp

(On a machine without CUDA, ``--multi_gpu`` is how ``accelerate launch`` starts several processes without MPI: it
runs torchrun, and ``Accelerator(cpu=True)`` makes them CPU processes over gloo; ``--cpu`` alone starts one.)

The loop is Accelerate's documented one: ``accelerator.prepare(model, optimizer, dataloader)``, then per batch
``loss = model(**batch).loss``, ``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_``, ``optimizer.step()``
and ``scheduler.step()``. The added line is ``model = autoshard.compile(model, mesh)`` before ``prepare`` (left
out by ``--reference``). ``prepare`` returns the compiled module as it is (no DDP: it is distributed already);
its data loader gives every process its own rows, which autoshard takes as the global batch; the loss and the
gradients are the global batch's, which DDP's averaging of per-rank means equals here because every row counts
the same number of targets (no ``-100`` labels).

The model is a stock ``LlamaForCausalLM`` from a small config (no download); rank 0 prints ``losses [json]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
from accelerate import Accelerator
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, get_linear_schedule_with_warmup

import autoshard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", action="store_true", help="Accelerate's own DDP, without autoshard")
    ap.add_argument("--recipe", help="a recipe instead of the solved plan (fsdp, fsdp+tp, ...)")
    ap.add_argument("--mesh", help="mesh shape, e.g. 2 or 2x2 (axes dp, tp); default (processes,)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4, help="rows per process per step")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--bf16", action="store_true", help="Accelerator(mixed_precision='bf16')")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="bf16" if args.bf16 else "no")
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    if not args.reference:
        shape = tuple(int(x) for x in args.mesh.split("x")) if args.mesh else (accelerator.num_processes,)
        mesh = init_device_mesh(accelerator.device.type, shape, mesh_dim_names=("dp", "tp")[: len(shape)])
        model = autoshard.compile(model, mesh, **({"recipe": args.recipe} if args.recipe else {}))  # the one line

    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (512, args.seq), generator=g)]
    loader = DataLoader(rows, batch_size=args.batch, shuffle=True, generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    losses = []
    model.train()
    for step, batch in enumerate(loader):
        if step == args.steps:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())  # the mean over processes, as DDP logs it
    if accelerator.is_main_process:
        print("losses " + json.dumps(losses), flush=True)
    # the reference's DDP holds the process group too: freed before the group ends, not at interpreter exit (where
    # torch 2.13's gloo group can deadlock, its worker thread waiting for the GIL its destructor holds)
    del model, optimizer
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


if __name__ == "__main__":
    main()
