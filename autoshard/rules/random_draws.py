"""Random numbers in a sharded program: each rank draws its piece, alike on replicas, or one device's numbers.

The semantics (docs/guide/api.md, "Random numbers"), per ``PlanConfig.random``: ``"local"`` (the default), each
rank draws only its piece of a random tensor, from a generator seeded by one number of the default generator and
the piece's index (``_local``); ``"exact"``, a sharded step draws exactly the numbers the unsharded model draws on
one device after the same ``torch.manual_seed``, from the same generator (the default generator of the tensors'
device), in the same order: each rank draws the whole tensor and keeps its piece. Either way ranks that hold
replicas of a value hold the same numbers and every rank's generator moves alike.

How: at capture, every ATen op that draws random numbers into a tensor whose values do not depend on other
tensors' values (dropout's mask, ``rand``/``randn``/``randint`` and their ``_like`` forms, the in-place fills
``uniform_``, ``normal_``, ``exponential_``, ``bernoulli_(p)``, ``random_``, ``cauchy_``, ``log_normal_``,
``geometric_``) is decomposed (``DECOMPOSITIONS``) into ``autoshard::draw`` (a fill of the op's global shape
with the ATen kernel one device runs) and deterministic math (dropout: ``x * mask * 1/(1-p)``). ``draw`` takes no
tensor: the planner places its output like any op's (``candidates``: whole, or split on any dim per axis), and
each rank runs it as one device would and keeps its own piece (``local_call``), a fresh tensor, so that what the
backward saves is the shard. ``bernoulli(p)`` with a tensor of probabilities is ``draw uniform < p`` on the CPU
(the CPU kernel's own arithmetic). Ops whose draws depend on their inputs' values (``multinomial``, ``poisson``,
``binomial``, gamma and Dirichlet samples, ``normal`` with tensor moments, ``bernoulli`` of a tensor off the CPU,
``rrelu`` in training) run whole on every rank (``READS_VALUES``: inputs and output replicated).

Order: one device draws in program order; the lowered graph keeps it (``chain_draws``: each draw reads the one
before it, which only orders them, so no scheduler can swap two). Random ops are never recomputed
(``capture_recompute``: a replay would draw again); what they make is saved.

Cost: priced as ``DRAW_FLOPS`` per element of the global shape (what ``"exact"`` draws on each rank: one device's
numbers need every earlier element on the CPU's generator).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from autoshard import _torch_compat as tc
from autoshard.ir import NodeSharding, tensor_args
from autoshard.rules.base import OpRule

aten = torch.ops.aten
DRAW_FLOPS = 16  # per element drawn: a counter-based or Mersenne-twister step and its transform (a price, not a count)
_GOLDEN = 0x9E3779B97F4A7C15  # spreads pieces over the seed space (Fibonacci hashing)
_MASK = (1 << 63) - 1
MODES = ("exact", "local")  # PlanConfig.random
MODE_KEY = "autoshard_random"  # meta key of a draw: its mode (set with its placement, ``place_as_read``)
KINDS = ("dropout", "bernoulli", "uniform", "normal", "exponential", "random", "cauchy", "log_normal", "geometric")


@torch.library.custom_op("autoshard::draw", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def draw(
    kind: str,
    shape: Sequence[int],
    params: Sequence[float],
    dtype: torch.dtype,
    device: torch.device,
    after: torch.Tensor | None = None,
    order: Sequence[int] | None = None,
    seed: torch.Tensor | None = None,
    stream: int = 0,
) -> torch.Tensor:
    """A tensor of ``shape`` filled by one device's ATen kernel for ``kind`` (``KINDS``) with ``params``, from the
    default generator of ``device``. ``"dropout"``: the boolean keep-mask ``native_dropout`` draws with drop
    probability ``params[0]``. ``after`` is read for nothing: it orders this draw after another (``chain_draws``).
    ``order``: the dims from outermost to innermost in the memory of the tensor one device fills (a permuted
    layout: ``empty_like`` of a transposed activation, which CPU dropout and ``rand_like`` fill in memory order);
    the fill runs on a tensor of that layout and the result is returned contiguous. ``seed`` (``random="local"``):
    drawn from a generator of its own, seeded by ``seed`` and ``stream`` (the rank's piece), not the default one."""
    gen = None
    if seed is not None:
        gen = torch.Generator(device)
        gen.manual_seed((int(seed.reshape(-1)[0]) + (stream + 1) * _GOLDEN) & _MASK)
    if kind == "dropout" and not order and device.type != "cpu" and gen is None:
        return torch.native_dropout(torch.ones(shape, dtype=dtype, device=device), params[0], True)[1]
    fill = torch.bool if kind == "dropout" else dtype  # (a mask drawn straight into booleans: the same draws)
    if order:
        inverse = sorted(range(len(order)), key=order.__getitem__)
        out = torch.empty([shape[d] for d in order], dtype=fill, device=device).permute(inverse)
    else:
        out = torch.empty(shape, dtype=fill, device=device)
    if kind == "dropout":  # the CPU kernel's own: bernoulli_(1 - p) (the same draws into a boolean tensor)
        out = out.bernoulli_(1.0 - params[0], generator=gen)
    elif kind == "random":
        out = out.random_(*(int(p) for p in params), generator=gen)
    else:
        out = getattr(out, kind + "_")(*params, generator=gen)
    return out.contiguous() if order else out


@draw.register_fake
def _(
    kind: str,
    shape: Sequence[int],
    params: Sequence[float],
    dtype: torch.dtype,
    device: torch.device,
    after: torch.Tensor | None = None,
    order: Sequence[int] | None = None,
    seed: torch.Tensor | None = None,
    stream: int = 0,
) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.bool if kind == "dropout" else dtype, device=device)


