"""Train a stock Hugging Face causal LM with autoshard, launched the way clusters launch (torchrun).

    torchrun --standalone --nproc-per-node 4 examples/train_hf.py                  # mesh (dp, tp) = (2, 2)
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --torch-compile  # torch.compile backend
    torchrun --standalone --nproc-per-node 4 examples/train_hf.py --pp 2           # mesh (pp, dp) = (2, 2)
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --ckpt /tmp/ck --steps 10
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --ckpt /tmp/ck --steps 10 --resume

Every rank runs this file. It joins the process group torchrun describes in its environment (gloo on CPU,
nccl when CUDA is available), makes a ``DeviceMesh`` over the whole world (4 ranks: (2, 2) named
("dp", "tp"); 2 ranks: (2,) named ("dp",); ``--mesh 1x4`` etc. overrides), and builds a stock
``transformers.AutoModelForCausalLM.from_config(...)`` (a small ``LlamaConfig``, or ``--arch gpt2``) with the
config's defaults and the same seed on every rank.

The data is real text that ships with Python: the Zen of Python (``this``), the interpreter's LICENSE file and
some standard modules' docstrings, one document each, tokenized as bytes (ids 0..255, 256 is the padding),
cut into ``--seq`` long rows (a document's last row is right-padded: ``attention_mask`` 0, ``labels`` -100).
Step ``s`` reads the global batch ``s`` of a seeded shuffle, so it is the same wherever a run starts; each rank
takes the rows of its data-parallel coordinate (DDP's convention; ranks that differ only on "tp" read the
same rows).

The model is compiled with ``autoshard.compile(model, mesh)``, no example inputs: it is planned on the first
call from each rank's batch shard, and the AdamW optimizer built before that call steps the sharded
parameters. ``--torch-compile`` uses ``torch.compile(model, backend="autoshard", options={"mesh": mesh})``
instead (the parameter objects then hold this rank's shards; ``autoshard.as_dtensor(p)`` is the DTensor).
Either is called as HF users call the model, ``sharded(input_ids=..., attention_mask=..., labels=...)``;
both return the model's output, whose ``.loss`` (equal on every rank) is the global batch's.

``--pp N`` cuts the model into N pipeline stages (the mesh's outermost axis, "pp"; the stage mesh is the
rest). A pipelined model trains a step at a time over micro-batches: ``sharded.step(**global_batch)`` runs
forward and backward and returns the loss; every rank passes the global batch. (Checkpoints are not written
with ``--pp`` yet.)

Checkpoints (``--ckpt DIR``, every ``--ckpt-every`` steps and at the end) are ``torch.distributed.checkpoint``
directories ``DIR/step-000010`` holding the model's and the AdamW state as DTensors (each rank writes its
shards) and the step. ``get_state_dict(model, opt)`` gives both keyed by parameter name: after
``autoshard.compile`` the model's part is ``sharded.state_dict()`` (DTensor parameters); after the
``torch.compile`` backend the parameters and their AdamW moments are plain local shards, which
``autoshard.as_dtensor`` wraps without copying. ``dcp.load`` therefore loads in place.
Resuming (``--resume``: the latest complete checkpoint in ``--ckpt``) needs the sharded layout to load into,
and autoshard lays the parameters out when it plans, at the first call. So a resumed run first makes one
forward call on a batch (that plans; the loss is dropped), then builds its optimizer on the now sharded
parameters, lets ``get_state_dict`` allocate the optimizer state (a step at lr 0) and loads the checkpoint.
It then continues from the saved step with the losses an uninterrupted run has. The mesh and path can differ
from those of the saving run: DCP reshards on load (2 ranks with ``autoshard.compile`` -> 4 ranks with
``--torch-compile`` was checked). ``--steps`` counts the steps this launch runs.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import importlib
import io
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import autoshard

PAD = 256
VOCAB = 257
MODULES_WITH_DOCS = (
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "dataclasses",
    "functools",
    "heapq",
    "inspect",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "statistics",
    "string",
    "subprocess",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "zipfile",
)


# ---------------------------------------------------------------- data: text that ships with Python, as bytes
def corpus() -> list[str]:
    """Documents: the Zen of Python, the LICENSE file of this Python, standard modules' docstrings."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    docs = [codecs.decode(this.s, "rot13")]
    for root in (sys.prefix, sys.base_prefix, sysconfig.get_path("stdlib")):
        found = sorted(Path(root).glob("LICENSE*")) + sorted(Path(root).glob("lib/python3*/LICENSE*"))
        if found:
            docs.append(found[0].read_text(encoding="utf-8", errors="replace"))
            break
    for name in MODULES_WITH_DOCS:
        doc = importlib.import_module(name).__doc__
        if doc and len(doc) > 200:
            docs.append(doc.strip())
    return docs


