"""Candidate placements of one op, per mesh axis: the enumeration the ``strategies`` pass runs per group.

For an op, the candidates come from an op rule of our own (``autoshard/rules``) or from DTensor's op-strategy
registries (through ``_torch_compat``), asked once per distinct (op, shapes, arguments, layout) and filtered to
layouts that shard evenly and feed no Partial into a non-linear op; a follower (a view, a getitem) takes the
layout DTensor would produce from its producer's. Helpers shared with the pass: ``shard_factor``,
``evenly_divisible``, ``axis_ties`` (mesh axes that must place alike).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard import _torch_compat as tc
from autoshard import rules as op_rules
from autoshard.compiler.context import PassContext
from autoshard.ir import Placements, output_vals, tensor_args
from autoshard.messages import warn

log = logging.getLogger(__name__)
aten = torch.ops.aten


def shard_factor(placements: Placements | None, mesh_shape: Sequence[int]) -> int:
    if placements is None:
        return 1
    f = 1
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            f *= n
    return f


def evenly_divisible(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> bool:
    sizes = list(shape)
    for p, n in zip(placements, mesh_shape):
        if isinstance(p, Shard):
            if p.dim >= len(sizes) or sizes[p.dim] % n != 0:
                return False
            sizes[p.dim] //= n
    return True


def axis_ties(ctx: PassContext) -> tuple[int, ...]:
    """For each mesh axis, the axis whose activation placements it must copy (itself when free).

    On a mesh of three or more axes, neighbouring axes that both span nodes (each hop on the network) are tied
    for activations: a tensor computed in the program takes the same placement on all of them, as if they were
    one axis of their product size. Parameters and graph inputs stay free per axis, so DDP, FSDP and HSDP
    (replicate over one outer axis, shard over the other) remain expressible. This keeps a 3-D mesh's search
    the size of a 2-D one's; it gives up activation layouts that differ between two network axes (e.g. context
    parallelism on one outer axis and data parallelism on the other). ``PlanConfig(tie_axes=False)`` turns it
    off."""
    ms = ctx.mesh_shape
    ties = list(range(len(ms)))
    if len(ms) < 3 or not ctx.config.tie_axes:
        return tuple(ties)
    for axis in range(1, len(ms)):
        a, b = ctx.cluster.axis_layout(ms, axis - 1), ctx.cluster.axis_layout(ms, axis)
        if a.per_node == 1 and b.per_node == 1:
            ties[axis] = ties[axis - 1]
    return tuple(ties)


_SUMS = {aten.sum.dim_IntList, aten.sum.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dim, aten.unsqueeze.default}


def summed(src: fx.Node) -> bool:
    """Whether ``src`` is a sum (through views): a sum over a sharded dim is Partial, and an op that is linear in
    that input (an embedding's backward taking a position gradient summed over a sharded batch) can keep it so
    instead of reducing it first."""
    while src.op == "call_function" and src.target in _VIEWS and isinstance(src.args[0], fx.Node):
        src = src.args[0]
    return src.op == "call_function" and src.target in _SUMS


def _tied(placements: Placements | None, ties: Sequence[int]) -> bool:
    return placements is None or all(placements[a] == placements[t] for a, t in enumerate(ties))


def _key_arg(a: object) -> object:
    if isinstance(a, fx.Node):
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), tuple(v.stride()), v.dtype)
        return ("V", repr(v))
    if isinstance(a, (list, tuple)):
        return tuple(_key_arg(x) for x in a)
    return repr(a)


def _meta_args(node: fx.Node) -> tuple[tuple, dict]:
    return tuple(_meta_arg(a) for a in node.args), {k: _meta_arg(v) for k, v in node.kwargs.items()}


# (module-level recursions, these and the key's below: a recursive closure is a reference cycle per call, garbage
# for the cycle collector to walk at the end of every plan)
def _meta_arg(a: object) -> object:
    if isinstance(a, fx.Node):
        v = a.meta.get("val")
        return tc.tensor_meta(v) if isinstance(v, torch.Tensor) else v
    if isinstance(a, (list, tuple)):
        return type(a)(_meta_arg(x) for x in a)
    return a


def _valid(
    raw: tc.RawStrategy,
    ins: list[fx.Node],
    node: fx.Node,
    mesh_shape: Sequence[int],
    partial_inputs: bool | Sequence[bool] = True,
    ties: Sequence[int] = (),
) -> bool:
    if ties and not all(_tied(p, ties) for p in list(raw.outputs) + list(raw.inputs)):
        return False
    may = [partial_inputs] * len(ins) if isinstance(partial_inputs, bool) else list(partial_inputs)
    for k, (pl, src) in enumerate(zip(raw.inputs, ins)):
        if pl is None:
            continue
        # an anchor candidate that asks for a Partial input only pays off when its producer is Partial
        # already; DTensor lists many such variants (every linear op), which multiply the search space for
        # little gain: prune them there (followers keep whatever DTensor does with a Partial producer), except
        # on inputs that a sum makes (``summed``)
        if not may[k] and any(isinstance(p, Partial) for p in pl):
            return False
        if any(isinstance(p, Partial) and p.reduce_op != "sum" for p in pl):
            return False
        if not evenly_divisible(src.meta["val"].shape, pl, mesh_shape):
            return False
    for pl, v in zip(raw.outputs, output_vals(node)):
        if pl is not None and v is not None and not evenly_divisible(v.shape, pl, mesh_shape):
            return False
    return True


class CandidateEnumerator:
    """Queries DTensor once per distinct (op, shapes, args, layout) and remembers it for this run."""

    def __init__(self, ctx: PassContext) -> None:
        self.ctx = ctx
        self.mesh = ctx.mesh
        self.mesh_shape = ctx.mesh_shape
        self.ties = axis_ties(ctx)
        self._anchor = lru_cache(maxsize=None)(self._anchor_uncached)
        self._follow = lru_cache(maxsize=None)(self._follow_uncached)
        self._rules_of: dict[tuple, tc.AxisRules | None] = {}  # per op signature: its per-axis rules
        self._keys: dict[str, tuple[int]] = {}  # per node name: its op signature's number (``_key_of``)
        self._ids: dict[tuple, int] = {}
        self.facts: dict = {}  # per node name: what pricing it needs that no layout changes (``strategies``)
        self.layouts: dict = {}  # per layout's id: its shard factor and sharded axes (``strategies._layout``)
        self.warned: set[str] = set()

    @staticmethod
    def key(node: fx.Node) -> tuple:
        return (
            node.target,
            tuple(_key_arg(a) for a in node.args),
            tuple((k, _key_arg(v)) for k, v in node.kwargs.items()),
        )

    def key_id(self, node: fx.Node) -> int:
        """The number of the node's op signature (``key``): equal for nodes of equal signature."""
        return self._key_of(node)[0]

    def _key_of(self, node: fx.Node) -> tuple[int]:
        """The node's op signature as a small number (equal signatures, equal numbers): the caches hash it on
        every lookup, and the signature itself is a deep tuple."""
        if node.name not in self._keys:
            self._keys[node.name] = (self._ids.setdefault(self.key(node), len(self._ids)),)
        return self._keys[node.name]

    def anchor(self, node: fx.Node) -> list[tc.RawStrategy]:
        self._cur = node
        return self._anchor((self._key_of(node), tuple(summed(s) for s in tensor_args(node))))

    def _anchor_uncached(self, key: tuple) -> list[tc.RawStrategy]:
        node = self._cur
        op = node.target
        ins = tensor_args(node)
        summed = key[1]  # the inputs a sum makes: they may arrive Partial
        own = op_rules.candidates(node, self.ties)  # an op family autoshard has its own rule for (autoshard/rules)
        if own is not None:  # (even shards only: a batch of 1 is not split)
            vals = [a.meta["val"] for a in ins] + list(output_vals(node))
            return [
                c
                for c in own
                if all(
                    pl is None or v is None or evenly_divisible(v.shape, pl, self.mesh_shape)
                    for pl, v in zip((*c.inputs, *c.outputs), vals)
                )
            ]
        args, kwargs = _meta_args(node)
        found: dict[tuple, tc.RawStrategy] = {}
        errors: list[str] = []
        rules = self._rules(node, args, kwargs)
        if rules is not None:
            # the product of DTensor's per-axis rules: the same candidates DTensor's own expansion yields, without
            # pricing each one for every possible input layout
            nout = rules.num_outputs
            axes = range(len(self.mesh_shape))
            free = sorted(set(self.ties))
            for sub in itertools.product(rules.rules, repeat=len(free)):
                pick = dict(zip(free, sub))
                combo = [pick[t] for t in self.ties]
                if any((combo[a][o] is None) != (combo[0][o] is None) for a in axes for o in range(nout)):
                    continue  # an output some axes' rules place and others do not (an unused gradient)
                outs = tuple(None if combo[0][o] is None else tuple(combo[a][o] for a in axes) for o in range(nout))
                cins = tuple(tuple(combo[a][nout + i] for a in axes) for i in range(len(ins)))
                c = tc.RawStrategy(cins, outs)
                if _valid(c, ins, node, self.mesh_shape, partial_inputs=summed, ties=self.ties):
                    found.setdefault((c.inputs, c.outputs), c)
        elif tc.has_sharding_rule(op):
            # vary the first input's layout, or the largest one's when the first is a scalar (nll_loss_backward)
            k = 0 if ins[0].meta["val"].ndim else max(range(len(ins)), key=lambda i: ins[i].meta["val"].ndim)
            for first in tc.all_placements(len(self.mesh_shape), ins[k].meta["val"].ndim):
                rep = tuple(Replicate() for _ in self.mesh_shape)
                lead, others = (tuple(first), None) if k == 0 else (rep, [None] * (k - 1) + [tuple(first)])
                try:
                    cands = tc.op_strategies(op, args, kwargs, self.mesh, lead, others, out_val=node.meta.get("val"))
                except Exception as e:  # DTensor rejects this input layout for this op: skip it
                    errors.append(f"{type(e).__name__}: {e}")
                    continue
                for c in cands:
                    if _valid(c, ins, node, self.mesh_shape, partial_inputs=summed, ties=self.ties):
                        found.setdefault((c.inputs, c.outputs), c)
        for c in op_rules.more_candidates(node, list(found.values()), self.mesh_shape):
            vals = [a.meta["val"] for a in ins] + list(output_vals(node))
            if all(
                pl is None or v is None or evenly_divisible(v.shape, pl, self.mesh_shape)
                for pl, v in zip((*c.inputs, *c.outputs), vals)
            ):
                found.setdefault((c.inputs, c.outputs), c)
        if not found:
            if str(op) not in self.warned:
                self.warned.add(str(op))
                why = errors[0] if errors else "DTensor has no sharding rule for it"
                warn(
                    log,
                    "autoshard: no sharding strategy for %s (%s); it runs replicated (every input gathered to "
                    "[R, ...]). Register a rule with torch.distributed.tensor.experimental.register_sharding to "
                    "shard it.",
                    op,
                    why[:200],
                )
            rep = tuple(Replicate() for _ in self.mesh_shape)
            return [
                tc.RawStrategy(
                    tuple(rep for _ in ins), tuple(rep if v is not None else None for v in output_vals(node))
                )
            ]
        return list(found.values())

    def follow(self, node: fx.Node, k: int, placement: Placements) -> tc.RawStrategy | None:
        self._cur = node
        return self._follow(self._key_of(node), k, placement)

    def _rules(self, node: fx.Node, args: tuple, kwargs: dict) -> tc.AxisRules | None:
        key = self._key_of(node)
        if key in self._rules_of:
            return self._rules_of[key]
        rules = tc.single_dim_rules(node.target, args, kwargs, self.mesh, out_val=node.meta.get("val"))
        if rules is None or not rules.rules or len(rules.rules[0]) != rules.num_outputs + len(tensor_args(node)):
            rules = None
        self._rules_of[key] = rules
        return rules

    def _follow_uncached(self, _key: tuple, k: int, placement: Placements) -> tc.RawStrategy | None:
        node = self._cur
        args, kwargs = _meta_args(node)
        rules = self._rules(node, args, kwargs)
        if rules is not None:
            ins = tensor_args(node)
            raw = _follow_rules(rules, k, placement, len(ins))
            if raw is not None and _valid(raw, ins, node, self.mesh_shape):
                return raw
            # an uneven shard on some axis: replicate there instead, largest axis first (what DTensor's own
            # selection ends up doing, without its exhaustive expansion, which is slow on big meshes)
            fixed = list(placement)
            for axis in sorted(range(len(fixed)), key=lambda a: -self.mesh_shape[a]):
                fixed[axis] = Replicate()
                raw = _follow_rules(rules, k, tuple(fixed), len(ins))
                if raw is not None and _valid(raw, ins, node, self.mesh_shape):
                    return raw
            return None
        try:
            raw = tc.propagate(node.target, args, kwargs, self.mesh, {k: placement}, out_val=node.meta.get("val"))
        except Exception as e:
            log.debug("no propagation of %s for %s through %s: %s", placement, node.name, node.target, e)
            return None
        return raw if _valid(raw, tensor_args(node), node, self.mesh_shape) else None


def _move_cost(have: Placement, need: Placement | None) -> float:
    """Rough price of turning ``have`` into ``need`` on one axis, to rank per-axis rules the way DTensor's
    min-cost selection does (free local chunking < reduce-scatter = all-gather < all-to-all < all-reduce)."""
    if need is None or have == need:
        return 0.0
    if isinstance(have, Replicate):
        return 0.01 if isinstance(need, Shard) else (0.05 if isinstance(need, Partial) else math.inf)
    if isinstance(have, Partial):
        return 2.0 if isinstance(need, Replicate) else (1.0 if isinstance(need, Shard) else math.inf)
    if isinstance(have, Shard):
        return 1.0 if isinstance(need, Replicate) else (1.5 if isinstance(need, Shard) else math.inf)
    return math.inf


def _follow_rules(rules: tc.AxisRules, k: int, placement: Placements, n_in: int) -> tc.RawStrategy | None:
    """What a follower does given its producer's layout on input ``k`` (other inputs as if Replicate): on each
    axis independently, the cheapest rule to reach from there."""
    nout = rules.num_outputs
    rep = Replicate()
    chosen = []
    for have in placement:
        best, best_cost = None, math.inf
        for rule in rules.rules:
            cost = _move_cost(have, rule[nout + k])
            cost += sum(_move_cost(rep, rule[nout + i]) for i in range(n_in) if i != k)
            if cost < best_cost:
                best, best_cost = rule, cost
        if best is None:
            return None
        chosen.append(best)
    axes = range(len(placement))
    outs = tuple(None if chosen[0][o] is None else tuple(r[o] for r in chosen) for o in range(nout))
    ins = tuple(tuple(r[nout + i] for r in chosen) for i in range(n_in))
    return tc.RawStrategy(ins, outs) if all(len(x) == len(axes) for x in ins) else None


__all__ = ["CandidateEnumerator", "axis_ties", "evenly_divisible", "shard_factor", "summed"]