DRAW = torch.ops.autoshard.draw.default


# ------------------------------------------------------------------------------- capture: random ops as draws


def _native_dropout(x: torch.Tensor, p: float, train: bool | None) -> Any:
    if train is False or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if p == 1:
        return x * 0, torch.zeros_like(x, dtype=torch.bool)
    # on the CPU, F.dropout's mask is a bernoulli_ of empty_like(x): drawn in x's memory order (a transposed x)
    order = _memory_order(x) if x.device.type == "cpu" else None
    mask = DRAW("dropout", list(x.shape), [float(p)], x.dtype, x.device, order=order)
    return x * mask * (1.0 / (1.0 - p)), mask


def _fill(
    kind: str, params: Callable[..., list[float]], dtype_of: Callable[..., torch.dtype] | None = None
) -> Callable[..., Any]:
    """``op(x, *params)`` -> a draw of x's shape and dtype (a functional in-place fill or a ``_like`` factory)."""

    def decomposed(x: torch.Tensor, *args: Any, generator: Any = None, **kwargs: Any) -> Any:
        if generator is not None:
            return NotImplemented  # a generator of the user's own: run as traced (on every rank, whole)
        dtype = dtype_of(x, kwargs) if dtype_of is not None else x.dtype
        return DRAW(kind, list(x.shape), params(*args), dtype, kwargs.get("device") or x.device, order=_memory_order(x))

    return decomposed


def _memory_order(x: torch.Tensor) -> list[int] | None:
    """The dims of ``x`` (the tensor one device fills) from outermost to innermost in memory when that is not their
    order (a fill runs in memory order), else None; dims of size 1 first, as they do not move the order."""
    big = [d for d in range(x.ndim) if x.shape[d] != 1]
    by_stride = sorted(big, key=lambda d: -x.stride(d))
    if by_stride == big:
        return None
    return [d for d in range(x.ndim) if x.shape[d] == 1] + by_stride


def _factory(kind: str, params: Callable[..., list[float]], default: torch.dtype | None = None) -> Callable[..., Any]:
    """``op(*params, size, dtype=...)`` -> a draw of ``size``."""

    def decomposed(
        *args: Any,
        generator: Any = None,
        dtype: torch.dtype | None = None,
        layout: Any = None,
        device: Any = None,
        pin_memory: Any = None,
        **kwargs: Any,
    ) -> Any:
        if generator is not None or kwargs.get("names") is not None:
            return NotImplemented
        *head, size = args
        return DRAW(
            kind,
            [int(s) for s in size],
            params(*head),
            dtype or default or torch.get_default_dtype(),
            torch.device(device) if device is not None else torch.device("cpu"),
        )

    return decomposed


def _bernoulli_tensor(p: torch.Tensor, *args: Any, generator: Any = None) -> Any:
    """``bernoulli(p)`` with a tensor of probabilities: on the CPU, the kernel's own ``uniform < p`` (a uniform
    of p's dtype per element, in order); elsewhere the op as traced, run whole (``READS_VALUES``)."""
    if generator is not None or p.device.type != "cpu" or args:
        return NotImplemented
    dtype = p.dtype if p.dtype in (torch.float32, torch.float64) else torch.float32
    u = DRAW("uniform", list(p.shape), [0.0, 1.0], dtype, p.device)
    return (u < p.to(dtype)).to(p.dtype)


def _randint_params(*head: Any) -> list[float]:
    return [0.0, float(head[0])] if len(head) == 1 else [float(head[0]), float(head[1])]


