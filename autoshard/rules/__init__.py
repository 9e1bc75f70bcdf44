"""Op rules: what autoshard knows about an op family beyond DTensor's strategies and torch's FLOP counter.

One file per family, listed in ``_all_rules``. A rule can give

- ``candidates(node, ties)``: the placements the planner may choose for the op (``autoshard/compiler/strategies.py``
  asks the rule instead of DTensor, which has none for the op, or not the ones we want);
- ``runs_local(node, sharding)``: whether the lowering runs the op on each rank's local shards with the plan's
  placements instead of through DTensor's dispatch (``autoshard/compiler/lower.py``), when DTensor cannot run that
  layout;
- ``local_call(node, sharding)``: how that local run calls the op where the traced call would be wrong on a
  shard (causal attention on a sequence shard needs its rank's query offset);
- ``exchanges(node, inputs, mesh_shape)``: what that local call communicates (priced with the op);
- ``more_candidates(node, found, mesh_shape)``: layouts added to DTensor's candidates (a class-sharded loss);
- ``flops``: FLOP formulas for the op's overloads that ``torch.utils.flop_counter`` lacks (``cost/compute.py``).

Adding an op family (ring attention, an MoE dispatch) is a new file here (an ``OpRule`` named ``RULE``) and
its module in the import and the tuple of ``_all_rules``. Rules are looked up by the op's name, so a rule may
name a library's custom op (``expert_mm``: transformers' grouped expert matmul).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.fx as fx

from autoshard import _torch_compat as tc
from autoshard.ir import NodeSharding
from autoshard.rules import attention, convolution, expert_mm, random_draws, vocab_loss
from autoshard.rules.base import OpRule


def _all_rules() -> tuple[OpRule, ...]:
    return (attention.RULE, convolution.RULE, expert_mm.RULE, random_draws.RULE, vocab_loss.RULE)


@functools.lru_cache(maxsize=1)
def _by_op() -> Mapping[str, OpRule]:
    # keyed by the overload's name ("aten.mm.default"): a rule may name an op of a library that registers it
    # later (transformers' custom ops), which no OpOverload object could stand for before then
    return {str(op): rule for rule in _all_rules() for op in rule.ops()}


@functools.lru_cache(maxsize=None)
def rule_for(op: Any) -> OpRule | None:
    """The rule for ``op`` (an OpOverload), or None when DTensor's strategies and torch's counter serve it."""
    return _by_op().get(str(op))  # (cached per op: the strategy pass asks for every member of every candidate)


def candidates(node: fx.Node, ties: Sequence[int]) -> list[tc.RawStrategy] | None:
    """The rule's placements for ``node``, or None when no rule gives candidates for its op."""
    rule = rule_for(node.target)
    return None if rule is None or rule.candidates is None else rule.candidates(node, ties)


def runs_local(node: fx.Node, sharding: NodeSharding) -> bool:
    """Whether the lowering runs ``node`` on local shards (see the module docstring)."""
    rule = rule_for(node.target)
    return rule is not None and rule.runs_local is not None and rule.runs_local(node, sharding)


def local_call(node: fx.Node, sharding: NodeSharding) -> Callable[..., Any] | None:
    """The rule's own local call for ``node`` at ``sharding`` (``call(args, kwargs, mesh)``), or None."""
    rule = rule_for(node.target)
    return None if rule is None or rule.local_call is None else rule.local_call(node, sharding)


def exchanges(node: fx.Node, inputs: Sequence[Any], mesh_shape: Sequence[int]) -> list[tuple[str, int, int]]:
    """What the rule's local call communicates at ``inputs`` (placements per tensor argument):
    ``[("point_to_point" or a collective kind, mesh axis, bytes per device)]``, empty for most ops."""
    rule = rule_for(node.target)
    return [] if rule is None or rule.exchanges is None else rule.exchanges(node, inputs, mesh_shape)


def more_candidates(node: fx.Node, found: Sequence[tc.RawStrategy], mesh_shape: Sequence[int]) -> list[tc.RawStrategy]:
    """Layouts the rule adds to DTensor's candidates ``found`` for ``node`` (empty for most ops)."""
    rule = rule_for(node.target)
    return [] if rule is None or rule.more_candidates is None else rule.more_candidates(node, found, mesh_shape)


@functools.lru_cache(maxsize=1)
def _formulas() -> Mapping[str, Callable[..., int]]:
    return {str(op): f for rule in _all_rules() for op, f in rule.flops().items()}


@functools.lru_cache(maxsize=None)
def flop_formula(op: Any) -> Callable[..., int] | None:
    """The rule's FLOP formula for ``op`` (an OpOverload), or None; it takes the op's arguments as shapes."""
    return _formulas().get(str(op))


__all__ = ["candidates", "exchanges", "flop_formula", "more_candidates", "local_call", "rule_for", "runs_local"]
