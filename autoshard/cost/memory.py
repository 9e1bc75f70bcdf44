"""The memory a step holds at its peak beyond its state and saved activations: temporaries.

The solver's memory is a sum over decision groups: parameters, gradients and optimizer state (each in its
layout) and the forward tensors the backward reads. Measured on gloo (``benchmarks/memory_truth.py``), a step
holds more at its peak, which falls in the backward: every saved activation and gradient plus the backward's
temporaries (the gradients of activations on their way down, a layer's weights gathered for compute, the
full-size gradient before its reduce-scatter) — 13-19 MiB on a 2-layer GPT whose state is 32 MiB. The optimizer
step has a peak of its own: the foreach kernels make one temporary per parameter shard they step.

``transients`` walks the solved joint graph in order (forward, then backward) with every tensor at its local
size under the plan's placements and keeps the most that is alive at once of what the sum does not count:

- a tensor is alive from the op that makes it to its last use (views hold no storage of their own; they keep
  their base alive until their own last use);
- saved activations (forward tensors the backward reads) and gradient outputs are left out (counted in the
  sum), as are parameters and inputs (placeholders); a gradient made larger than its layout (FSDP's and ZeRO-2's,
  before their reduce-scatter) waits whole for its layer's bucket: two layers' worth is added to the backward's
  peak (one bucket reduced while the next fills);
- gradients all-reduced in DDP's buckets (``autoshard/compiler/lower_buckets.py``: Partial -> Replicate, flattened
  together) are concatenated into one flat tensor per bucket when its last gradient is made: that copy is a temporary at
  that point of the backward;
- an input an op needs in a larger local layout than its producer's (an all-gather: a sharded weight gathered,
  an activation made whole) is a temporary of the op that needs it;
- a recomputed layer (``autoshard/compiler/capture_recompute.py``) makes its activations again in the backward: the
  largest layer's are added to the backward's peak (layers replay one at a time).

``MemoryBreakdown.temporaries`` is then the larger of the backward's and the forward's temporaries and the
optimizer step's (one parameter shard), less what the step no longer holds then (saved activations).

Offload (``parameter_forms.offload_variants``): an offloaded parameter's optimizer state, its master and the master's
gradient are in host memory, so its group counts no optimizer bytes on the device, and the optimizer step's foreach
temporaries for it are made on the host: the shard passed to ``temporaries`` is the device's optimizer bytes over
the state factor, which leaves offloaded parameters out. Its upload and gather at the next forward write into the
compute copy the step already holds (counted as a parameter), and its gradient on the device is counted like any
other until it is copied out.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from autoshard import _torch_compat as tc
from autoshard.buckets import bucket_starts
from autoshard.ir import NodeSharding, is_saved, is_view, layer_parts, sums, tensor_args


@dataclass(frozen=True)
class Transients:
    """The most bytes per device alive at once outside the state and saved activations, per phase."""

    forward: int
    backward: int


def local_bytes(nbytes: int, placements: Sequence | None, mesh_shape: Sequence[int]) -> int:
    """One device's bytes of a tensor of ``nbytes`` laid out by ``placements`` (each Shard divides by its axis)."""
    split = 1
    for p, n in zip(placements or (), mesh_shape):
        if isinstance(p, Shard):
            split *= n
    return nbytes // split


def _local_bytes(val: object, placements: Sequence | None, mesh_shape: Sequence[int]) -> int:
    if not isinstance(val, torch.Tensor):
        return 0
    return local_bytes(val.numel() * val.element_size(), placements, mesh_shape)


def _output_bytes(node: fx.Node, sh: NodeSharding | None, mesh_shape: Sequence[int]) -> int:
    val = node.meta.get("val")
    if sh is None:
        return 0
    if isinstance(val, (tuple, list)):
        return sum(_local_bytes(v, p, mesh_shape) for v, p in zip(val, sh.outputs))
    return _local_bytes(val, sh.outputs[0] if sh.outputs else None, mesh_shape)


