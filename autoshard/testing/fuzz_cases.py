"""The model fuzzer's cases: what a case is, and how it is drawn from ``(seed, index)``.

A :class:`FuzzCase` is drawn deterministically from ``(seed, index)`` by :func:`draw_case`: a mesh ((2,), (4,),
(2, 2) or (2, 1, 2)), a batch, a sequence length and a stack of blocks drawn from the ops users train (linear,
matmul, einsum, convolution, layer/RMS/batch/group norm, attention with and without masks, embedding,
gather/scatter/index ops, reductions, views/permutes/slices/cat, elementwise, a custom ``autograd.Function``),
widths that mesh axes often do not divide (3, 5, 6, 7, 12, 96 ...), a scalar loss, and the compile options (a
recipe, an input constraint, a memory budget as a fraction of the parameters' training state, a cluster).

Random blocks (:data:`RANDOM_BLOCKS`: a dropout, a sampled router) are drawn from a stream of their own and
inserted into the stack, so that every other draw of a case is what it was before they existed:
:func:`without_random` gives a case as it was drawn before issue 43 (``benchmarks/fuzz.py --no-random``).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

MESHES = ((2,), (4,), (2, 2), (2, 1, 2))
WIDTHS = (3, 4, 5, 6, 7, 8, 12, 16, 96)  # most of them no mesh axis divides
BATCHES = (2, 3, 4, 5, 6, 8)
SEQS = (1, 3, 4, 5, 7, 8, 12)
BLOCKS = (
    "linear",
    "matmul",
    "einsum",
    "conv",
    "layernorm",
    "rmsnorm",
    "batchnorm",
    "groupnorm",
    "attention",
    "gather",
    "index",
    "scatter",
    "reduce",
    "view",
    "slice_cat",
    "elementwise",
    "custom",
)
# blocks that draw random numbers in training (issue 43), drawn apart from BLOCKS: a dropout (variant 0
# nn.Dropout, 1 F.dropout; arg: p in percent, 10 or 0) and a sampled top-1/top-2 router over arg experts (variant
# 0 Gumbel noise from exponential_(), 1 rand_like jitter of its input, 2 randn_like noise of learned scale)
RANDOM_BLOCKS = ("dropout", "route")
LOSSES = ("mse", "cross_entropy", "mean_square")
RECIPES = ("ddp", "zero1", "zero2", "fsdp", "tp", "fsdp+tp")
# how many variants a block kind has (its ``variant``): attention's are its masks (none, causal, boolean, additive)
VARIANTS = {
    "conv": 2,
    "attention": 4,
    "index": 3,
    "scatter": 2,
    "reduce": 5,
    "view": 2,
    "slice_cat": 3,
    "elementwise": 4,
    "dropout": 2,
    "route": 3,
}


@dataclass(frozen=True)
class Block:
    """One block of a fuzzed model: its op ``kind``, the feature width it outputs, its ``variant`` (which form of
    the op: see :data:`VARIANTS`) and a size ``arg`` (attention heads, group-norm groups, conv kernel, a divisor,
    dropout's p in percent, a router's experts)."""

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


def _with_random_blocks(seed: int, index: int, width: int, blocks: list[Block]) -> tuple[Block, ...]:
    """``blocks`` with a dropout (in 2 cases of 5; p = 0.1 in 3 of those 4) and a sampled router (in 1 of 4) inserted
    where their own stream says; both keep the width they are given."""
    rng = random.Random(f"autoshard-fuzz-random/{seed}/{index}")
    out = list(blocks)
    for kind, chance in (("dropout", 0.4), ("route", 0.25)):
        if rng.random() >= chance:
            continue
        at = rng.randint(0, len(out))
        here = out[at - 1].width if at else width
        arg = rng.choice((10, 10, 10, 0)) if kind == "dropout" else rng.choice((2, 3, 4))
        out.insert(at, Block(kind, here, rng.randrange(VARIANTS[kind]), arg))
    return tuple(out)


def draw_case(seed: int, index: int) -> FuzzCase:
    """The case ``index`` of the run seeded ``seed`` (the same on every machine and Python)."""
    rng = random.Random(f"autoshard-fuzz/{seed}/{index}")
    mesh = rng.choice(MESHES)
    width = rng.choice(WIDTHS[:-1])
    blocks: list[Block] = []
    for _ in range(rng.randint(1, 4)):
        blocks.append(_draw_block(rng, width if not blocks else blocks[-1].width))
    option = rng.choice(("free", "free", "recipe", "constraint", "budget"))
    recipes = [r for r in RECIPES if len(mesh) > 1 or r not in ("tp", "fsdp+tp")]
    # a recipe splits the batch over every data-parallel axis: mostly a batch it divides, sometimes not
    batch = rng.choice(BATCHES) if option != "recipe" or rng.random() < 0.25 else rng.choice((4, 8))
    return FuzzCase(
        seed=seed,
        index=index,
        mesh=mesh,
        batch=batch,
        seq=rng.choice(SEQS),
        vocab=rng.choice((0, 0, 11, 32)),
        width=width,
        blocks=_with_random_blocks(seed, index, width, blocks),
        loss=rng.choice(LOSSES),
        out=rng.choice(WIDTHS[:-1]),
        recipe=rng.choice(recipes) if option == "recipe" else None,
        constraint=rng.choice(("batch", "batch", "seq")) if option == "constraint" else None,
        budget=rng.choice((0.3, 0.6, 1.5)) if option == "budget" else None,
        cluster=rng.choice((None, None, "h100-sxm")),
    )


def without_random(case: FuzzCase) -> FuzzCase:
    """``case`` without its random blocks: the case as :func:`draw_case` drew it before they were drawn (the
    other blocks' weights and buffers come from streams the random blocks do not touch)."""
    return dataclasses.replace(case, blocks=tuple(b for b in case.blocks if b.kind not in RANDOM_BLOCKS))


def _arg(b: Block) -> str:
    if b.kind == "dropout":
        return f" p={b.arg / 100:g}"
    return "" if b.arg == 1 else f"/{b.arg}"


def describe(case: FuzzCase) -> str:
    """The case in one line: mesh, shapes, blocks (kind[variant](width)), loss and options."""
    source = f"tokens[{case.vocab}]" if case.vocab else f"x[{case.width}]"
    blocks = " ".join(f"{b.kind}{'' if b.variant == 0 else b.variant}({b.width}{_arg(b)})" for b in case.blocks)
    opts = [
        f"{k}={v}"
        for k, v in (
            ("recipe", case.recipe),
            ("constraint", case.constraint),
            ("budget", case.budget),
            ("cluster", case.cluster),
            ("autotune", case.autotune),
            ("experts", case.experts),
        )
        if v is not None
    ]
    return f"mesh {case.mesh} B={case.batch} S={case.seq} {source} {blocks} -> {case.loss}({case.out}) {' '.join(opts)}"


def reproducer(case: FuzzCase) -> str:
    """A one-line shell command that runs ``case`` again."""
    extra = (f" --autotune {case.autotune}" if case.autotune else "") + (
        f" --experts {case.experts}" if case.experts else ""
    )
    drawn = dataclasses.replace(draw_case(case.seed, case.index), autotune=case.autotune, experts=case.experts)
    if case != drawn and case == without_random(drawn):
        extra += " --no-random"
    return f"python benchmarks/fuzz.py --seed {case.seed} --only {case.index}{extra}"


__all__ = [
    "BLOCKS",
    "MESHES",
    "RANDOM_BLOCKS",
    "Block",
    "FuzzCase",
    "describe",
    "draw_case",
    "reproducer",
    "without_random",
]
