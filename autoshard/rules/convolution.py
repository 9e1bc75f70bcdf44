"""Convolutions split on the batch over several mesh axes.

DTensor's convolution handler takes one mesh axis per tensor dimension, so a batch split over two axes
(``[S(0), S(0)]``) has no DTensor execution. A convolution split only on the batch (weights whole) is each
rank convolving its own images, with a partial-sum weight gradient: the lowering runs it locally with the
plan's placements. Candidates and FLOPs are DTensor's and torch's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autoshard.ir import NodeSharding
from autoshard.rules.base import OpRule


def _weight_arg() -> dict[Any, int]:
    aten = torch.ops.aten
    return {aten.convolution.default: 1, aten.convolution_backward.default: 2}


def runs_local(node: fx.Node, sharding: NodeSharding) -> bool:
    w = _weight_arg().get(node.target)
    if w is None or w >= len(sharding.inputs) or not sharding.inputs[w]:
        return False
    if not all(isinstance(p, Replicate) for p in sharding.inputs[w]):
        return False
    placed = [pl for pl in list(sharding.inputs) + list(sharding.outputs) if pl]
    return all(not isinstance(p, Shard) or p.dim == 0 for pl in placed for p in pl)


RULE = OpRule("batch-split convolution", lambda: frozenset(_weight_arg()), runs_local=runs_local)