def _gathers(
    node: fx.Node, args: Sequence[fx.Node], lay: Callable[[fx.Node], NodeSharding | None], mesh_shape: Sequence[int]
) -> int:
    """Bytes of the inputs ``node`` (tensor arguments ``args``) takes in a larger local layout than their producers
    give (made for it)."""
    sh = lay(node)
    if sh is None:
        return 0
    extra = 0
    for k, src in enumerate(args):
        have = lay(src)
        if have is None or k >= len(sh.inputs) or sh.inputs[k] is None:
            continue
        want = _local_bytes(src.meta["val"], sh.inputs[k], mesh_shape)
        if want > _local_bytes(src.meta["val"], have.outputs[0], mesh_shape):
            extra += want
    return extra


@dataclass(frozen=True)
class GraphWalk:
    """What ``transients`` reads from the graph alone, layouts aside: worked out once per graph and shared by the
    plans made of it (each recipe's plan-level count, ``search/planned.py: recipe_summaries``)."""

    grads: tuple[tuple[fx.Node, str, int], ...]  # (gradient output, its parameter's name, position in the graph)
    # (position, node, phase, whether it starts a storage of its own that this count holds, its tensor arguments)
    steps: tuple[tuple[int, fx.Node, str, bool, tuple[fx.Node, ...]], ...]
    free_at: dict[int, tuple[fx.Node, ...]]  # position -> the storages whose last use it is
    replays: tuple[tuple[str, fx.Node], ...]  # (recomputed module, a node its replay makes again)
    params: dict[str, fx.Node]


def graph_walk(gm: fx.GraphModule, output_roles: Sequence) -> GraphWalk:
    roots: dict[fx.Node, fx.Node] = {}  # (each node's asked for several times below)

    def root(n: fx.Node) -> fx.Node:
        if n not in roots:
            r = n
            while (
                r.op == "call_function"
                and (is_view(r.target) or r.target is operator.getitem)
                and (args := tensor_args(r))
            ):
                r = args[0] if r.target is not operator.getitem else r.args[0]
            roots[n] = r
        return roots[n]

    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    out = nodes[-1]
    counted: set[fx.Node] = set()  # gradient outputs: in the sum
    grads = []
    for src, role in zip(out.args[0], output_roles):
        if isinstance(src, fx.Node) and role.kind in ("grad", "input_grad"):
            counted.add(root(src))  # (a gradient is often a view, t(mm(...)), of the op that makes it)
            grads.append((src, role.name, at[src]))
    end: dict[fx.Node, int] = {}  # a storage's last use, over the views of it
    for n in nodes:
        if n.op != "call_function":
            continue
        base = root(n)
        last = max((at[u] for u in n.users), default=at[n])  # an output lives to the end of the step
        end[base] = max(end.get(base, at[base]), last)
    free_at: dict[int, list[fx.Node]] = {}
    for base, i in end.items():
        free_at.setdefault(i, []).append(base)
    replays = []  # by module: what a recomputed module's forward makes again in the backward
    for n in nodes:
        if n.op == "call_function" and n.meta.get("recompute") == tc.PREFER_RECOMPUTE and is_saved(n) and root(n) is n:
            parts = layer_parts(n.meta.get("autoshard_module", "") + ".")
            replays.append((f"{parts[0]}.{parts[1]}" if parts else n.meta.get("autoshard_module", ""), n))
    steps = tuple(
        (
            i,
            n,
            "backward" if n.meta.get("autoshard_phase") == "backward" else "forward",
            root(n) is n and n not in counted and not (is_saved(n) or any(is_saved(v) for v in _views(n))),
            tuple(tensor_args(n)),
        )
        for i, n in enumerate(nodes)
        if n.op == "call_function"
    )
    params = {n.meta["autoshard_role"].name: n for n in gm.graph.find_nodes(op="placeholder")}
    return GraphWalk(tuple(grads), steps, {i: tuple(b) for i, b in free_at.items()}, tuple(replays), params)


