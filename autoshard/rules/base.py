"""The shape of an op rule (see ``autoshard.rules``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from autoshard import _torch_compat as tc
from autoshard.ir import NodeSharding


@dataclass(frozen=True)
class OpRule:
    """One op family's rule (see the module docstring); ``ops`` lists its overloads."""

    name: str
    # its overloads, or their names ("transformers.grouped_mm_fallback.default": a library's op registered later);
    # resolved on first use: importing a rule touches no op
    ops: Callable[[], frozenset[Any]]
    candidates: Callable[[fx.Node, Sequence[int]], list[tc.RawStrategy]] | None = None
    runs_local: Callable[[fx.Node, NodeSharding], bool] | None = None
    flops: Callable[[], Mapping[Any, Callable[..., int]]] = field(default=lambda: {})
    # how a local run calls the op, where not as traced: (node, sharding) -> None or call(args, kwargs, mesh)
    # taking the DTensor arguments at their planned placements and returning local results
    local_call: Callable[[fx.Node, NodeSharding], Callable[..., Any] | None] | None = None
    # what that local call communicates, for the price: (node, input placements, mesh shape) ->
    # [(kind: "point_to_point" or a collective, mesh axis, bytes per device)]
    exchanges: Callable[[fx.Node, Sequence[Any], Sequence[int]], list[tuple[str, int, int]]] | None = None
    # layouts added to DTensor's own candidates: (node, DTensor's candidates, mesh shape) -> more candidates
    more_candidates: Callable[[fx.Node, Sequence[tc.RawStrategy], Sequence[int]], list[tc.RawStrategy]] | None = None


__all__ = ["OpRule"]
