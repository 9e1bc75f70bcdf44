"""A model fuzzer: random small training programs, planned and run on a simulated mesh, compared with one device.

A :class:`FuzzCase` is drawn deterministically from ``(seed, index)``: a mesh ((2,), (4,), (2, 2) or (2, 1, 2)), a
batch, a sequence length and a stack of blocks drawn from the ops users train (linear, matmul, einsum, convolution,
layer/RMS/batch/group norm, attention with and without masks, embedding, gather/scatter/index ops, reductions,
views/permutes/slices/cat, elementwise, a custom ``autograd.Function``), widths that mesh axes often do not divide
(3, 5, 6, 7, 12, 96 ...), a scalar loss, and the compile options (a recipe, an input constraint, a memory budget
as a fraction of the parameters' training state, a cluster).

:func:`run_case` trains the model on one device (fp32, :data:`STEPS` AdamW steps, the same seeded init), then
compiles it with ``autoshard.compile`` under ``LocalTensorMode`` (every rank in this process, a fake process
group) and trains the same steps; it compares the loss of every step, every first-step gradient and the final
parameters, and returns a :class:`FuzzResult`: ``ok``; ``refused`` (planning raised an ``autoshard`` error that
says what it refused: acceptable); or a failure: ``crash-reference`` (the fuzzer's own model failed on one
device), ``crash-planning``, ``crash-running`` (a Python error, or an ``autoshard`` error once the program was
compiled) or ``mismatch`` (a wrong loss, gradient or parameter, or ranks that disagree). :func:`reproducer` is
the one-line command that runs a case again (``benchmarks/fuzz.py``).
"""

from __future__ import annotations

import logging
import math
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoshard import _torch_compat as tc
from autoshard.cluster.meshes import fake_world, mesh_names
from autoshard.errors import AutoshardError

logger = logging.getLogger(__name__)

MESHES = ((2,), (4,), (2, 2), (2, 1, 2))
WIDTHS = (3, 4, 5, 6, 7, 8, 12, 16, 96)  # most of them no mesh axis divides
BATCHES = (2, 3, 4, 5, 6, 8)
SEQS = (1, 3, 4, 5, 7, 8, 12)
BLOCKS = ("linear", "matmul", "einsum", "conv", "layernorm", "rmsnorm", "batchnorm", "groupnorm", "attention",
          "gather", "index", "scatter", "reduce", "view", "slice_cat", "elementwise", "custom")
LOSSES = ("mse", "cross_entropy", "mean_square")
RECIPES = ("ddp", "zero1", "zero2", "fsdp", "tp", "fsdp+tp")
# how many variants a block kind has (its ``variant``): attention's are its masks (none, causal, boolean, additive)
VARIANTS = {"conv": 2, "attention": 4, "index": 3, "scatter": 2, "reduce": 5, "view": 2, "slice_cat": 3,
            "elementwise": 4}
STEPS = 3
LR = 1e-3
# as tests/harness.assert_close_to_reference compares: loss and gradients at 1e-4 relative / 1e-5 absolute, the
# parameters after AdamW at lr / 5 absolute (AdamW turns last-bit differences of near-zero gradients into steps)
RTOL, ATOL, PARAM_ATOL = 1e-4, 1e-5, 2e-4


@dataclass(frozen=True)
class Block:
    """One block of a fuzzed model: its op ``kind``, the feature width it outputs, its ``variant`` (which form of
    the op: see :data:`VARIANTS`) and a size ``arg`` (attention heads, group-norm groups, conv kernel, a divisor)."""

    kind: str
    width: int
    variant: int = 0
    arg: int = 1


