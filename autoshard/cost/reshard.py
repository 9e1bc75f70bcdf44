"""Resharding cost as the planner sees it: the collectives' time, or ``math.inf`` when DTensor cannot make the
move at all (a Shard becoming Partial, a strided shard it cannot undo). The strategy pass drops candidates
whose internal moves are impossible and the integer program forbids the pairs (``IntraOpProblem``), so a
plan never contains a move the runtime cannot execute."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement

from autoshard.cluster import ClusterProfile
from autoshard.cost.comm import redistribute_time

def reshard_time(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    global_shape: Sequence[int],
    itemsize: int,
    mesh_shape: Sequence[int],
    cluster: ClusterProfile,
) -> float:
    if tuple(src) == tuple(dst):
        return 0.0
    try:
        return redistribute_time(tuple(src), tuple(dst), tuple(global_shape), itemsize, tuple(mesh_shape), cluster)
    except ValueError:
        return math.inf