def tokenize(docs: list[str], seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``seq`` byte ids and their attention mask; a document's tail is right-padded with PAD."""
    ids, masks = [], []
    for doc in docs:
        data = list(doc.encode("utf-8"))
        for start in range(0, len(data), seq):
            piece = data[start : start + seq]
            if len(piece) < 8:
                continue
            ids.append(piece + [PAD] * (seq - len(piece)))
            masks.append([1] * len(piece) + [0] * (seq - len(piece)))
    return torch.tensor(ids, dtype=torch.long), torch.tensor(masks, dtype=torch.long)


class Batches:
    """Global batch ``step`` of a seeded shuffle (a fresh permutation each epoch), and a rank's rows of it."""

    def __init__(self, seq: int, batch: int, seed: int) -> None:
        self.ids, self.mask = tokenize(corpus(), seq)
        self.batch, self.seed = batch, seed

    def global_batch(self, step: int) -> dict[str, torch.Tensor]:
        n = self.ids.shape[0]
        rows = []
        for k in range(step * self.batch, (step + 1) * self.batch):
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + k // n))
            rows.append(int(perm[k % n]))
        ids, mask = self.ids[rows], self.mask[rows]
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def shard(self, step: int, coord: int, dp: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {k: v.chunk(dp)[coord].to(device) for k, v in self.global_batch(step).items()}


# ---------------------------------------------------------------- distributed set-up
def init_distributed() -> torch.device:
    """The process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    # several ranks share this machine's cores: one intra-op thread each (or the cores divided among them)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    dist.init_process_group("gloo")
    return torch.device("cpu")


def make_mesh(spec: str | None, device: torch.device, pp: int = 1) -> tuple[DeviceMesh, int, int]:
    """The mesh over the whole world, this rank's data-parallel coordinate and the data-parallel size. With
    ``pp`` > 1 the outermost axis is "pp" (pipeline stages) and every rank reads the global batch."""
    world = dist.get_world_size()
    if pp > 1:
        if world % pp:
            raise SystemExit(f"--pp {pp} does not divide the world size {world}")
        rest = tuple(int(x) for x in spec.lower().split("x")) if spec else (world // pp,)
        names = {1: ("pp", "dp"), 2: ("pp", "dp", "tp")}.get(len(rest))
        if names is None or pp * math.prod(rest) != world:
            raise SystemExit(f"--pp {pp} --mesh {spec}: the stage mesh needs 1 or 2 axes of {world // pp} ranks")
        return init_device_mesh(device.type, (pp, *rest), mesh_dim_names=names), 0, 1
    if spec:
        shape = tuple(int(x) for x in spec.lower().split("x"))
    else:
        shape = (world // 2, 2) if world >= 4 and world % 2 == 0 else (world,)
    names = {1: ("dp",), 2: ("dp", "tp"), 3: ("dp_replicate", "dp_shard", "tp")}.get(len(shape))
    if names is None or math.prod(shape) != world:
        raise SystemExit(f"--mesh {spec}: need 1 to 3 axes whose product is the world size {world}")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    coord, dp = 0, 1
    for name, size in zip(names, shape):
        if name != "tp":  # the batch is split over every axis but "tp" (row-major over those axes)
            coord, dp = coord * size + mesh.get_local_rank(name), dp * size
    return mesh, coord, dp


# ---------------------------------------------------------------- the model, as HF users build it
def build_model(arch: str, hidden: int, layers: int, seq: int, seed: int, device: torch.device) -> nn.Module:
    import transformers

    if arch == "llama":
        cfg: Any = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max(seq, 128),
            pad_token_id=PAD,
        )
    else:
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=hidden,
            n_layer=layers,
            n_head=4,
            n_positions=max(seq, 128),
            bos_token_id=PAD,
            eos_token_id=PAD,
        )
    torch.manual_seed(seed)  # the same initial weights on every rank
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return model.train()


# ---------------------------------------------------------------- checkpoints (DCP)
def as_dtensors(
    model: nn.Module, state: dict[str, Any], optim: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``get_state_dict``'s state with every parameter and every parameter-shaped optimizer state as the DTensor
    it is a piece of: already so after ``autoshard.compile``; plain local shards after the ``torch.compile``
    backend (``autoshard.as_dtensor`` wraps them without a copy, so loading into them is loading in place)."""
    params = dict(model.named_parameters(remove_duplicate=False))

    def wrap(name: str, value: Any) -> Any:
        p = params.get(name)
        if p is None or isinstance(value, DTensor) or not isinstance(value, torch.Tensor) or value.shape != p.shape:
            return value
        return autoshard.as_dtensor(p, value)

    state = {k: wrap(k, v) for k, v in state.items()}
    optim = dict(optim, state={k: {s: wrap(k, v) for s, v in d.items()} for k, d in optim["state"].items()})
    return state, optim


def checkpoint_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    state, optim = as_dtensors(model, *get_state_dict(model, opt))
    return {"model": state, "optim": optim, "step": 0}


def save(root: str, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> str:
    path = os.path.join(root, f"step-{step:06d}")
    dcp.save(dict(checkpoint_state(model, opt), step=step), checkpoint_id=path)
    return path


def latest(root: str) -> str | None:
    # complete checkpoints only: DCP writes .metadata last
    found = sorted(p.parent for p in Path(root).glob("step-*/.metadata")) if os.path.isdir(root) else []
    return str(found[-1]) if found else None


def load(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load into the model's and optimizer's own tensors (in place); returns the step saved."""
    state = checkpoint_state(model, opt)  # get_state_dict allocates the optimizer's state (a step at lr 0)
    dcp.load(state, checkpoint_id=path)
    return int(state["step"])


# ---------------------------------------------------------------- training
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="steps this launch trains")
    ap.add_argument("--batch", type=int, default=8, help="global batch (rows), split over the data-parallel ranks")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mesh", help="mesh shape, e.g. 2x2 or 4 (default: (world/2, 2) from 4 ranks on, else (world,))")
    ap.add_argument(
        "--backend", choices=("eager", "inductor"), default="inductor", help="autoshard's per-rank compiler"
    )
    ap.add_argument("--torch-compile", action="store_true", help='torch.compile(model, backend="autoshard")')
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (the mesh's outermost axis, 'pp')")
    ap.add_argument("--microbatches", type=int, help="micro-batches per step with --pp (default: chosen)")
    ap.add_argument("--ckpt", help="checkpoint directory (DCP)")
    ap.add_argument("--ckpt-every", type=int, default=0, help="also save every N steps")
    ap.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --ckpt")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.resume and not args.ckpt:
        ap.error("--resume needs --ckpt DIR")
    if args.pp > 1 and (args.torch_compile or args.ckpt):
        ap.error("--pp runs with autoshard.compile and without --ckpt here (pipelined checkpoints: not yet)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = init_distributed()
    rank = dist.get_rank()
    mesh, coord, dp = make_mesh(args.mesh, device, args.pp)
    if args.batch % dp:
        raise SystemExit(f"--batch {args.batch} does not split over {dp} data-parallel ranks")

    def say(message: str) -> None:  # progress on rank 0 only
        if rank == 0:
            print(message)

    data = Batches(args.seq, args.batch, args.seed)
    model = build_model(args.arch, args.hidden, args.layers, args.seq, args.seed, device)
    say(
        f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
        f"{data.ids.shape[0]} rows of {args.seq} bytes; mesh {dict(zip(mesh.mesh_dim_names or (), mesh.shape))}"
    )

    if args.torch_compile:
        options = {"mesh": mesh, "backend": args.backend}
        sharded: nn.Module = torch.compile(model, backend="autoshard", options=options)  # type: ignore[assignment]
    elif args.pp > 1:  # pipeline stages: planned at the first step, on the global batch
        sharded = autoshard.compile(model, mesh, backend=args.backend, microbatches=args.microbatches)
    else:
        sharded = autoshard.compile(model, mesh, backend=args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)  # built before the first call: autoshard rebinds it

    start = 0
    path = latest(args.ckpt) if args.resume else None
    if args.resume and path is None:
        say(f"no checkpoint in {args.ckpt}: starting at step 0")
    elif path is not None:
        # any batch of the training shape plans: the parameters take their sharded layout (the loss is dropped)
        sharded(**data.shard(0, coord, dp, device))
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)  # on the sharded parameters, to load its state into
        start = load(path, model, opt)
        say(f"resumed at step {start} from {path}")

    for step in range(start, start + args.steps):
        batch = data.shard(step, coord, dp, device)
        torch.manual_seed(args.seed + step)  # dropout masks (if the config has dropout) wherever a run starts
        t0 = time.perf_counter()
        if args.pp > 1:  # forward and backward over the micro-batches; the gradients are then in .grad
            loss = sharded.step(**batch)
        else:
            out = sharded(**batch)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            if loss is None:
                raise SystemExit(f"the compiled model returned no loss: {type(out).__name__}({list(out.keys())})")
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = float(loss.detach())
        elapsed = time.perf_counter() - t0
        tokens = args.batch * args.seq
        note = "  (includes planning and compiling)" if step == start and path is None else ""
        say(
            f"step {step:4d}  loss {value:.4f}  tokens/s {tokens / elapsed:9.1f}  "
            f"step time {elapsed * 1e3:8.1f} ms{note}"
        )
        if not math.isfinite(value):
            raise SystemExit(f"loss is {value} at step {step}")
        last = step + 1 == start + args.steps
        if args.ckpt and (last or (args.ckpt_every and (step + 1) % args.ckpt_every == 0)):
            where = save(args.ckpt, step + 1, model, opt)
            say(f"saved step {step + 1} to {where}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
