"""How a decision group's followers take its anchor's candidate (used by ``strategies``).

A follower takes the layout DTensor produces from its producer's layout. Two kinds of producer layout also
branch, each move priced inside the group the way the lowering runs it:

- a Partial may be reduced first: to Replicate, or reduce-scattered to a Shard of any dim (a row-parallel
  matmul's output onto the sequence before the residual add: Megatron-SP);
- a Shard that the follower would gather or turn into a strided shard (a view that flattens the sharded dim
  *inside* another, e.g. an einsum's ``(c, e) -> c*e`` with ``e`` sharded) may first move to another dim (an
  all-to-all) or be gathered. A strided shard is a layout the next matmul cannot contract, so without this the
  group's only ways out are gathers: the expert-sharded output of a mixture of experts could not be sent back
  to the token-sharded combine (expert parallelism's second all-to-all).

One decision per producer, and at most ``_MAX_BRANCHES`` ways per anchor candidate.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping, Sequence

import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autoshard import _torch_compat as tc
from autoshard.buckets import gather_axes
from autoshard.compiler.candidates import CandidateEnumerator
from autoshard.compiler.context import PassContext
from autoshard.cost.reshard import reshard_time as redistribute_time
from autoshard.ir import Group, Placements, gather_group, is_parameter, tensor_args

__all__ = ["follow_members"]

_MAX_BRANCHES = 16  # ways one anchor candidate may be followed (producers moved first or not)


def follow_members(
    group: Group,
    nodes: dict[str, fx.Node],
    pos: dict[str, int],
    cand: tc.RawStrategy,
    en: CandidateEnumerator,
    ctx: PassContext,
    gather_sizes: Mapping[tuple, int],
) -> Iterator[tuple[list, list, float]]:
    """Every way the group's followers can take the anchor candidate ``cand`` (see the module docstring).
    Yields (outputs, inputs, in-group comm seconds) per member. A parameter's gather rides its layer's gather
    group (``ir.gather_group``, of ``gather_sizes``), as the integer program prices it between groups."""
    ms = ctx.mesh_shape
    # (outputs, inputs, comm, the layout each moved producer was moved to: a value is moved once)
    states: list[tuple[list, list, float, dict]] = [([cand.outputs], [cand.inputs], 0.0, {})]
    for name in group.members[1:]:
        node = nodes[name]
        nxt: list[tuple[list, list, float, dict]] = []
        for outs, ins, comm, moved in states:
            if node.target is operator.getitem:
                src = pos[node.args[0].name]
                nxt.append((outs + [(outs[src][node.args[1]],)], ins + [()], comm, moved))
                continue
            k = node.meta["autoshard_follow"]
            producer = tensor_args(node)[k]
            have = outs[pos[producer.name]][0]
            v = producer.meta["val"]
            shape = tuple(v.shape)
            branch = len(states) < _MAX_BRANCHES and producer.name not in moved
            wants = _reductions(have, shape, ms) if branch else [moved.get(producer.name, have)]
            if branch and len(wants) == 1 and _takes_apart(en.follow(node, k, have), k, have):
                wants += _reshards(have, shape, ms)
            for want in wants:
                raw = en.follow(node, k, want)  # (the enumerator caches it)
                if raw is None:
                    continue
                need = raw.inputs[k]
                move = 0.0
                if need != have:
                    rides = (
                        is_parameter(producer)
                        and gather_axes(tuple(have), tuple(need), shape, ms) is not None
                        and gather_group(node, gather_sizes)
                    )
                    move = redistribute_time(
                        have,
                        need,
                        shape,
                        v.element_size(),
                        ms,
                        ctx.cluster,
                        waits=not rides,
                        bundle_share=1.0 / rides if rides else 0.0,
                    )
                    if math.isinf(move):  # a move DTensor cannot make: this branch cannot run
                        continue
                done = {**moved, producer.name: want} if len(wants) > 1 else moved
                nxt.append((outs + [raw.outputs], ins + [raw.inputs], comm + move, done))
        states = nxt
    for outs, ins, comm, _ in states:
        yield outs, ins, comm


def _reductions(have: Placements, shape: tuple[int, ...], ms: Sequence[int]) -> list[Placements]:
    """``have`` itself, and where it holds a Partial: the Partial axes reduced to Replicate, or scattered to a
    Shard of each dim they divide evenly (nothing else sharding that dim)."""
    partial = [a for a, p in enumerate(have) if p.is_partial()]
    if not partial:
        return [have]
    out = [have, tuple(Replicate() if a in partial else p for a, p in enumerate(have))]
    for d in range(len(shape)):
        taken = [a for a, p in enumerate(have) if isinstance(p, Shard) and p.dim == d]
        n = math.prod(ms[a] for a in partial + taken)
        if not taken and shape[d] % n == 0 and shape[d] >= n:
            out.append(tuple(Shard(d) if a in partial else p for a, p in enumerate(have)))
    return out


def _reshards(have: Placements, shape: tuple[int, ...], ms: Sequence[int]) -> list[Placements]:
    """Per mesh axis holding a plain Shard: that axis gathered, or its shard moved to each other dim it divides
    evenly (nothing else sharding that dim)."""
    out: list[Placements] = []
    for a, p in enumerate(have):
        if type(p) is not Shard:
            continue
        out.append(tuple(Replicate() if b == a else q for b, q in enumerate(have)))
        for d in range(len(shape)):
            if d == p.dim or any(isinstance(q, Shard) and q.dim == d for q in have):
                continue
            if shape[d] % ms[a] == 0 and shape[d] >= ms[a]:
                out.append(tuple(Shard(d) if b == a else q for b, q in enumerate(have)))
    return out


def _takes_apart(raw: tc.RawStrategy | None, k: int, have: Placements) -> bool:
    """Whether following ``have`` as is is impossible, gathers it first or leaves a strided shard (DTensor's
    ``_StridedShard``: torch 2.13 makes one where 2.11 has no strategy): moving the shard elsewhere may do better."""
    sharded = any(isinstance(p, Shard) for p in have)
    if raw is None:  # no strategy takes it (torch 2.11's flatten of an inner shard)
        return sharded
    if sharded and tuple(raw.inputs[k]) != tuple(have):
        return True
    return any(tc.is_strided_shard(p) for pl in raw.outputs if pl is not None for p in pl)