def transients(
    gm: fx.GraphModule,
    mesh_shape: Sequence[int],
    output_roles: Sequence,
    layouts: Mapping[str, NodeSharding] | None = None,
    weight: Callable[[fx.Node], float] | None = None,
    walk: GraphWalk | None = None,
) -> Transients:
    """The forward's and the backward's temporaries at their peaks (see the module docstring), with the
    ``layouts`` of a solution by node name (default: those written on the graph by ``passes.solve.annotate``).
    (A peak over the captured graph: a captured layer standing for several identical ones changes nothing,
    except in the all-reduce buckets, which hold every layer's gradients: a gradient counts ``weight(node)``
    times there.) ``walk``: ``graph_walk(gm, output_roles)``, when already made."""

    def lay(n: fx.Node) -> NodeSharding | None:
        return layouts.get(n.name) if layouts is not None else n.meta.get("autoshard")

    walk = walk if walk is not None else graph_walk(gm, output_roles)
    waiting: dict[tuple, int] = {}  # whole gradients by layer
    bucketed: list[tuple[int, int]] = []  # (where made, bytes) of the gradients all-reduced in buckets
    for src, name, where in walk.grads:
        made = _output_bytes(src, lay(src), mesh_shape)
        sh = lay(walk.params[name]) if name in walk.params else None
        delivered = made if sh is None else _local_bytes(src.meta["val"], sh.grad_layout, mesh_shape)
        if made > delivered:  # the whole gradient waits for its bucket's reduce-scatter
            parts = layer_parts(name)
            layer = parts[:2] if parts else ("", -1)
            waiting[layer] = waiting.get(layer, 0) + made
        elif sh is not None and (have := lay(src)) is not None and sums(have.outputs[0], sh.grad_layout):
            bucketed.append((where, int(made * (weight(src) if weight is not None else 1.0))))
    replayed: dict[str, int] = {}
    for key, n in walk.replays:
        replayed[key] = replayed.get(key, 0) + _output_bytes(n, lay(n), mesh_shape)
    flat = _bucket_copies(bucketed)
    live = 0
    size: dict[fx.Node, int] = {}
    peak = {"forward": 0, "backward": 0}
    for i, n, phase, fresh, args in walk.steps:
        if fresh:
            size[n] = _output_bytes(n, lay(n), mesh_shape)
            live += size[n]
        peak[phase] = max(peak[phase], live + _gathers(n, args, lay, mesh_shape) + flat.get(i, 0))
        for base in walk.free_at.get(i, ()):
            live -= size.pop(base, 0)
    # a layer's gradients are reduced as one bucket as soon as the backward has made them
    # (autoshard/compiler/overlap.py): while one bucket is reduced the next fills, so two layers' whole gradients wait
    # at once, not every layer's
    # one recomputed layer's activations live again while its backward runs (the layers replay one at a time)
    again = max(replayed.values(), default=0)
    return Transients(peak["forward"], peak["backward"] + sum(sorted(waiting.values())[-2:]) + again)


def _bucket_copies(made: Sequence[tuple[int, int]]) -> dict[int, int]:
    """Where each all-reduce bucket is complete (its last gradient made) and the bytes of its flat copy, with the
    lowering's bucket sizes (``autoshard.buckets.bucket_starts``, in the order the backward makes them)."""
    made = sorted(made)
    starts = bucket_starts([nbytes for _, nbytes in made])
    out: dict[int, int] = {}
    for a, b in zip(starts, [*starts[1:], len(made)]):
        last = made[b - 1][0]
        out[last] = out.get(last, 0) + sum(nbytes for _, nbytes in made[a:b])
    return out


def _views(n: fx.Node) -> list[fx.Node]:
    """The views (and tuple items) of ``n``'s storage, transitively."""
    out, todo = [], [n]
    while todo:
        for u in todo.pop().users:
            if u.op == "call_function" and (is_view(u.target) or u.target is operator.getitem):
                out.append(u)
                todo.append(u)
    return out


def temporaries(t: Transients, activations: float, optimizer_shard: float) -> int:
    """Bytes the step's peak holds beyond parameters, gradients, optimizer state and saved activations: the
    backward's (or forward's) temporaries, or the optimizer step's foreach temporaries (about one local shard of
    the parameters it steps on the device: ``optimizer_shard``, without offloaded parameters, which the host
    steps) when those make a higher peak, the saved activations being gone by then."""
    return int(max(t.backward, t.forward, optimizer_shard - activations, 0.0))


__all__ = ["Transients", "local_bytes", "temporaries", "transients"]
