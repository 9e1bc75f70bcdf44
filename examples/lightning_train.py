"""Train a small stock Hugging Face Llama with PyTorch Lightning's Trainer, sharded by autoshard: one line.

    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py            # autoshard
    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --ddp      # Lightning's own DDP
    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --fabric   # Fabric, parallelize_fn
    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --ckpt /tmp/lt --steps 10
    torchrun --standalone --nproc-per-node 2 examples/lightning_train.py --ckpt /tmp/lt --steps 10 --resume

The ``LightningModule`` is what one writes for DDP: a ``transformers.LlamaForCausalLM`` built from a small
``LlamaConfig`` (vocabulary 128, hidden 64, 2 layers, 4 heads, 2 KV heads; nothing downloaded), or ``--arch plain``
a plain PyTorch module returning its loss; ``training_step`` returns the model's loss, ``configure_optimizers``
an AdamW over ``self.parameters()``. The one line that differs from the DDP run is the Trainer's strategy:
``AutoshardStrategy()`` (``autoshard/integrations/lightning.py``) compiles the module at its first call from each
rank's rows and trains the global batch's loss and gradients, with the plan autoshard chooses for Lightning's mesh.
``--fabric`` runs the same with Fabric and Lightning's own ``ModelParallelStrategy(parallelize_fn=...)``, given
autoshard's ``parallelizer(...)`` as it is (``--ddp`` with it: Fabric's DDP).

Everything is seeded (``--seed``): the model's initial weights and the data, which is built here: rows of
``--seq`` tokens counting up by a step that depends on the row, so the loss goes down. Lightning's distributed
sampler (shuffled, ``set_epoch`` each epoch) gives each of the ranks its own ``--batch`` rows per step, as DDP's
does; an epoch is ``--epoch-steps`` steps. ``--ckpt DIR`` saves a checkpoint every ``--ckpt-every`` steps
(``ModelCheckpoint(every_n_train_steps=...)``; with autoshard a folder of DCP shards plus ``meta.pt``) and
``--resume`` goes on from the latest one in DIR, to ``--steps`` steps in all, with the losses an uninterrupted run
has. (Lightning resumes a checkpoint written at an epoch's last step exactly this way; one written by
``on_train_epoch_end`` restarts the next epoch with other rows, with DDP too.)

Lightning's validation runs as usual: before training (its sanity check, which makes the first call to the
model an evaluation under ``inference_mode``) and after each epoch, ``--val-batches`` batches of other rows per
rank through ``validation_step`` (the model in eval mode).

Rank 0 prints ``step N loss L tokens/s T step time S ms`` per optimizer step and ``validation after step N loss
L``, each loss the global batch's (with DDP: the ranks' losses averaged, which is the same for rows of equal
length), and at the end one JSON line: ``{"mode": ..., "losses": {"0": ..., ...}, "validation": {...}}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from autoshard.integrations.lightning import AutoshardStrategy, parallelizer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ddp", action="store_true", help="Lightning's own DDP instead of autoshard")
    p.add_argument("--fabric", action="store_true", help="Fabric with ModelParallelStrategy(parallelize_fn=...)")
    p.add_argument("--arch", choices=("llama", "plain"), default="llama")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps in all (a resumed run: up to this)")
    p.add_argument("--epoch-steps", type=int, default=5, help="optimizer steps per epoch")
    p.add_argument(
        "--val-batches",
        type=int,
        default=2,
        help="validation batches per rank at each epoch's end (and Lightning's sanity check before training); 0: none",
    )
    p.add_argument("--batch", type=int, default=4, help="rows per rank per step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="eager", help="autoshard's backend: eager (quick to compile) or inductor")
    p.add_argument(
        "--recipe",
        default=None,
        help="autoshard: plan this manual recipe (ddp, fsdp, zero1, tp, ...) instead of a free choice",
    )
    p.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    p.add_argument("--clip", type=float, default=0.0, help="Trainer(gradient_clip_val=...)")
    p.add_argument("--clip-algorithm", default="norm", choices=("norm", "value"))
    p.add_argument("--precision", default="32-true", help="Trainer(precision=...): 32-true or bf16-mixed")
    p.add_argument("--ckpt", default=None, help="save a checkpoint every --ckpt-every steps here")
    p.add_argument("--ckpt-every", type=int, default=5, help="optimizer steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="go on from the latest checkpoint in --ckpt")
    p.add_argument("--verbose", action="store_true", help="autoshard's log (planning, compiling) on rank 0")
    return p.parse_args()


# --------------------------------------------------------------------------- the model and the data
def llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(config)


class PlainLM(nn.Module):
    """A plain PyTorch next-token model whose forward returns its loss."""

    def __init__(self, vocab: int = 128, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        logits = self.head(self.norm(h + self.mix(h)))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


class CountingRows(Dataset):
    """Row i: tokens start, start + k, start + 2k, ... (mod 128), start and k drawn from ``seed``."""

    def __init__(self, rows: int, seq: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed + 1)
        start = torch.randint(0, 128, (rows, 1), generator=g)
        step = torch.randint(1, 4, (rows, 1), generator=g)
        self.ids = (start + step * torch.arange(seq)) % 128

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(input_ids=batch["input_ids"], labels=batch["labels"])
    return out if isinstance(out, torch.Tensor) else out.loss


class CausalLM(L.LightningModule):
    """What one writes for DDP: nothing here knows about autoshard."""

    def __init__(self, arch: str, lr: float) -> None:
        super().__init__()
        self.model = llama() if arch == "llama" else PlainLM()
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return loss_of(self.model, batch)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = loss_of(self.model, batch)  # the model in eval mode, under inference_mode
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


# --------------------------------------------------------------------------- the losses, as rank 0 prints them
def global_mean(loss: torch.Tensor) -> float:
    """The loss averaged over the ranks: DDP's is this rank's rows', autoshard's the global batch's already (equal on
    every rank); for rows of equal length both are the global batch's."""
    value = loss.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


