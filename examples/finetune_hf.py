"""Fine-tune a Hugging Face causal LM with autoshard: a meta-device model, its weights read into the shards.

    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py                     # writes a small base first
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py --from ./my-llama    # a save_pretrained dir
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py --ckpt /tmp/ft --ckpt-every 5 --steps 20
    torchrun --standalone --nproc-per-node 1 examples/finetune_hf.py --ckpt /tmp/ft --resume --steps 10
    torchrun --standalone --nproc-per-node 2 examples/finetune_hf.py --mesh 1x2 --export /tmp/ft-hf
    torchrun --standalone --nproc-per-node 8 examples/finetune_hf.py --attn eager       # CUDA, float32
    python -c "import transformers as t; t.AutoModelForCausalLM.from_pretrained('/tmp/ft-hf')"  # one process

Every rank runs this file (gloo on CPU, nccl when CUDA is available; the mesh as in ``examples/train_hf.py``:
(dp,) on 2 ranks, (dp, tp) from 4 on, ``--mesh 1x2`` etc. overrides).

1. The model comes from a ``save_pretrained`` directory (``--from DIR``). Without ``--from``, rank 0 first writes a
   small one into ``--work-dir`` (``from_config`` of a small ``LlamaConfig``, or ``--arch gpt2``, with a fixed
   seed; ``--hidden``/``--layers`` size it) and the other ranks wait for it at a barrier.
2. ``AutoModelForCausalLM.from_config(config)`` is built under ``torch.device("meta")``: shapes, no values.
3. ``autoshard.compile(model, mesh, example_inputs=global_batch)`` plans ahead of time on global shapes and
   allocates only this rank's shard of each parameter; ``sharded.load_pretrained(DIR)`` reads each rank's
   slices of the safetensors into them.
4. Each step is ``loss = sharded.step(**global_batch)`` (forward and backward on the global batch; every rank
   passes the same values, the gradients land in ``.grad``), then AdamW on ``sharded.parameters()``.

The text is what ships with Python (``examples/train_hf.py``'s corpus: the Zen of Python, the LICENSE file, some
modules' docstrings) as byte ids 0..255 with 256 as the padding, so the model's vocabulary needs 257 entries.

``--ckpt DIR`` writes ``torch.distributed.checkpoint`` directories ``DIR/step-000010`` (model and AdamW state from
``get_state_dict(sharded, opt)``, keyed by the model's own names, each rank writing its shards) every
``--ckpt-every`` steps and at the end. ``--resume`` loads the latest complete one over the pretrained weights
(read as in a fresh run: they also fill the non-persistent buffers, such as rotary tables, that a checkpoint
lacks): the module is compiled first (the shards it loads into exist from ``compile`` on, since the example
inputs plan it ahead of time), ``get_state_dict`` allocates the AdamW state (a step at lr 0), ``dcp.load`` fills
both, ``set_state_dict`` puts them in place. DCP reshards on load, so the saving and resuming runs may differ in
ranks and mesh.

``--attn eager`` builds the model with transformers' eager attention: on CUDA in float32, SDPA picks its
memory-efficient kernel, whose backward autoshard cannot lower yet (checked on an H200 with torch 2.11).

``--export DIR`` writes a ``from_pretrained`` directory at the end (``sharded.save_pretrained``: config and
consolidated safetensors, no rank gathering the model). The last line is the loss on a fixed evaluation batch
(``eval_batch``), which ``from_pretrained(DIR)`` on one process reproduces. (It runs the compiled training program
forward, so a config with dropout, GPT-2's, evaluates with dropout on; Llama's has none.)
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import autoshard

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the data and mesh helpers of the training example
from train_hf import VOCAB, Batches, build_model, init_distributed, make_mesh  # noqa: E402

log = logging.getLogger("finetune_hf")


# ---------------------------------------------------------------- the pretrained checkpoint and the meta model
def write_base(root: str, arch: str, hidden: int, layers: int, seq: int, seed: int) -> str:
    """Rank 0 writes a small ``save_pretrained`` directory (a seeded ``from_config`` model) unless it is there;
    every rank returns its path after the barrier."""
    path = os.path.join(root, f"base-{arch}-h{hidden}-l{layers}-seed{seed}")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        tmp = f"{path}.tmp-{os.getpid()}"
        build_model(arch, hidden, layers, seq, seed, torch.device("cpu")).save_pretrained(tmp)
        if os.path.exists(path):  # another launch wrote it meanwhile
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, path)
        log.info("wrote a base checkpoint (%s, seed %d) to %s", arch, seed, path)
    dist.barrier()
    return path


def meta_model(path: str, attn: str | None = None) -> nn.Module:
    """The checkpoint's architecture from its config, built on the meta device (no memory, no init)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path, **({"attn_implementation": attn} if attn else {}))
    if config.vocab_size < VOCAB:
        raise SystemExit(f"{path}: vocab_size {config.vocab_size}; the byte-level data needs at least {VOCAB}")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.train()


