"""strategies: candidate placements for every decision group, with their per-device costs.

Needs: ``coarsen`` (groups, ``autoshard_follow``) and ``share_layers`` (``ctx.layer_of_group``).

Guarantees on exit: ``ctx.strategies[g]`` is a non-empty list of ``GroupStrategy`` for every group g, where
- the anchor's candidates come from DTensor's op-strategy registries (queried through ``_torch_compat``) for
  ops, from every even R/S(d) layout for parameters and inputs (filtered by ``config.constraints``), Replicate
  for buffers, tangents and factory ops, and from our own rules where DTensor has none (CPU flash attention
  forward and backward: batch or head sharded). An op with no rule at all gets Replicate with a warning;
- followers take the layout DTensor itself would produce from their producer's layout; when DTensor must
  first reshard the producer (a view of a sharded dim, a non-linear op of a Partial), that reshard is costed
  in ``comm_s`` — the lowering does exactly that reshard; a follower handed a Partial may also reduce it first
  (to R, or reduce-scatter it to a Shard: Megatron-SP's sequence-sharded residual), priced the same way;
- candidates that need uneven shards or non-sum Partial inputs are pruned; duplicates are merged;
- identical repeated layers share the canonical layer's list (same object).

Costs per candidate (one device): compute = roofline over local FLOPs and bytes; activation bytes = outputs of
forward nodes that the backward reads; state bytes = parameter + gradient + optimizer state.

A trained parameter's candidates also come in ZeRO-1/2 forms (``parameter_forms.state_variants``: gradient and
optimizer state sharded further) and, per ``PlanConfig.offload``, in a ZeRO-Offload form (``offload_variants``: master
and optimizer state in host memory, the host link's copies and the host's optimizer step in ``compute_s``);
"optimizer"/"params" keep only offloaded candidates, "auto" lets the solver weigh them (never on a CPU cluster, whose
host memory is the device's), "none" offers none. A frozen parameter (``ir.is_frozen``: ``requires_grad=False``, a LoRA
base weight) holds no gradient and no optimizer state: its state bytes are its own, its candidates its layouts alone (no
ZeRO or offloaded form, whatever ``offload`` says), and, having no gradient edge, it pays no gradient reduction.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from collections.abc import Mapping

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autoshard import _torch_compat as tc
from autoshard import rules
from autoshard.compiler.candidates import CandidateEnumerator, evenly_divisible, shard_factor, summed
from autoshard.compiler.capture_recompute import is_recomputed, stored
from autoshard.compiler.context import PassContext
from autoshard.compiler.follow import follow_members
from autoshard.compiler.parameter_forms import forced_offload, offload_variants, state_variants
from autoshard.cost.comm import axis_collective_time, point_to_point_time
from autoshard.cost.compute import compute_time, op_flops
from autoshard.errors import InputError, InternalError
from autoshard.ir import (
    Group,
    GroupStrategy,
    NodeOut,
    gather_group,
    gather_group_sizes,
    is_frozen,
    is_state,
    output_vals,
    tensor_args,
)

log = logging.getLogger(__name__)
aten = torch.ops.aten


def _placeholder_candidates(node: fx.Node, ctx: PassContext) -> list[tc.RawStrategy]:
    role = node.meta["autoshard_role"]
    val = node.meta["val"]
    nd = len(ctx.mesh_shape)
    rep = tuple(Replicate() for _ in range(nd))
    if role.kind in ("buffer", "tangent") or val.ndim == 0:
        cands = [rep]
    else:
        cands = [
            tuple(p) for p in tc.all_placements(nd, val.ndim) if evenly_divisible(val.shape, tuple(p), ctx.mesh_shape)
        ]
    alias = ""
    if role.kind == "input" and ctx.signature is not None and role.index < ctx.signature.num_tensors:
        alias = ctx.signature.names[role.index]
    pinned = ctx.config.constraint_for(role.name, role.kind, ctx.mesh_names, alias)
    if pinned is not None:
        cands = [c for c in cands if all(q is None or q == p for p, q in zip(c, pinned))]
        if not cands:
            raise InputError(
                f"constraint on {role.name} {tuple(val.shape)} asks for placements {pinned} on mesh "
                f"{dict(zip(ctx.mesh_names, ctx.mesh_shape))}, which does not divide evenly; pin a dim whose size "
                "is a multiple of the axis size"
            )
    return [tc.RawStrategy((), (c,)) for c in cands]


@dataclasses.dataclass(frozen=True)
class _OpFacts:
    """What pricing a member needs that no layout changes: its global output and input bytes, FLOPs, dtype,
    and whether it is recomputed or stored (worked out once per node, not once per candidate)."""

    out_bytes: tuple[int | None, ...]
    in_bytes: tuple[int, ...]
    flops: float
    dtype: str
    recomputed: bool
    stored: bool
    exchanges: bool  # an op rule of ours that communicates inside the op (``rules.exchanges``)


def _facts(node: fx.Node, memo: dict[str, _OpFacts | None]) -> _OpFacts | None:
    if node.name in memo:
        return memo[node.name]
    facts = None
    if node.op != "placeholder" and node.target is not operator.getitem:
        vals = output_vals(node)
        dtype = str(vals[0].dtype).replace("torch.", "") if vals and vals[0] is not None else "float32"
        facts = _OpFacts(
            tuple(None if v is None else v.numel() * v.element_size() for v in vals),
            tuple(a.meta["val"].numel() * a.meta["val"].element_size() for a in tensor_args(node)),
            op_flops(node.target, *_real_args(node)),
            dtype,
            is_recomputed(node),
            stored(node),
            rules.rule_for(node.target) is not None,
        )
    memo[node.name] = facts
    return facts


def _layout(p: tuple, ms: tuple[int, ...], seen: dict) -> tuple[tuple, int, int]:
    """A layout's (itself, shard factor, mask of the mesh axes it shards), remembered by identity in ``seen``: the
    layouts priced are the enumerator's cached objects, and the entry holds its layout, so an id is not reused while
    it is remembered (hashing placements is slow: Python-level ``__hash__`` and ``isinstance`` per element)."""
    factor, mask = 1, 0
    for axis, (q, n) in enumerate(zip(p, ms)):
        if isinstance(q, Shard):
            factor *= n
            mask |= 1 << axis
    seen[id(p)] = entry = (p, factor, mask)
    return entry


def _cost(
    group: Group,
    nodes: dict[str, fx.Node],
    outs: list[NodeOut],
    ins: list[tuple],
    comm: float,
    ctx: PassContext,
    memo: dict[str, _OpFacts | None],
    seen: dict[int, tuple[tuple, int, int]],
) -> GroupStrategy:
    """``seen``: ``_layout``'s memo."""
    ms = ctx.mesh_shape
    compute = 0.0
    act = 0
    for name, o, i in zip(group.members, outs, ins):
        node = nodes[name]
        f = _facts(node, memo)
        if f is None:
            continue
        local_bytes = in_bytes = mask = 0
        for b, p in zip(f.out_bytes, o):
            if p is not None:
                _, factor, bits = seen.get(id(p)) or _layout(p, ms, seen)
                mask |= bits
                if b is not None:
                    local_bytes += b // factor
            elif b is not None:
                local_bytes += b
        for b, p in zip(f.in_bytes, i):
            if p is None:
                in_bytes += b
                continue
            _, factor, bits = seen.get(id(p)) or _layout(p, ms, seen)
            mask |= bits
            in_bytes += b // factor
        split = math.prod(n for axis, n in enumerate(ms) if mask >> axis & 1)
        once = compute_time(f.flops / split, local_bytes + in_bytes, ctx.cluster.device, f.dtype)
        if f.exchanges:
            # what the op's own local call communicates (the balanced causal attention's swap, a
            # vocabulary-parallel loss's row all-reduces; a ring's chunk sends, "overlapped": they hide behind
            # the op's compute)
            sends = rules.exchanges(node, i, ms)
            hidden = sum(
                point_to_point_time(b, ms, axis, ctx.cluster) for kind, axis, b in sends if kind == "overlapped"
            )
            once = max(once, hidden) + sum(
                point_to_point_time(b, ms, axis, ctx.cluster)
                if kind == "point_to_point"
                else axis_collective_time(kind, b, ms, axis, ctx.cluster)
                for kind, axis, b in sends
                if kind != "overlapped"
            )
        # a recomputed op (autoshard/compiler/capture_recompute.py) runs again in the backward and is not saved for it
        compute += 2 * once if f.recomputed else once
        if f.stored:  # saved for the backward (or for a replay), not replayed
            act += local_bytes
    state = param = grad = opt = 0
    if group.kind == "parameter":
        v = nodes[group.anchor].meta["val"]
        param = v.numel() * v.element_size() // shard_factor(outs[0][0], ms)
        grad = 0 if is_frozen(nodes[group.anchor]) else param  # a frozen weight: no gradient, no optimizer state
        opt = grad * ctx.config.optimizer_factor
        state = param + grad + opt
    elif group.kind == "buffer":
        v = nodes[group.anchor].meta["val"]
        param = v.numel() * v.element_size()
        state = param
    return GroupStrategy(tuple(outs), tuple(ins), compute, comm, act, state, param, grad, opt)