def _random_params(*args: Any) -> list[float]:
    return [float(a) for a in args if a is not None]


def _like_dtype(x: torch.Tensor, kwargs: dict) -> torch.dtype:
    return kwargs.get("dtype") or x.dtype


def _decompositions() -> dict[Any, Callable[..., Any]]:
    table: dict[Any, Callable[..., Any]] = {
        aten.native_dropout.default: _native_dropout,
        aten.bernoulli.default: _bernoulli_tensor,
    }
    fills: dict[str, tuple[str, Callable[..., list[float]]]] = {
        "bernoulli.p": ("bernoulli", lambda p=0.5: [float(p)]),
        "uniform.default": ("uniform", lambda a=0.0, b=1.0: [float(a), float(b)]),
        "normal_functional.default": ("normal", lambda m=0.0, s=1.0: [float(m), float(s)]),
        "exponential.default": ("exponential", lambda lam=1.0: [float(lam)]),
        "cauchy.default": ("cauchy", lambda m=0.0, s=1.0: [float(m), float(s)]),
        "log_normal.default": ("log_normal", lambda m=1.0, s=2.0: [float(m), float(s)]),
        "geometric.default": ("geometric", lambda p: [float(p)]),
        "random.default": ("random", _random_params),
        "random.from": ("random", _random_params),
        "random.to": ("random", lambda to: [0.0, float(to)]),
    }
    for name, (kind, params) in fills.items():
        op = _overload(name)
        if op is not None:
            table[op] = _fill(kind, params)
    likes = {
        "rand_like.default": ("uniform", lambda: [0.0, 1.0]),
        "randn_like.default": ("normal", lambda: [0.0, 1.0]),
        "randint_like.default": ("random", lambda high: [0.0, float(high)]),
        "randint_like.low_dtype": ("random", lambda low, high: [float(low), float(high)]),
    }
    for name, (kind, params) in likes.items():
        op = _overload(name)
        if op is not None:
            table[op] = _fill(kind, params, _like_dtype)
    factories = {
        "rand.default": ("uniform", lambda: [0.0, 1.0], None),
        "randn.default": ("normal", lambda: [0.0, 1.0], None),
        "randint.default": ("random", _randint_params, torch.int64),
        "randint.low": ("random", _randint_params, torch.int64),
    }
    for name, (kind, params, default) in factories.items():
        op = _overload(name)
        if op is not None:
            table[op] = _factory(kind, params, default)
    return table


def _overload(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet, None), overload, None)


DECOMPOSITIONS: Mapping[Any, Callable[..., Any]] = _decompositions()

# ops whose draws depend on their inputs' values: whole on every rank
READS_VALUES = (
    "multinomial.default",
    "poisson.default",
    "binomial.default",
    "_standard_gamma.default",
    "_sample_dirichlet.default",
    "normal.Tensor_Tensor",
    "normal.Tensor_float",
    "normal.float_Tensor",
    "bernoulli.default",
    "bernoulli.Tensor",
    "rrelu_with_noise_functional.default",
    "randperm.default",
)


# ------------------------------------------------------------------------------------------- planning: the rule


def _ops() -> frozenset[Any]:
    return frozenset({"autoshard.draw.default", *(f"aten.{n}" for n in READS_VALUES)})


def is_draw(node: fx.Node) -> bool:
    return node.target is DRAW


def candidates(node: fx.Node, ties: Sequence[int]) -> list[tc.RawStrategy]:
    """A draw: per distinct mesh axis (``ties``), whole or split on any dim; an op reading values: whole."""
    val = node.meta.get("val")
    rep = tuple(Replicate() for _ in ties)
    if not is_draw(node):
        outs = val if isinstance(val, (tuple, list)) else (val,)
        return [
            tc.RawStrategy(
                tuple(rep for _ in tensor_args(node)), tuple(rep if isinstance(v, torch.Tensor) else None for v in outs)
            )
        ]
    free = sorted(set(ties))
    options = [Replicate(), *(Shard(d) for d in range(val.ndim))]
    result = []
    for sub in itertools.product(options, repeat=len(free)):
        pick = dict(zip(free, sub))
        result.append(tc.RawStrategy((), (tuple(pick[t] for t in ties),)))
    return result


def runs_local(node: fx.Node, sharding: NodeSharding) -> bool:
    return True  # drawn as one device draws (DTensor's own random ops draw each shard from an offset instead)


