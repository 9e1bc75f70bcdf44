"""Resharding cost as the planner sees it: the collectives' time, or ``math.inf`` when DTensor cannot make the
move at all (a Shard becoming Partial, a strided shard it cannot undo). The strategy pass drops candidates
whose internal moves are impossible and the integer program forbids the pairs (``IntraOpProblem``), so a
plan never contains a move the runtime cannot execute. ``waits``: compute waits on the move right after running,
which adds the links' ``sync`` (``autoshard.cost.comm.sync_time``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement

from autoshard.cluster.profile import ClusterProfile
from autoshard.cost.comm import redistribute_steps, sync_time


def reshard_time(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    global_shape: Sequence[int],
    itemsize: int,
    mesh_shape: Sequence[int],
    cluster: ClusterProfile,
    waits: bool = False,
) -> float:
    if tuple(src) == tuple(dst):
        return 0.0
    try:
        steps = redistribute_steps(tuple(src), tuple(dst), tuple(global_shape), itemsize, tuple(mesh_shape), cluster)
    except ValueError:
        return math.inf
    return sum(st.time for st in steps) + (sync_time(steps, mesh_shape, cluster) if waits else 0.0)
