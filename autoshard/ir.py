"""Small value types shared by the planning passes (groups, strategies, per-node decisions)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Placement

Placements = tuple[Placement, ...]
# Placements of each output of a node (one entry for a single-tensor node, None for non-tensor outputs).
NodeOut = tuple[Placements | None, ...]


@dataclass(frozen=True)
class Group:
    """Nodes that share one sharding decision: an anchor and the followers that can only follow it."""

    id: int
    anchor: str
    members: tuple[str, ...]  # node names, topological order, anchor first
    kind: str  # "parameter" | "buffer" | "input" | "tangent" | "op" | "factory" | "fallback"
    module: str
    phase: str


@dataclass(frozen=True)
class Edge:
    """A tensor flowing into a group from another group: producer node -> (member position, tensor arg)."""

    src_group: int
    src_node: str
    dst_group: int
    dst_member: int
    dst_arg: int


@dataclass(frozen=True)
class GroupStrategy:
    """One candidate for a whole group: placements for every member, and its costs on one device."""

    outputs: tuple[NodeOut, ...]  # per member
    inputs: tuple[tuple[Placements | None, ...], ...]  # per member: required placement of each tensor arg
    compute_s: float
    comm_s: float  # resharding inside the group (a follower that cannot take its producer's layout)
    activation_bytes: int  # saved-for-backward bytes on one device
    state_bytes: int  # parameter + gradient + optimizer state bytes on one device
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0


@dataclass(frozen=True)
class NodeSharding:
    """The solved layout of one node: ``node.meta["autoshard"]``."""

    group: int
    outputs: NodeOut
    inputs: tuple[Placements | None, ...]