class StepPrinter:
    """The global batch's loss and time per optimizer step; rank 0 prints them."""

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens = tokens_per_step
        self.losses: dict[int, float] = {}
        self.val: dict[int, float] = {}  # validation loss after that many steps (0: Lightning's sanity check)
        self._val: list[float] = []
        self._sum = 0.0
        self._start: float | None = None

    def micro_batch(self, loss: torch.Tensor) -> None:
        self._sum += global_mean(loss)

    def begin(self) -> None:
        """A micro-batch starts: the step's clock starts at its first."""
        if self._start is None:
            self._start = time.perf_counter()

    def step_done(self, step: int) -> None:
        took = time.perf_counter() - (self._start or time.perf_counter())
        self.losses[step] = self._sum
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"step {step} loss {self._sum!r} tokens/s {self.tokens / max(took, 1e-9):.0f} step time "
                f"{took * 1e3:.1f} ms",
                flush=True,
            )
        self._sum, self._start = 0.0, None

    def val_batch(self, loss: torch.Tensor) -> None:
        self._val.append(global_mean(loss))

    def val_done(self, step: int) -> None:
        self.val[step] = sum(self._val) / len(self._val)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"validation after step {step} loss {self.val[step]!r}", flush=True)
        self._val = []


class PrintSteps(L.Callback):
    def __init__(self, printer: StepPrinter) -> None:
        self.printer = printer

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.printer.begin()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.printer.micro_batch(outputs["loss"])  # divided by accumulate_grad_batches already
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.printer.step_done(trainer.global_step - 1)

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.printer.val_batch(outputs)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.printer.val_done(trainer.global_step)


# --------------------------------------------------------------------------- the two loops
def latest_checkpoint(folder: str) -> str | None:
    found = sorted(Path(folder).glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    return str(found[-1]) if found else None


def train_with_trainer(args: argparse.Namespace, world: int, printer: StepPrinter) -> None:
    L.seed_everything(args.seed, verbose=False)
    module = CausalLM(args.arch, args.lr)
    rows = CountingRows(world * args.batch * args.accumulate * args.epoch_steps, args.seq, args.seed)
    loader = DataLoader(rows, batch_size=args.batch, shuffle=True)
    val_rows = CountingRows(world * args.batch * args.val_batches, args.seq, args.seed + 1000)
    val_loader = DataLoader(val_rows, batch_size=args.batch) if args.val_batches else None
    callbacks: list[L.Callback] = [PrintSteps(printer)]
    if args.ckpt:
        callbacks.append(
            ModelCheckpoint(dirpath=args.ckpt, filename="{step}", save_top_k=-1, every_n_train_steps=args.ckpt_every)
        )
    options = {"backend": args.backend, **({"recipe": args.recipe} if args.recipe else {})}
    strategy = "ddp" if args.ddp else AutoshardStrategy(**options)  # <- the one line
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=args.steps,
        precision=args.precision,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip or None,
        gradient_clip_algorithm=args.clip_algorithm,
        logger=False,
        enable_checkpointing=bool(args.ckpt),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    ckpt_path = latest_checkpoint(args.ckpt) if args.resume and args.ckpt else None
    if args.resume and ckpt_path is None:
        raise SystemExit(f"--resume: no step=N.ckpt checkpoint in {args.ckpt}")
    if ckpt_path and int(os.environ.get("RANK", "0")) == 0:
        print(f"resuming from {ckpt_path}", flush=True)
    trainer.fit(module, loader, val_loader, ckpt_path=ckpt_path)


def train_with_fabric(args: argparse.Namespace, world: int, printer: StepPrinter) -> None:
    if args.ckpt or args.accumulate != 1 or args.clip or args.precision != "32-true":
        raise SystemExit("--fabric takes the model, data, optimizer and --steps options only")
    options = {"backend": args.backend, **({"recipe": args.recipe} if args.recipe else {})}
    strategy = (
        "ddp"
        if args.ddp
        else ModelParallelStrategy(
            parallelize_fn=parallelizer(**options), data_parallel_size=world, tensor_parallel_size=1
        )
    )
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(args.seed, verbose=False)
    model = CausalLM(args.arch, args.lr).model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    rows = CountingRows(world * args.batch * args.epoch_steps, args.seq, args.seed)
    loader = fabric.setup_dataloaders(DataLoader(rows, batch_size=args.batch, shuffle=True))
    step, epoch = 0, 0
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            printer.begin()
            loss = loss_of(model, batch)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            printer.micro_batch(loss)
            printer.step_done(step)
            step += 1
            if step == args.steps:
                break
        epoch += 1


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    if args.verbose and int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("autoshard").setLevel(logging.INFO)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    printer = StepPrinter(world * args.batch * args.accumulate * args.seq)
    (train_with_fabric if args.fabric else train_with_trainer)(args, world, printer)
    if int(os.environ.get("RANK", "0")) == 0:
        mode = ("fabric-" if args.fabric else "trainer-") + ("ddp" if args.ddp else "autoshard")
        print(
            json.dumps(
                {
                    "mode": mode,
                    "arch": args.arch,
                    "losses": {str(k): v for k, v in printer.losses.items()},
                    "validation": {str(k): v for k, v in printer.val.items()},
                }
            ),
            flush=True,
        )
    # Lightning's DDP reducer holds the gloo group: freed at interpreter exit, after the group's worker threads,
    # it can abort the process ("terminate called without an active exception", torch 2.13). Freed here, with the
    # trainer gone and its cycles collected, the group is the last thing to go
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