def _real_args(node: fx.Node) -> tuple[tuple, dict, object]:
    return tuple(_real(a) for a in node.args), {k: _real(v) for k, v in node.kwargs.items()}, node.meta.get("val")


def _real(a: object) -> object:  # (not a recursive closure: that is a reference cycle per call)
    if isinstance(a, fx.Node):
        return a.meta.get("val")
    if isinstance(a, (list, tuple)):
        return type(a)(_real(x) for x in a)
    return a


def group_strategies(
    group: Group,
    nodes: dict[str, fx.Node],
    ctx: PassContext,
    en: CandidateEnumerator,
    gather_sizes: Mapping[tuple, int],
) -> list[GroupStrategy]:
    """Every candidate of ``group``; ``gather_sizes``: ``ir.gather_group_sizes`` of the graph (a parameter's gather
    inside the group rides its layer's gather group)."""
    anchor = nodes[group.anchor]
    ms = ctx.mesh_shape
    rep = tuple(Replicate() for _ in ms)
    if anchor.op == "placeholder":
        cands = _placeholder_candidates(anchor, ctx)
    elif group.kind == "factory":
        cands = [tc.RawStrategy((), tuple(rep if v is not None else None for v in output_vals(anchor)))]
    else:
        cands = en.anchor(anchor)
    pos = {name: i for i, name in enumerate(group.members)}
    result: dict[tuple, GroupStrategy] = {}
    trained = group.kind == "parameter" and not is_frozen(anchor)  # (a frozen one has no state to shard or offload)
    for cand in cands:
        for outs, ins, comm in follow_members(group, nodes, pos, cand, en, ctx, gather_sizes):
            s = _cost(group, nodes, outs, ins, comm, ctx, en.facts, en.layouts)
            key = (s.outputs, s.inputs)
            if key not in result:
                result[key] = s
                if trained and ctx.config.shard_state:
                    for v in state_variants(s, anchor.meta["val"], ctx):
                        result[(*key, v.grad_placements, v.state_placements)] = v
                if trained:
                    for v in offload_variants(s, anchor.meta["val"], ctx):
                        result[(*key, v.grad_placements, v.state_placements, v.offload)] = v
    if trained and ctx.config.offload in ("optimizer", "params"):
        result = forced_offload(result, ctx.config.offload, ms, anchor.meta["autoshard_role"].name)
    result = _prune_dominated(group, nodes, result)
    if not result:
        # all-Replicate always propagates; reaching here means the group's own ops reject replication
        raise InternalError(
            f"autoshard found no valid layout for group {group.anchor} ({anchor.target}) on mesh "
            f"{dict(zip(ctx.mesh_names, ms))}; please report this graph"
        )
    return list(result.values())


