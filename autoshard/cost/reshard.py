"""Resharding cost as the planner sees it: the collectives' time, or a prohibitive cost when DTensor cannot
make the move at all (a Shard becoming Partial), so the solver never picks such a pair."""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement

from autoshard.cluster import ClusterProfile
from autoshard.cost.comm import redistribute_time

# Ten minutes per move: larger than any real step, small enough to keep the integer objective bounded.
IMPOSSIBLE_S = 600.0


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
        return IMPOSSIBLE_S