@dataclass(frozen=True)
class FuzzCase:
    """One fuzz case, drawn by :func:`draw_case` from ``(seed, index)``. ``vocab`` is the token vocabulary of an
    embedding input (0: a float input of ``width`` features); ``out`` the width of the output layer (classes for
    the cross-entropy); ``budget`` the memory budget as a fraction of the parameters' training state (fp32
    parameter, gradient and two AdamW moments); ``constraint`` "batch" or "seq" pins the inputs' dim 0 or 1 on
    the outermost mesh axis. ``autotune`` (never drawn: ``benchmarks/fuzz.py --autotune k`` sets it) compiles with
    ``autotune=k``, which plans, compiles and runs the solver's k best plans and the recipes, keeping the fastest;
    ``experts`` (never drawn either: ``--experts e``) adds a top-2 mixture of ``e`` experts with capacity routing and
    its load-balancing loss (``autoshard.models.moe.MoEFeedForward``) before the output layer."""

    seed: int
    index: int
    mesh: tuple[int, ...]
    batch: int
    seq: int
    vocab: int
    width: int
    blocks: tuple[Block, ...]
    loss: str
    out: int
    recipe: str | None = None
    constraint: str | None = None
    budget: float | None = None
    cluster: str | None = None
    autotune: int | None = None  # compile(..., autotune=k): the solver's k best plans and the recipes, timed
    experts: int | None = None  # a mixture of this many experts before the output layer (the zoo's MoE layer)


@dataclass(frozen=True)
class FuzzResult:
    """What :func:`run_case` found: ``kind`` is "ok", "refused", "crash-planning", "crash-running" or "mismatch";
    ``message`` one line; ``detail`` the traceback or every mismatch."""

    seed: int
    index: int
    kind: str
    message: str
    seconds: float
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.kind not in ("ok", "refused")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _draw_block(rng: random.Random, width: int) -> Block:
    kind = rng.choice(BLOCKS)
    variant = rng.randrange(VARIANTS.get(kind, 1))
    new = rng.choice(WIDTHS[:-1]) if rng.random() < 0.9 else WIDTHS[-1]
    if kind in ("linear", "matmul", "einsum", "conv", "gather", "scatter") or (kind, variant) == ("index", 0):
        return Block(kind, new, variant, rng.choice((1, 3)) if kind == "conv" else 1)
    if kind == "attention":
        return Block(kind, new, variant, rng.choice((1, 2, 3, 4, 6)))
    if kind == "slice_cat" and variant == 2:
        return Block(kind, width + rng.randint(1, width), variant)
    return Block(kind, width, variant, rng.choice(_divisors(width)))  # groups (group norm), a divisor (view)


def draw_case(seed: int, index: int) -> FuzzCase:
    """The case ``index`` of the run seeded ``seed`` (the same on every machine and Python)."""
    rng = random.Random(f"autoshard-fuzz/{seed}/{index}")
    mesh = rng.choice(MESHES)
    width = rng.choice(WIDTHS[:-1])
    blocks = []
    for _ in range(rng.randint(1, 4)):
        blocks.append(_draw_block(rng, width if not blocks else blocks[-1].width))
    option = rng.choice(("free", "free", "recipe", "constraint", "budget"))
    recipes = [r for r in RECIPES if len(mesh) > 1 or r not in ("tp", "fsdp+tp")]
    # a recipe splits the batch over every data-parallel axis: mostly a batch it divides, sometimes not
    batch = rng.choice(BATCHES) if option != "recipe" or rng.random() < 0.25 else rng.choice((4, 8))
    return FuzzCase(
        seed=seed, index=index, mesh=mesh, batch=batch, seq=rng.choice(SEQS),
        vocab=rng.choice((0, 0, 11, 32)), width=width, blocks=tuple(blocks), loss=rng.choice(LOSSES),
        out=rng.choice(WIDTHS[:-1]), recipe=rng.choice(recipes) if option == "recipe" else None,
        constraint=rng.choice(("batch", "batch", "seq")) if option == "constraint" else None,
        budget=rng.choice((0.3, 0.6, 1.5)) if option == "budget" else None,
        cluster=rng.choice((None, None, "h100-sxm")))


