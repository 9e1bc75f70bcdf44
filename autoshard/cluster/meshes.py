"""Meshes this process plans for but need not be part of: conventional axis names, mesh strings, and a
``fake`` process group of any world size to hold them (``torch.distributed``'s fake backend: no communication,
every collective returns at once), for planning 1024 devices from a laptop."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch.distributed as dist

from autoshard import _torch_compat as tc
from autoshard.cluster.profile import ClusterProfile
from autoshard.errors import InputError


def default_mesh(cluster: ClusterProfile) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(nodes, devices per node) named ("dp", "tp"); one node: (devices,) named ("dp",)."""
    if cluster.nodes == 1:
        return (cluster.devices_per_node,), ("dp",)
    return (cluster.nodes, cluster.devices_per_node), ("dp", "tp")


def mesh_names(shape: Sequence[int]) -> tuple[str, ...]:
    """Conventional axis names: the innermost axis "tp", the outer ones "dp", "fsdp", "dp2", ..."""
    if len(shape) == 1:
        return ("dp",)
    outer = ["dp", "fsdp"] + [f"dp{i}" for i in range(2, len(shape))]
    return tuple(outer[: len(shape) - 1]) + ("tp",)


def parse_mesh(text: str) -> tuple[int, ...]:
    parts = text.lower().replace("(", "").replace(")", "").replace(",", "x").split("x")
    if not parts or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise InputError(f"cannot parse mesh {text!r}; write sizes joined by 'x', e.g. '16x8x8' or '128x8'")
    return tuple(int(p) for p in parts)


def parse_mesh_spec(text: str) -> tuple[int, ...] | dict[str, int]:
    """``"16x8"`` -> (16, 8); ``"pp=4,tp=8"`` (or ``"pp=4 x tp=8"``) -> {"pp": 4, "tp": 8}, outer axis first."""
    if "=" not in text:
        return parse_mesh(text)
    out: dict[str, int] = {}
    for part in text.replace("×", ",").replace(" x ", ",").split(","):
        name, _, size = part.strip().partition("=")
        if not name.strip() or not size.strip().isdigit() or int(size) < 1 or name.strip() in out:
            raise InputError(
                f"cannot parse mesh {text!r}; write named axes outer first, e.g. 'pp=4,tp=8' or "
                "'pp=2,dp=2,tp=8' (each name once), or sizes such as '16x8'"
            )
        out[name.strip()] = int(size)
    return out


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A ``fake`` default process group of ``world_size`` ranks for the duration (this process is rank 0).

    DeviceMesh construction and collective shapes work, nothing is communicated; build meshes outside
    ``FakeTensorMode``. On exit the group is destroyed and DTensor's caches (which hold this world's meshes)
    cleared. Nesting: inside a group of the same size (an outer ``fake_world``, or this process's own group) the
    existing group is used and left as it was; a group of another size raises ``ValueError`` (torch has one
    default group: replacing it would break the meshes made on it).
    """
    if world_size < 1:
        raise InputError(f"world_size must be >= 1, got {world_size}")
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise InputError(
                f"a process group of {dist.get_world_size()} ranks is already initialized; planning a mesh of "
                f"{world_size} devices needs its own fake group: call autoshard.plan outside torch.distributed, "
                "or pass a DeviceMesh of that group"
            )
        yield
        return
    tc.fake_process_group(world_size)
    try:
        yield
    finally:
        if dist.is_initialized():  # (the body may have destroyed it)
            dist.destroy_process_group()
        tc.clear_dtensor_caches()  # cached specs hold this world's meshes


__all__ = ["default_mesh", "fake_world", "mesh_names", "parse_mesh", "parse_mesh_spec"]