def _piece(full: torch.Tensor, placements: Sequence[Any], coords: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    out = full
    for p, r, n in zip(placements, coords, sizes):
        if isinstance(p, Shard):
            out = out.tensor_split(n, dim=p.dim)[r]
    return out.clone() if out is not full else out  # a fresh tensor: what the backward saves is the shard only


def local_call(node: fx.Node, sharding: NodeSharding) -> Callable[[tuple, dict, DeviceMesh], Any] | None:
    if not is_draw(node):
        return None
    placements = tuple(sharding.outputs[0] or ())
    if node.meta.get(MODE_KEY, "local") == "local":
        return _local(placements)

    def call(args: tuple, kwargs: dict, mesh: DeviceMesh) -> Any:
        full = DRAW(*args, **kwargs)
        if not any(isinstance(p, Shard) for p in placements):
            return full
        coords = [mesh.get_local_rank(a) for a in range(mesh.ndim)]
        return tc.for_each_rank(_piece)(full, placements, coords, list(mesh.shape))

    return call


def _local(placements: tuple) -> Callable[[tuple, dict, DeviceMesh], Any]:
    """``random="local"``: each rank draws only its piece, from a stream of that piece: one number of the default
    CPU generator per draw (the same on every rank) seeds it with the piece's index."""

    def call(args: tuple, kwargs: dict, mesh: DeviceMesh) -> Any:
        seed = DRAW("random", [1], [0.0, float(1 << 62)], torch.int64, torch.device("cpu"))
        coords = [mesh.get_local_rank(a) for a in range(mesh.ndim)]
        kind, shape, params, dtype, device = args[:5]
        return tc.for_each_rank(_local_piece)(
            kind, list(shape), list(params), dtype, device, seed, placements, coords, list(mesh.shape)
        )

    return call


def _local_piece(
    kind: str,
    shape: list[int],
    params: list[float],
    dtype: torch.dtype,
    device: torch.device,
    seed: torch.Tensor,
    placements: tuple,
    coords: Sequence[int],
    sizes: Sequence[int],
) -> torch.Tensor:
    piece = _piece(torch.empty(shape, device="meta"), placements, coords, sizes)
    stream = 0
    for p, r, n in zip(placements, coords, sizes):  # the piece's index over the axes that split
        if isinstance(p, Shard):
            stream = stream * n + r
    return DRAW(kind, list(piece.shape), params, dtype, device, seed=seed, stream=stream)


def _draw_flops(kind: str, shape: Sequence[int], *rest: Any, **kwargs: Any) -> int:
    return DRAW_FLOPS * math.prod(shape)


def _flops() -> Mapping[Any, Callable[..., int]]:
    return {DRAW: _draw_flops}


RULE = OpRule("random_draws", _ops, candidates=candidates, runs_local=runs_local, flops=_flops, local_call=local_call)


def place_as_read(gm: fx.GraphModule, mode: str = "local") -> int:
    """Give every draw the placement all its readers want of it, where they agree (the solver may leave it whole:
    a whole draw cut by its reader costs the same time). Then each rank's draw is its own piece, a fresh tensor,
    and that piece is what the backward saves and a replayed layer reads (cut by a recomputed reader, the whole
    draw would be saved). Returns how many draws changed."""
    changed = 0
    for n in gm.graph.nodes:
        sh = n.meta.get("autoshard")
        if not (n.op == "call_function" and is_draw(n) and sh is not None):
            continue
        n.meta[MODE_KEY] = mode
        if not n.users:
            continue
        wanted = set()
        for u in n.users:
            ush = u.meta.get("autoshard")
            ins = tensor_args(u)
            wanted |= {
                tuple(ush.inputs[k]) if ush is not None and k < len(ush.inputs) and ush.inputs[k] else None
                for k, a in enumerate(ins)
                if a is n
            }
        if len(wanted) == 1 and None not in wanted and tuple(sh.outputs[0] or ()) != next(iter(wanted)):
            n.meta["autoshard"] = dataclasses.replace(sh, outputs=(next(iter(wanted)),))
            changed += 1
    return changed


# ------------------------------------------------------------------------------------ lowering: the draws' order


def chain_draws(gm: fx.GraphModule) -> int:
    """Make each ``draw`` of ``gm`` read the draw before it (``after``), so that they run in the graph's order
    whatever the compiler schedules; returns how many draws there are."""
    prev: fx.Node | None = None
    count = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is DRAW:
            if prev is not None and n.kwargs.get("after") is None and len(n.args) < 6:
                n.kwargs = {**n.kwargs, "after": prev}
            prev = n
            count += 1
    if count > 1:
        gm.recompile()
    return count


__all__ = [
    "DECOMPOSITIONS",
    "DRAW",
    "KINDS",
    "MODES",
    "READS_VALUES",
    "RULE",
    "chain_draws",
    "draw",
    "is_draw",
    "place_as_read",
]