def describe(case: FuzzCase) -> str:
    """The case in one line: mesh, shapes, blocks (kind[variant](width)), loss and options."""
    source = f"tokens[{case.vocab}]" if case.vocab else f"x[{case.width}]"
    blocks = " ".join(f"{b.kind}{'' if b.variant == 0 else b.variant}({b.width}{'' if b.arg == 1 else f'/{b.arg}'})"
                      for b in case.blocks)
    opts = [f"{k}={v}" for k, v in (("recipe", case.recipe), ("constraint", case.constraint),
                                    ("budget", case.budget), ("cluster", case.cluster), ("autotune", case.autotune),
                                    ("experts", case.experts))
            if v is not None]
    return f"mesh {case.mesh} B={case.batch} S={case.seq} {source} {blocks} -> {case.loss}({case.out}) {' '.join(opts)}"


def reproducer(case: FuzzCase) -> str:
    """A one-line shell command that runs ``case`` again."""
    extra = (f" --autotune {case.autotune}" if case.autotune else "") + (f" --experts {case.experts}" if case.experts else "")
    return f"python benchmarks/fuzz.py --seed {case.seed} --only {case.index}{extra}"


# ----------------------------------------------------------------------------------------------------- the model


class SmoothSquare(torch.autograd.Function):
    """``x * tanh(x)`` with its derivative written out: a user's custom ``autograd.Function``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x * torch.tanh(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(x)
        return grad * (t + x * (1 - t * t))


class FuzzBlock(nn.Module):
    """One :class:`Block` on a ``(batch, seq, features)`` activation. Index tensors and masks are buffers drawn
    from ``rng`` (a fixed pattern per case); weights come from torch's seeded generator."""

    def __init__(self, block: Block, width: int, seq: int, rng: random.Random) -> None:
        super().__init__()
        self.kind, self.variant, self.arg, self.width = block.kind, block.variant, block.arg, block.width
        w, k = block.width, block.kind
        if k == "linear":
            self.lin = nn.Linear(width, w)
        elif k in ("matmul", "einsum"):
            self.w = nn.Parameter(torch.randn(width, w) / math.sqrt(width))
        elif k == "conv":
            self.conv = nn.Conv1d(width, w, block.arg, padding=block.arg // 2)
        elif k in ("layernorm", "rmsnorm", "batchnorm", "groupnorm"):
            self.norm = {"layernorm": lambda: nn.LayerNorm(width), "rmsnorm": lambda: nn.RMSNorm(width),
                         "batchnorm": lambda: nn.BatchNorm1d(width),
                         "groupnorm": lambda: nn.GroupNorm(block.arg, width)}[k]()
        elif k == "attention":
            self.head_dim = rng.choice((2, 3, 4, 8))
            self.qkv = nn.Linear(width, 3 * block.arg * self.head_dim, bias=False)
            self.proj = nn.Linear(block.arg * self.head_dim, w)
            keep = torch.tensor([[j <= i or rng.random() < 0.3 for j in range(seq)] for i in range(seq)])
            self.register_buffer("mask", keep if block.variant == 2 else torch.where(keep, 0.0, -1.5))
        elif k in ("gather", "index", "scatter"):
            high, n = (w, width) if k == "scatter" else (seq, seq) if block.variant == 2 else (width, w)
            self.register_buffer("idx", torch.tensor([rng.randrange(high) for _ in range(n)]))
        elif k == "elementwise" and block.variant == 3:
            self.scale, self.shift = nn.Parameter(torch.randn(width)), nn.Parameter(torch.zeros(width))

    def forward(self, x: Tensor) -> Tensor:  # noqa: C901 - one branch per op family
        k, v = self.kind, self.variant
        b, s, d = x.shape
        if k == "linear":
            return F.gelu(self.lin(x))
        if k == "matmul":
            return torch.tanh(x @ self.w)
        if k == "einsum":
            return torch.einsum("bsd,de->bse", x, self.w)
        if k == "conv":
            y = self.conv(x.transpose(1, 2)).transpose(1, 2)
            return F.silu(y) if v else y
        if k in ("layernorm", "rmsnorm"):
            return self.norm(x)
        if k in ("batchnorm", "groupnorm"):
            return self.norm(x.transpose(1, 2)).transpose(1, 2)
        if k == "attention":
            q, kk, vv = self.qkv(x).view(b, s, 3, self.arg, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            mask = None if v in (0, 1) else self.mask
            y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=v == 1)
            return self.proj(y.transpose(1, 2).reshape(b, s, -1))
        if k == "gather":
            return torch.gather(x, 2, self.idx.expand(b, s, -1))
        if k == "index":
            return (lambda: x[..., self.idx], lambda: torch.index_select(x, 2, self.idx), lambda: x[:, self.idx])[v]()
        if k == "scatter":
            zeros = x.new_zeros(b, s, self.width)
            return zeros.index_add(2, self.idx, x) if v else zeros.scatter_add(2, self.idx.expand(b, s, -1), x)
        if k == "reduce":
            return (lambda: x - x.mean(-1, keepdim=True), lambda: x * torch.softmax(x.amax(1, keepdim=True), -1),
                    lambda: x / (x.abs().sum(0, keepdim=True) + 1), lambda: x - torch.logsumexp(x, -1, keepdim=True),
                    lambda: torch.cumsum(x, 1) / s)[v]()
        if k == "view":
            if v:
                return x.transpose(1, 2).reshape(b, s, d)
            return x.reshape(b, s, self.arg, d // self.arg).transpose(-1, -2).reshape(b, s, d)
        if k == "slice_cat":
            cut = self.arg % d
            return (lambda: torch.cat([x[..., cut:], x[..., :cut]], -1), lambda: torch.cat([x[:, 1:], x[:, :1]], 1),
                    lambda: torch.cat([x, torch.tanh(x[..., : self.width - d])], -1))[v]()
        if k == "elementwise":
            return (lambda: x * torch.sigmoid(x), lambda: torch.where(x > 0, x, 0.1 * x),
                    lambda: x + 0.5 * x.pow(2).clamp(max=3.0), lambda: x * self.scale + self.shift)[v]()
        return SmoothSquare.apply(x)


class FuzzModel(nn.Module):
    """The model of a :class:`FuzzCase`: an embedding (token inputs) or float features, its blocks in order, an
    output layer and the case's scalar loss; ``forward(x[, target]) -> loss``."""

    def __init__(self, case: FuzzCase) -> None:
        super().__init__()
        rng = random.Random(f"autoshard-fuzz-buffers/{case.seed}/{case.index}")
        self.loss = case.loss
        self.embed = nn.Embedding(case.vocab, case.width) if case.vocab else None
        widths = [case.width] + [b.width for b in case.blocks]
        self.blocks = nn.ModuleList(FuzzBlock(b, widths[i], case.seq, rng) for i, b in enumerate(case.blocks))
        last = widths[-1] + widths[-1] % 2 if case.experts else widths[-1]  # (the MoE layer wants an even width)
        self.to_moe = nn.Linear(widths[-1], last) if last != widths[-1] else None
        self.moe = _experts(last, case) if case.experts else None
        self.head = nn.Linear(last, case.out)

    def forward(self, x: Tensor, target: Tensor | None = None) -> Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            h = block(h)
        aux = 0.0
        if self.moe is not None:
            h = self.to_moe(h) if self.to_moe is not None else h
            mixed, aux = self.moe(h)
            h, aux = h + mixed, 0.01 * aux
        y = self.head(h)
        if self.loss == "mse":
            return F.mse_loss(y, target) + aux
        if self.loss == "cross_entropy":
            return F.cross_entropy(y.reshape(-1, y.shape[-1]), target.reshape(-1)) + aux
        return y.pow(2).mean() + aux


def _experts(width: int, case: FuzzCase) -> nn.Module:
    """A top-2 (top-1 of one expert) mixture of ``case.experts`` SwiGLU experts of hidden size 6 over ``width``."""
    from autoshard.models.moe import MoEConfig, MoEFeedForward

    cfg = MoEConfig(n_layer=1, d_model=width, n_head=1, n_kv_head=1, ffn=6, n_experts=case.experts,
                    top_k=min(2, case.experts), vocab=2, seq_len=case.seq)
    moe = MoEFeedForward(cfg)
    for w in (moe.w1, moe.w3, moe.w2):
        nn.init.normal_(w, std=0.3)
    return moe


def build_model(case: FuzzCase) -> FuzzModel:
    """The case's model, its weights drawn from a generator seeded by the case (the caller's RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case.seed * 100_003 + case.index)
        return FuzzModel(case)


def example_inputs(case: FuzzCase) -> tuple[Tensor, ...]:
    """The case's global batch: the tokens or features, then the target (none for the ``mean_square`` loss)."""
    g = torch.Generator().manual_seed(case.seed * 7919 + case.index)
    b, s = case.batch, case.seq
    x = (torch.randint(case.vocab, (b, s), generator=g) if case.vocab
         else torch.randn(b, s, case.width, generator=g))
    if case.loss == "mse":
        return x, torch.randn(b, s, case.out, generator=g)
    if case.loss == "cross_entropy":
        return x, torch.randint(case.out, (b, s), generator=g)
    return (x,)


def compile_options(case: FuzzCase) -> dict[str, Any]:
    """The keyword arguments ``autoshard.compile`` gets for the case."""
    from torch.distributed.tensor import Shard

    opts: dict[str, Any] = {}
    if case.recipe:
        opts["recipe"] = case.recipe
    if case.constraint:
        opts["constraints"] = {"inputs": {mesh_names(case.mesh)[0]: Shard(0 if case.constraint == "batch" else 1)}}
    if case.budget:
        state = sum(p.numel() for p in build_model(case).parameters()) * 16  # fp32 param, grad, 2 AdamW moments
        opts["memory_budget"] = max(1, int(case.budget * state))
    if case.cluster:
        opts["cluster"] = case.cluster
    if case.autotune:
        opts["autotune"] = case.autotune
    return opts


# ----------------------------------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Trajectory:
    """A training run's loss per step, first-step gradients and final parameters (plain fp32 tensors)."""

    losses: tuple[float, ...]
    grads: dict[str, Tensor]
    params: dict[str, Tensor]


class RanksDisagree(AssertionError):
    """The simulated ranks hold different values of what must be one value (the loss, a gathered tensor)."""


def _one_value(t: Tensor, what: str) -> Tensor:
    """``t`` gathered whole (a DTensor's ``full_tensor``) as one plain tensor, checked equal on every rank."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    full = tc.waited(full)
    per_rank = tc.rank_values(full)
    if per_rank is None:
        return full.detach().to(torch.float32).clone()
    with tc.outside_local_tensor_mode():
        first, *rest = [per_rank[r].detach().to(torch.float32).clone() for r in sorted(per_rank)]
        if any(not torch.equal(first, r) for r in rest):
            raise RanksDisagree(f"the ranks disagree on {what}")
        return first


def train(model: nn.Module, inputs: tuple[Tensor, ...], step: Callable[..., Tensor] | None = None) -> Trajectory:
    """:data:`STEPS` AdamW steps on the same ``inputs``; ``step(*inputs)`` (a compiled module's) runs forward and
    backward and returns the loss, default ``model(*inputs).backward()``."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for i in range(STEPS):
        if step is None:
            loss = model(*inputs)
            loss.backward()
        else:
            loss = step(*inputs)
        losses.append(float(_one_value(loss.detach(), f"the loss of step {i}")))
        if i == 0:
            grads = {n: _one_value(p.grad, f"{n}'s gradient") for n, p in model.named_parameters()
                     if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: _one_value(p.detach(), f"{n} after training") for n, p in model.named_parameters()}
    return Trajectory(tuple(losses), grads, params)


def _atol(what: str, name: str, ref: Trajectory, atol: float) -> float:
    """A parameter whose reference gradient is ~0 (below AdamW's eps: e.g. a norm's shift that the next norm
    removes) steps by rounding noise, up to lr per step, in any two summation orders: it is held to that bound
    (its gradient is still compared at the gradient tolerance)."""
    grad = ref.grads.get(name)
    if what == "param" and grad is not None and grad.abs().max().item() < 1e-6:
        return 2 * LR * STEPS
    return atol


def compare(ref: Trajectory, got: Trajectory) -> list[str]:
    """Every difference of ``got`` from ``ref`` beyond the tolerances, one line each (empty: equal)."""
    problems = [f"loss step {i}: {g:.8g} != reference {w:.8g}" for i, (g, w) in enumerate(zip(got.losses, ref.losses))
                if not math.isclose(g, w, rel_tol=RTOL, abs_tol=ATOL)]
    for what, want, have, atol in (("grad", ref.grads, got.grads, ATOL), ("param", ref.params, got.params, PARAM_ATOL)):
        if set(want) != set(have):
            problems.append(f"{what}s: missing {sorted(set(want) - set(have))}, "
                            f"unexpected {sorted(set(have) - set(want))}")
        for name in sorted(set(want) & set(have)):
            w, g = want[name], have[name]
            if w.shape != g.shape:
                problems.append(f"{what} {name}: shape {tuple(g.shape)} != reference {tuple(w.shape)}")
            elif not torch.allclose(g, w, rtol=RTOL, atol=_atol(what, name, ref, atol)):
                problems.append(f"{what} {name}: max abs diff {(g - w).abs().max().item():.3e} "
                                f"(reference max abs {w.abs().max().item():.3e})")
    return problems


def _sharded_run(case: FuzzCase, inputs: tuple[Tensor, ...], stage: list[str]) -> Trajectory:
    import autoshard
    from torch.distributed.device_mesh import init_device_mesh

    import os
    import tempfile
    from unittest import mock

    from autoshard.search.autotune import CACHE_ENV

    model = build_model(case)
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {CACHE_ENV: cache}), \
            fake_world(math.prod(case.mesh)), tc.simulated_ranks(math.prod(case.mesh)):  # (autotune's cache: fresh)
        mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=mesh_names(case.mesh))
        sharded = autoshard.compile(model, mesh, inputs, **compile_options(case))
        stage[0] = "running"
        return train(sharded, inputs, sharded.step)


def _line(text: str) -> str:
    return " ".join(text.split())[:300]


def run_case(case: FuzzCase) -> FuzzResult:
    """Train ``case``'s model on one device and on its simulated mesh, and say how they compare (never raises
    for what the case's model or compile does: a crash is a result)."""
    start = time.perf_counter()
    inputs = example_inputs(case)
    stage = ["reference"]

    def result(kind: str, message: str, detail: str = "") -> FuzzResult:
        out = FuzzResult(case.seed, case.index, kind, _line(message), time.perf_counter() - start, detail)
        logger.info("fuzz case %d/%d: %s %s", case.seed, case.index, kind, out.message)
        return out

    try:
        ref = train(build_model(case), inputs)
        stage[0] = "planning"
        got = _sharded_run(case, inputs, stage)
    except RanksDisagree as e:
        return result("mismatch", str(e), traceback.format_exc())
    except AutoshardError as e:
        if stage[0] == "planning" and str(e).strip():
            return result("refused", f"{type(e).__name__}: {e}", f"{type(e).__name__}: {e}")  # (whole, in detail)
        return result(f"crash-{stage[0]}", f"{type(e).__name__}: {e}", traceback.format_exc())
    except Exception as e:  # noqa: BLE001 - a crash is what the fuzzer reports
        return result(f"crash-{stage[0]}", f"{type(e).__name__}: {e}", traceback.format_exc())
    problems = compare(ref, got)
    if problems:
        return result("mismatch", f"{len(problems)} mismatch(es): {problems[0]}", "\n".join(problems))
    return result("ok", "")


__all__ = ["BLOCKS", "MESHES", "Block", "FuzzBlock", "FuzzCase", "FuzzModel", "FuzzResult", "SmoothSquare",
           "Trajectory", "RanksDisagree", "build_model", "compare", "compile_options", "describe", "draw_case",
           "example_inputs", "reproducer", "run_case", "train"]