def eval_batch(data: Batches) -> dict[str, torch.Tensor]:
    """A fixed global batch (rows spread evenly over the corpus), the same for any world size or run."""
    rows = torch.linspace(0, data.ids.shape[0] - 1, data.batch).round().long()
    ids, mask = data.ids[rows], data.mask[rows]
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@torch.no_grad()
def evaluate(sharded: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """The loss of the global ``batch`` (forward only): each rank passes its pieces of it."""
    return float(sharded(**sharded.shard_inputs(**batch)))


# ---------------------------------------------------------------- checkpoints (DCP, through torch's state-dict API)
def save(root: str, step: int, sharded: nn.Module, opt: torch.optim.Optimizer) -> str:
    path = os.path.join(root, f"step-{step:06d}")
    model_state, optim_state = get_state_dict(sharded, opt)
    dcp.save({"model": model_state, "optim": optim_state, "step": step}, checkpoint_id=path)
    return path


def latest(root: str) -> str | None:
    """The newest complete checkpoint (DCP writes ``.metadata`` last)."""
    found = sorted(p.parent for p in Path(root).glob("step-*/.metadata")) if os.path.isdir(root) else []
    return str(found[-1]) if found else None


def load(path: str, sharded: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Read a checkpoint (of any mesh) into the shards and the AdamW state; returns the step it was saved at."""
    model_state, optim_state = get_state_dict(sharded, opt)  # allocates AdamW's state: the layout to read into
    state: dict[str, Any] = {"model": model_state, "optim": optim_state, "step": -1}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(sharded, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


# ---------------------------------------------------------------- fine-tuning
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="source", metavar="DIR", help="save_pretrained directory to fine-tune")
    ap.add_argument("--work-dir", default="finetune_hf_work", help="where the base checkpoint goes without --from")
    ap.add_argument("--arch", choices=("llama", "gpt2"), default="llama", help="the base written without --from")
    ap.add_argument("--hidden", type=int, default=128, help="the base's hidden size")
    ap.add_argument("--layers", type=int, default=2, help="the base's layers")
    ap.add_argument("--steps", type=int, default=20, help="steps this launch trains")
    ap.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (0: none)")
    ap.add_argument("--mesh", help="mesh shape, e.g. 2 or 1x2 (default: (world/2, 2) from 4 ranks on, else (world,))")
    ap.add_argument("--attn", choices=("sdpa", "eager"), help="attention implementation (default: transformers')")
    ap.add_argument(
        "--backend", choices=("eager", "inductor"), default="inductor", help="autoshard's per-rank compiler"
    )
    ap.add_argument("--ckpt", help="checkpoint directory (DCP)")
    ap.add_argument("--ckpt-every", type=int, default=0, help="also save every N steps")
    ap.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --ckpt")
    ap.add_argument("--export", metavar="DIR", help="write a from_pretrained directory at the end")
    ap.add_argument("--seed", type=int, default=0, help="the base's weights and the data order")
    ap.add_argument("--verbose", action="store_true", help="autoshard's own log messages too")
    args = ap.parse_args(argv)
    if args.resume and not args.ckpt:
        ap.error("--resume needs --ckpt DIR")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = init_distributed()
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("autoshard").setLevel(logging.INFO if args.verbose and rank == 0 else logging.WARNING)
    mesh, _, _ = make_mesh(args.mesh, device)
    data = Batches(args.seq, args.batch, args.seed)

    source = args.source or write_base(args.work_dir, args.arch, args.hidden, args.layers, args.seq, args.seed)
    model = meta_model(source, args.attn)
    example = {k: v.to(device) for k, v in data.global_batch(0).items()}
    t0 = time.perf_counter()
    sharded = autoshard.compile(model, mesh, example_inputs=example, backend=args.backend)
    log.info(
        "%s: %.2fM parameters from %s; mesh %s; planned and compiled in %.1f s",
        type(model).__name__,
        sum(p.numel() for p in sharded.parameters()) / 1e6,
        source,
        dict(zip(mesh.mesh_dim_names or (), mesh.shape)),
        time.perf_counter() - t0,
    )
    opt = torch.optim.AdamW(sharded.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    # The pretrained weights, also when resuming: a checkpoint holds no non-persistent buffers (rotary tables),
    # and autoshard fills those only in load_pretrained / init_weights, not in set_state_dict (yet).
    sharded.load_pretrained(source)
    start = 0
    path = latest(args.ckpt) if args.resume else None
    if path is not None:
        start = load(path, sharded, opt)
        log.info("resumed at step %d from %s", start, path)
    elif args.resume:
        log.info("no checkpoint in %s: starting at step 0", args.ckpt)

    for step in range(start, start + args.steps):
        batch = {k: v.to(device) for k, v in data.global_batch(step).items()}
        torch.manual_seed(args.seed + step)  # dropout masks (GPT-2's config has dropout) wherever a run starts
        t0 = time.perf_counter()
        loss = float(sharded.step(**batch))
        if args.clip:
            autoshard.clip_grad_norm_(sharded.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        tokens = int(batch["attention_mask"].sum())
        log.info("step %4d  loss %.6f  tokens/s %9.1f  step time %8.1f ms", step, loss, tokens / elapsed, elapsed * 1e3)
        if not math.isfinite(loss):
            raise SystemExit(f"loss is {loss} at step {step}")
        last = step + 1 == start + args.steps
        if args.ckpt and (last or (args.ckpt_every and (step + 1) % args.ckpt_every == 0)):
            log.info("saved step %d to %s", step + 1, save(args.ckpt, step + 1, sharded, opt))

    if args.export:
        sharded.save_pretrained(args.export)
        log.info("exported to %s (AutoModelForCausalLM.from_pretrained reads it)", args.export)
    log.info("eval loss %.8f", evaluate(sharded, {k: v.to(device) for k, v in eval_batch(data).items()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
