"""A stage's backward graph split in two: the input-gradient part and the weight-gradient part.

Zero-bubble pipeline schedules (Qi et al. 2024; ``torch.distributed.pipelining``'s
``ScheduleInterleavedZeroBubble``) run a micro-batch's backward as two actions: B, the gradients of the stage's
received activations (which the previous stage waits for), and W, the parameters' gradients (which nobody
waits for), placed later to fill the schedule's bubbles. A compiled stage has one backward graph that makes
both, so here it is cut:

- the input part is every node the input gradients need (their ancestors); it returns the input gradients, then
  the values it made that the weight part reads (the carry);
- the weight part is every other node the parameters' gradients need; its arguments are the backward's own
  arguments it reads (saved activations, output gradients) and the carry.

Nodes both need run once, in the input part. Collectives go with the part that needs them: the
data-parallel reduction of a weight gradient runs in W, on every rank of the stage's sub-mesh in the same order
(they all run one schedule). Every output of the original graph is made by exactly one part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx as fx

from autoshard.errors import InternalError


@dataclass(frozen=True)
class SplitBackward:
    """The two graphs and how to call them (see the module docstring)."""

    inputs: fx.GraphModule  # (backward args...) -> (input grads..., carry...)
    weights: fx.GraphModule  # (args[i] for i in arg_slots..., carry...) -> (weight grads...)
    arg_slots: tuple[int, ...]  # the backward's arguments the weight part reads, by position
    n_input_grads: int


def _ancestors(roots: Sequence[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def split_backward(gm: fx.GraphModule, is_input_grad: Sequence[bool]) -> SplitBackward:
    """Cut ``gm`` (a backward graph whose outputs are gradients; ``is_input_grad[k]``: whether output ``k`` is a
    received activation's gradient rather than a parameter's) into its input and weight parts."""
    outs = list(gm.graph.find_nodes(op="output")[0].args[0])
    if len(outs) != len(is_input_grad):
        raise InternalError(f"the backward graph has {len(outs)} outputs, {len(is_input_grad)} roles given")
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    first = _ancestors([o for o, f in zip(outs, is_input_grad) if f])
    second = _ancestors([o for o, f in zip(outs, is_input_grad) if not f]) - first
    # what the weight part reads: its nodes' inputs, and its outputs the input part already made
    reads = {a for n in second for a in n.all_input_nodes}
    reads |= {o for o, f in zip(outs, is_input_grad) if not f and isinstance(o, fx.Node)}
    # values of the input part it reads are carried over (not arguments: those it takes itself)
    carry = [n for n in gm.graph.nodes if n in first and n.op != "placeholder" and n in reads]
    used_args = [i for i, p in enumerate(placeholders) if p in reads]

    g1 = fx.Graph()
    env1: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env1[n] = g1.placeholder(n.name)
            env1[n].meta = dict(n.meta)
        elif n in first and n.op != "output":
            env1[n] = g1.node_copy(n, lambda a: env1[a])
    g1.output(
        [env1[o] if isinstance(o, fx.Node) else o for o, f in zip(outs, is_input_grad) if f] + [env1[c] for c in carry]
    )

    g2 = fx.Graph()
    env2: dict[fx.Node, fx.Node] = {}
    for i in used_args:
        p = placeholders[i]
        env2[p] = g2.placeholder(p.name)
        env2[p].meta = dict(p.meta)
    for c in carry:
        env2[c] = g2.placeholder(f"carry_{c.name}")
        env2[c].meta = dict(c.meta)
    for n in gm.graph.nodes:
        if n in second and n.op not in ("placeholder", "output"):
            env2[n] = g2.node_copy(n, lambda a: env2[a])
    g2.output([env2[o] if isinstance(o, fx.Node) else o for o, f in zip(outs, is_input_grad) if not f])
    return SplitBackward(fx.GraphModule(gm, g1), fx.GraphModule(gm, g2), tuple(used_args), sum(is_input_grad))


__all__ = ["SplitBackward", "split_backward"]
