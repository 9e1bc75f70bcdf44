"""Resharding cost as the planner sees it: the collectives' time, or ``math.inf`` when DTensor cannot make the
move at all (a Shard becoming Partial, a strided shard it cannot undo). The strategy pass drops candidates
whose internal moves are impossible and the integer program forbids the pairs (``IntraOpProblem``), so a
plan never contains a move the runtime cannot execute. ``waits``: compute waits on the move right after running,
which adds the links' ``sync`` (``autoshard.cost.comm.sync_time``). A move that rides a bundle (a gradient bucket,
a layer's gathered parameters, the masters gathered after the optimizer step) pays its bytes and a share of the
bundle's latency and sync (``bundle_share``): the integer program then prices a bundle once, as the lowering runs it,
when its members are all chosen (``autoshard/solver/intra_op.py``)."""

from __future__ import annotations

import functools
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
    bundle_share: float = 0.0,
) -> float:
    """``bundle_share`` > 0: the move rides a bundle of moves the lowering makes one collective
    (``autoshard/buckets.py``): its bytes cross at full bandwidth (``ClusterProfile.bundled``) and it pays that share
    of the bundle's latency and sync, ``waits`` aside."""
    if tuple(src) == tuple(dst):
        return 0.0
    move = (tuple(src), tuple(dst), tuple(global_shape), itemsize, tuple(mesh_shape))
    if bundle_share > 0:  # the bundle's latency and sync: the move's whole time, waited on, less its bytes' time
        lean = _time(*move, cluster.bundled(), False)
        return lean + bundle_share * (_time(*move, cluster, True) - lean)
    return _time(*move, cluster, waits)


@functools.lru_cache(maxsize=1 << 16)
def _time(
    src: tuple, dst: tuple, shape: tuple, itemsize: int, mesh_shape: tuple, cluster: ClusterProfile, waits: bool
) -> float:
    """Memoized: the planner asks for the same move of the same shape thousands of times (every candidate pair of
    every edge, each layer alike); every argument is an immutable value, the cluster a frozen dataclass."""
    try:
        steps = redistribute_steps(src, dst, shape, itemsize, mesh_shape, cluster)
    except ValueError:
        return math.inf
    return sum(st.time for st in steps) + (sync_time(steps, mesh_shape, cluster) if waits else 0.0)