def _interface(group: Group, nodes: dict[str, fx.Node]) -> tuple[list[int], list[tuple[int, int]]]:
    """Member outputs read outside the group, and (member, arg) inputs produced outside it (or not followed)."""
    members = set(group.members)
    outs, ins = [], []
    for m, name in enumerate(group.members):
        node = nodes[name]
        if any(u.name not in members or u.op == "output" for u in node.users):
            outs.append(m)
        if node.op == "placeholder" or node.target is operator.getitem:
            continue
        follow = node.meta.get("autoshard_follow", -1)
        for k, src in enumerate(tensor_args(node)):
            if src.name not in members or k != follow:
                ins.append((m, k))
    if group.kind in ("parameter", "input") and 0 not in outs:
        outs.append(0)
    return outs, ins


def _prune_dominated(
    group: Group, nodes: dict[str, fx.Node], found: dict[tuple, GroupStrategy]
) -> dict[tuple, GroupStrategy]:
    """Of candidates that look the same from outside the group (same layouts on every tensor crossing its
    boundary), keep the one with the least time, then memory: the others can never be better."""
    outs, ins = _interface(group, nodes)
    faces: dict[tuple, list[tuple]] = {}
    for order, (key, s) in enumerate(found.items()):
        # a parameter's gradient leaves the group in its gradient layout (ZeRO-2's differs from the compute one)
        grad = s.grad_placements if s.grad_placements is not None else s.outputs[0][0]
        face = (tuple(s.outputs[m] for m in outs), tuple(s.inputs[m][k] for m, k in ins), grad)
        faces.setdefault(face, []).append(((s.compute_s + s.comm_s, s.state_bytes + s.activation_bytes), order, key, s))
    kept: dict[tuple, GroupStrategy] = {}
    for cands in faces.values():
        for score, order, key, s in cands:
            dominated = any(  # ties go to the candidate found first
                o[0] <= score[0] and o[1] <= score[1] and (o[0], o[1], k2) < (score[0], score[1], order)
                for o, k2, _, _ in cands
                if k2 != order
            )
            if not dominated:
                kept[key] = s
    return kept


