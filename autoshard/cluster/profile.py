"""Hardware and cluster profiles as plain data, every number with its source.

The planner never talks to hardware: it prices compute with a roofline over a :class:`DeviceSpec` and prices
collectives over the links a mesh axis is laid on (:meth:`ClusterProfile.axis_layout`, docs/design.md, "Communication").
Keeping those numbers in one frozen, JSON-able value (instead of constants scattered through the cost model) is what
lets ``autoshard plan --cluster h100-sxm:128x8`` run on a laptop, lets a user drop in a ``my_cluster.json`` they
measured themselves, and lets a reader check each number against the document it came from (``sources``).

This module holds the value types; ``autoshard.cluster.presets`` holds the presets and resolves spec strings.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from autoshard.errors import InputError

logger = logging.getLogger(__name__)

__all__ = ["AxisLayout", "ClusterProfile", "DeviceSpec", "Link", "check_mesh", "default_host_link", "pcie_link"]


@dataclass(frozen=True)
class Link:
    """One kind of interconnect, as a collective (or a host copy) sees it.

    ``bandwidth`` is bytes/s per direction per device: the rate at which one device can push bytes to its ring
    neighbour (or to host memory), which is what the formulas divide by. ``latency`` is the fixed cost of one
    ring step (or one copy). ``sync`` is what a collective costs on top of that when compute waits for it right
    after running (an activation's all-reduce in tensor parallelism): the ranks reach it at different times, and
    each waits for the last (processes sharing cores, OS noise, launch skew). Collectives issued ahead or
    together (parameter gathers, gradient buckets) do not pay it. ``autoshard calibrate`` measures it; the
    published profiles leave it 0.
    """

    name: str
    bandwidth: float
    latency: float
    source: str
    sync: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise InputError(f"Link {self.name!r}: bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if not self.latency >= 0 or not self.sync >= 0:
            raise InputError(f"Link {self.name!r}: latency and sync must be >= 0 s, got {self.latency}, {self.sync}")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU rank) for the roofline model.

    ``peak_flops`` maps a dtype name (``"float32"``, ``"bfloat16"``, ...) to dense FLOP/s; ``"float32"`` is
    required because it is the fallback for dtypes that are not listed. The two mappings are copied on
    construction and excluded from the hash, so a DeviceSpec stays hashable (usable as a cache key) and the
    caller's dict can't change it afterwards; treat them as read-only.
    """

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)
    memory_bytes: int
    memory_bandwidth: float
    flops_efficiency: float
    memory_efficiency: float
    kernel_overhead: float
    sources: Mapping[str, str] = field(hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", {str(k): float(v) for k, v in self.peak_flops.items()})
        object.__setattr__(self, "sources", {str(k): str(v) for k, v in self.sources.items()})
        if "float32" not in self.peak_flops:
            raise InputError(
                f"DeviceSpec {self.name!r}: peak_flops needs a 'float32' entry (the fallback for unlisted "
                f"dtypes); got keys {sorted(self.peak_flops)}"
            )
        for key in ("flops_efficiency", "memory_efficiency"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise InputError(f"DeviceSpec {self.name!r}: {key} must be in (0, 1], got {value}")
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0:
            raise InputError(f"DeviceSpec {self.name!r}: memory_bytes and memory_bandwidth must be > 0")


@dataclass(frozen=True)
class AxisLayout:
    """How one mesh axis lies on the hardware: its ``size`` = n devices sit ``per_node`` = m to a node, on
    ``nodes`` = k nodes (n = m*k). k == 1: the axis stays on the intra-node link; m == 1: every hop crosses the
    network; m > 1 and k > 1: both, which is where a hierarchical collective applies."""

    size: int
    per_node: int
    nodes: int


@dataclass(frozen=True)
class ClusterProfile:
    """``nodes`` x ``devices_per_node`` identical devices: one link inside a node, another between nodes, and
    ``host_link`` from each device to host memory (offload). A profile built without ``host_link`` gets
    :func:`default_host_link` of its device, so after construction ``host_link`` is never None.
    ``all_to_all``: how the backend runs one (``autoshard/cost/collectives.py``): ``"pairwise"`` (NCCL) or
    ``"ring"`` (gloo, where DTensor all-gathers the tensor and keeps its chunk)."""

    name: str
    device: DeviceSpec
    devices_per_node: int
    nodes: int
    intra_node: Link
    inter_node: Link
    host_link: Link | None = None
    all_to_all: str = "pairwise"

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.nodes < 1:
            raise InputError(
                f"ClusterProfile {self.name!r}: need nodes >= 1 and devices_per_node >= 1, "
                f"got {self.nodes}x{self.devices_per_node}"
            )
        if self.host_link is None:
            object.__setattr__(self, "host_link", default_host_link(self.device))
        if self.all_to_all not in ("pairwise", "ring"):
            raise InputError(
                f"ClusterProfile {self.name!r}: all_to_all must be 'pairwise' (NCCL) or 'ring' (gloo: "
                f"gathered whole), got {self.all_to_all!r}"
            )

    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def axis_layout(self, mesh_shape: Sequence[int], axis: int) -> AxisLayout:
        """How mesh axis ``axis`` is laid over the nodes (m devices per node, k nodes).

        Devices are numbered node-major and the mesh is laid out row-major over them, so trailing (inner) axes
        vary fastest: neighbours along axis ``i`` are ``stride = prod(mesh_shape[i+1:])`` device ids apart, and
        the axis spans ``n * stride`` ids. Hence, with P devices per node:

        * ``n * stride <= P``: the whole axis sits in one node (m = n, k = 1);
        * ``stride >= P``: each device of the axis is on its own node (m = 1, k = n);
        * otherwise ``m = P // stride`` devices per node on ``k = n // m`` nodes.

        Exact when the sizes divide one another (powers of two); otherwise m is the largest divisor of n not
        above ``P // stride``, which keeps ``n == m * k``. The mesh may be smaller or larger than the cluster
        (the planner prices sub-meshes); :func:`check_mesh` is the check that they match.
        """
        ndim = len(mesh_shape)
        if not -ndim <= axis < ndim:
            raise InputError(f"axis {axis} is out of range for mesh shape {tuple(mesh_shape)}")
        i = axis % ndim
        n = int(mesh_shape[i])
        stride = math.prod(int(s) for s in mesh_shape[i + 1 :])
        per = self.devices_per_node
        if n * stride <= per:
            return AxisLayout(n, n, 1)
        if stride >= per:
            return AxisLayout(n, 1, n)
        m = per // stride
        while n % m:
            m -= 1
        return AxisLayout(n, m, n // m)

    def axis_link(self, mesh_shape: Sequence[int], axis: int) -> Link:
        """The link a flat collective over mesh axis ``axis`` is bounded by: intra-node iff the axis fits in one
        node (:meth:`axis_layout` has k == 1). That is why tensor parallelism goes on the last axis:
        ``dp=4 x tp=8`` on 4x8 puts tp on NVLink."""
        return self.intra_node if self.axis_layout(mesh_shape, axis).nodes == 1 else self.inter_node

    def with_size(self, nodes: int, per_node: int) -> ClusterProfile:
        """The same hardware with a different device count, named ``"<preset>:<nodes>x<per_node>"``."""
        base = self.name.split(":", 1)[0]
        return replace(self, name=f"{base}:{nodes}x{per_node}", nodes=nodes, devices_per_node=per_node)

    @functools.lru_cache(maxsize=16)  # noqa: B019 (a frozen, hashable profile: made once per profile planned for)
    def bundled(self) -> ClusterProfile:
        """The links as one gradient of DDP's all-reduce buckets sees them: its bytes cross at full bandwidth,
        and the collective's latency is paid once by the whole bucket, not by each member
        (``autoshard/buckets.py``; the solver and the plan add it per bucket): links with no latency."""
        return replace(
            self,
            name=f"{self.name} (bundled)",
            intra_node=replace(self.intra_node, latency=0.0),
            inter_node=replace(self.inter_node, latency=0.0),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; ``ClusterProfile.from_dict(p.to_dict()) == p``."""
        dev = self.device
        device = {f.name: getattr(dev, f.name) for f in fields(dev)}
        device.update(peak_flops=dict(dev.peak_flops), sources=dict(dev.sources))
        links = {key: asdict(getattr(self, key)) for key in ("intra_node", "inter_node", "host_link")}
        return {
            "name": self.name,
            "device": device,
            "devices_per_node": self.devices_per_node,
            "nodes": self.nodes,
            **links,
            "all_to_all": self.all_to_all,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterProfile:
        """Inverse of :meth:`to_dict`. ``host_link`` may be missing (profiles written before it existed): the
        device's :func:`default_host_link` is used, and its ``source`` says it is a default."""
        try:
            dev = data["device"]
            device = DeviceSpec(
                name=dev["name"],
                peak_flops=dev["peak_flops"],
                memory_bytes=int(dev["memory_bytes"]),
                memory_bandwidth=float(dev["memory_bandwidth"]),
                flops_efficiency=float(dev["flops_efficiency"]),
                memory_efficiency=float(dev["memory_efficiency"]),
                kernel_overhead=float(dev["kernel_overhead"]),
                sources=dev.get("sources", {}),
            )
            host = data.get("host_link")
            return cls(
                name=data["name"],
                device=device,
                devices_per_node=int(data["devices_per_node"]),
                nodes=int(data["nodes"]),
                intra_node=Link(**data["intra_node"]),
                inter_node=Link(**data["inter_node"]),
                host_link=None if host is None else Link(**host),
                # profiles written before the field: gloo ones (calibrated on CPU ranks) gather whole
                all_to_all=data.get(
                    "all_to_all", "ring" if data["intra_node"]["name"].startswith("gloo") else "pairwise"
                ),
            )
        except (KeyError, TypeError) as exc:
            raise InputError(
                f"invalid cluster profile dict ({exc!r}); expected the layout written by ClusterProfile.to_dict(): "
                f"keys name, device{{name, peak_flops, memory_bytes, memory_bandwidth, flops_efficiency, "
                f"memory_efficiency, kernel_overhead, sources}}, devices_per_node, nodes, "
                f"intra_node{{name, bandwidth, latency, source}}, inter_node{{...}}, host_link{{...}} (optional)"
            ) from exc


def check_mesh(cluster: ClusterProfile, mesh_shape: Sequence[int]) -> None:
    """Raise ValueError unless the mesh uses exactly the cluster's devices (``prod(mesh_shape) == nodes *
    devices_per_node``), naming both counts and the ``NAME:NODESxPER_NODE`` spec that would match.

    Separate from :meth:`ClusterProfile.axis_layout` on purpose: the planner prices sub-meshes, so the layout
    itself must accept any size; call this where a whole training mesh meets its cluster."""
    shape = tuple(int(s) for s in mesh_shape)
    if not shape or min(shape) < 1:
        raise InputError(f"mesh shape {shape} is invalid: need at least one axis, every size >= 1")
    total, have = math.prod(shape), cluster.num_devices()
    if total == have:
        return
    per = cluster.devices_per_node
    size = f"{total // per}x{per}" if total % per == 0 else f"1x{total}"
    base = cluster.name.split(":", 1)[0]
    raise InputError(
        f"mesh {' x '.join(map(str, shape))} has {total} devices but cluster {cluster.name!r} has {have} "
        f"({cluster.nodes} node(s) x {per} devices); size the cluster to the mesh with NAME:NODESxPER_NODE, "
        f"e.g. '{base}:{size}'"
    )


def pcie_link(gen: int, source: str, name: str = "") -> Link:
    """PCIe x16 to host memory: 16 lanes x 16 GT/s (Gen4) or 32 GT/s (Gen5) / 8 = 32 or 64 GB/s per direction
    (128b/130b encoding takes ~1.5% of that; pinned-memory copies reach ~80-85% of it in practice)."""
    return Link(
        name=name or f"pcie-gen{gen}-x16",
        bandwidth={4: 32e9, 5: 64e9}[gen],
        latency=1e-5,
        source=f"{source}; latency: assumption, ~10 us per copy (cudaMemcpyAsync launch + DMA setup)",
    )


def default_host_link(device: DeviceSpec) -> Link:
    """Host link of a profile that names none (e.g. JSON written before ``host_link`` existed): PCIe Gen4 x16,
    the slower generation of the presets, capped at half the device's memory bandwidth (a copy reads and writes
    every byte) so that a CPU profile is not credited with more than its own memcpy."""
    link = pcie_link(
        4,
        "default, the profile names no host_link: PCIe Gen4 x16 assumed, 32 GB/s per direction",
        "pcie-gen4-x16 (default)",
    )
    cap = device.memory_bandwidth / 2
    if cap >= link.bandwidth:
        return link
    return replace(
        link,
        name="host-memcpy (default)",
        bandwidth=cap,
        source=f"{link.source}; capped at memory_bandwidth / 2 = {cap:.3g} B/s (a copy reads + writes)",
    )