def _signature(
    group: Group, nodes: dict[str, fx.Node], en: CandidateEnumerator, gather_sizes: Mapping[tuple, int]
) -> tuple | None:
    """Everything an op group's candidates and their costs depend on, per member: its op signature (target,
    argument shapes, strides, dtypes and constants), which member it follows, where each tensor argument comes
    from (a member's position, or outside), whether it is state, stored for the backward or recomputed, and
    whether it is read outside the group, and the size of the gather group its parameter gathers ride. Two groups with
    equal signatures get equal candidate lists (q_proj and k_proj of one shape, an expert's two up-projections, a
    forward and its recomputation). None for groups of placeholders, whose candidates also depend on their names
    (constraints)."""
    if group.kind != "op":
        return None
    pos = {name: i for i, name in enumerate(group.members)}
    sig = []
    for name in group.members:
        node = nodes[name]
        if node.op != "call_function":
            return None
        sig.append(
            (
                en.key_id(node),
                node.meta.get("autoshard_follow", -1),
                tuple(pos.get(a.name, -1) for a in tensor_args(node)),
                tuple(summed(a) for a in tensor_args(node)) if name == group.anchor else (),
                is_state(node),
                stored(node),
                is_recomputed(node),
                any(u.name not in pos or u.op == "output" for u in node.users),
                gather_group(node, gather_sizes) if any(is_state(a) for a in tensor_args(node)) else 0,
            )
        )
    return (group.kind, tuple(sig))


def strategies(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    nodes = {n.name: n for n in gm.graph.nodes}
    cache = ctx.cache  # the other planning attempts' (a copy of the same capture, tagged differently)
    en = cache.enumerator if cache is not None and cache.enumerator is not None else CandidateEnumerator(ctx)
    en.facts = {}  # (a node's facts hold its recomputation flags)
    en.layouts = {}
    sizes = gather_group_sizes(gm)
    canon = ctx.layer_of_group or {g.id: g.id for g in ctx.groups}
    todo = [g for g in ctx.groups if canon[g.id] == g.id]
    # by ``_signature``: groups priced already
    alike: dict[tuple, list[GroupStrategy]] = cache.alike if cache is not None else {}
    if cache is not None:
        cache.enumerator = en
    for i, g in enumerate(todo):
        sig = _signature(g, nodes, en, sizes)
        if sig is not None and sig in alike:
            ctx.strategies[g.id] = alike[sig]
        else:
            ctx.strategies[g.id] = group_strategies(g, nodes, ctx, en, sizes)
            if sig is not None:
                alike[sig] = ctx.strategies[g.id]
        if i % 8 == 7:
            ctx.report("strategies", (i + 1) / len(todo), f"{i + 1}/{len(todo)} decision groups")
    for g in ctx.groups:
        if canon[g.id] != g.id:
            ctx.strategies[g.id] = ctx.strategies[canon[g.id]]
    ctx.stats["strategies"] = sum(len(ctx.strategies[g.id]) for g in ctx.groups if canon[g.id] == g.id)
    log.info("strategies: %d candidates over %d groups", ctx.stats["strategies"], len(ctx.groups))
    return gm
