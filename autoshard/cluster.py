"""Hardware and cluster profiles as plain data, every number with its source.

The planner never talks to hardware: it prices compute with a roofline over a :class:`DeviceSpec` and prices
collectives over the links a mesh axis is laid on (:meth:`ClusterProfile.axis_layout`, DESIGN §5). Keeping those
numbers in one frozen, JSON-able value (instead of constants scattered through the cost model) is what lets
``autoshard plan --cluster h100-sxm:128x8`` run on a laptop, lets a user drop in a ``my_cluster.json`` they
measured themselves, and lets a reader check each number against the document it came from (``sources``).

Spec strings accepted by :func:`get_cluster`::

    "h100-sxm"          one node of the preset's default size (8 devices)
    "h100-sxm:4x8"      4 nodes x 8 devices per node = 32 devices
    "/path/to/x.json"   ClusterProfile.to_dict() output, written by hand or by a measuring script
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "AxisLayout", "ClusterProfile", "DeviceSpec", "Link", "check_mesh", "default_host_link", "get_cluster",
    "known_clusters",
]


@dataclass(frozen=True)
class Link:
    """One kind of interconnect, as a collective (or a host copy) sees it.

    ``bandwidth`` is bytes/s per direction per device: the rate at which one device can push bytes to its ring
    neighbour (or to host memory), which is what the formulas divide by. ``latency`` is the fixed cost of one
    ring step (or one copy).
    """

    name: str
    bandwidth: float
    latency: float
    source: str

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"Link {self.name!r}: bandwidth must be > 0 bytes/s, got {self.bandwidth}")
        if not self.latency >= 0:
            raise ValueError(f"Link {self.name!r}: latency must be >= 0 s, got {self.latency}")


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
            raise ValueError(
                f"DeviceSpec {self.name!r}: peak_flops needs a 'float32' entry (the fallback for unlisted "
                f"dtypes); got keys {sorted(self.peak_flops)}"
            )
        for key in ("flops_efficiency", "memory_efficiency"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ValueError(f"DeviceSpec {self.name!r}: {key} must be in (0, 1], got {value}")
        if self.memory_bytes <= 0 or self.memory_bandwidth <= 0:
            raise ValueError(f"DeviceSpec {self.name!r}: memory_bytes and memory_bandwidth must be > 0")


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
    :func:`default_host_link` of its device, so after construction ``host_link`` is never None."""

    name: str
    device: DeviceSpec
    devices_per_node: int
    nodes: int
    intra_node: Link
    inter_node: Link
    host_link: Link | None = None

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.nodes < 1:
            raise ValueError(
                f"ClusterProfile {self.name!r}: need nodes >= 1 and devices_per_node >= 1, "
                f"got {self.nodes}x{self.devices_per_node}"
            )
        if self.host_link is None:
            object.__setattr__(self, "host_link", default_host_link(self.device))

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
            raise ValueError(f"axis {axis} is out of range for mesh shape {tuple(mesh_shape)}")
        i = axis % ndim
        n = int(mesh_shape[i])
        stride = math.prod(int(s) for s in mesh_shape[i + 1:])
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; ``ClusterProfile.from_dict(p.to_dict()) == p``."""
        dev = self.device
        device = {f.name: getattr(dev, f.name) for f in fields(dev)}
        device.update(peak_flops=dict(dev.peak_flops), sources=dict(dev.sources))
        links = {key: asdict(getattr(self, key)) for key in ("intra_node", "inter_node", "host_link")}
        return {"name": self.name, "device": device, "devices_per_node": self.devices_per_node, "nodes": self.nodes,
                **links}

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
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(
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
        raise ValueError(f"mesh shape {shape} is invalid: need at least one axis, every size >= 1")
    total, have = math.prod(shape), cluster.num_devices()
    if total == have:
        return
    per = cluster.devices_per_node
    size = f"{total // per}x{per}" if total % per == 0 else f"1x{total}"
    base = cluster.name.split(":", 1)[0]
    raise ValueError(
        f"mesh {' x '.join(map(str, shape))} has {total} devices but cluster {cluster.name!r} has {have} "
        f"({cluster.nodes} node(s) x {per} devices); size the cluster to the mesh with NAME:NODESxPER_NODE, "
        f"e.g. '{base}:{size}'"
    )


def _pcie(gen: int, source: str, name: str = "") -> Link:
    """PCIe x16 to host memory: 16 lanes x 16 GT/s (Gen4) or 32 GT/s (Gen5) / 8 = 32 or 64 GB/s per direction
    (128b/130b encoding takes ~1.5% of that; pinned-memory copies reach ~80-85% of it in practice)."""
    return Link(name=name or f"pcie-gen{gen}-x16", bandwidth={4: 32e9, 5: 64e9}[gen], latency=1e-5,
                source=f"{source}; latency: assumption, ~10 us per copy (cudaMemcpyAsync launch + DMA setup)")


def default_host_link(device: DeviceSpec) -> Link:
    """Host link of a profile that names none (e.g. JSON written before ``host_link`` existed): PCIe Gen4 x16,
    the slower generation of the presets, capped at half the device's memory bandwidth (a copy reads and writes
    every byte) so that a CPU profile is not credited with more than its own memcpy."""
    link = _pcie(4, "default, the profile names no host_link: PCIe Gen4 x16 assumed, 32 GB/s per direction",
                 "pcie-gen4-x16 (default)")
    cap = device.memory_bandwidth / 2
    if cap >= link.bandwidth:
        return link
    return replace(link, name="host-memcpy (default)", bandwidth=cap,
                   source=f"{link.source}; capped at memory_bandwidth / 2 = {cap:.3g} B/s (a copy reads + writes)")


# ---------------------------------------------------------------------------------------------------------------
# Presets. Datasheet numbers are dense (no 2:4 sparsity). Efficiencies are assumptions, stated as such.
# ---------------------------------------------------------------------------------------------------------------

_CPU_MEASURED = "measured on this 2-core CI machine, torch 2.13, 2026-11-22"
_GPU_EFF = (
    "assumption: large bf16 GEMMs reach ~0.7 of datasheet dense peak (MLPerf / Megatron-LM MFU on the GEMMs); "
    "HBM streaming kernels reach ~0.8 of peak bandwidth; ~5 us per kernel (CUDA launch + PyTorch dispatch)"
)


def _cpu() -> ClusterProfile:
    # One "device" = one process pinned to one thread (torch.set_num_threads(1)), as in the gloo tests.
    mem_total = 24_684_084 * 1024  # /proc/meminfo MemTotal, shared by the 8 ranks of the one node
    device = DeviceSpec(
        name="cpu-1thread (AMD EPYC Zen 4, AVX-512)",
        peak_flops={"float32": 1.0e11, "bfloat16": 2.1e11, "float16": 1.0e9},
        memory_bytes=mem_total // 8,
        memory_bandwidth=2.7e10,
        flops_efficiency=0.9,
        memory_efficiency=0.95,
        kernel_overhead=1.2e-6,
        sources={
            "peak_flops": f"{_CPU_MEASURED}: 1024x1024 torch.mm on 1 thread, best of 10 after warm-up: fp32 "
            "83-102 GFLOP/s over 4 runs, bf16 (avx512_bf16) 210-217 GFLOP/s; fp16 ~1.0 GFLOP/s (no native "
            "fp16 GEMM path on this CPU)",
            "flops_efficiency": f"{_CPU_MEASURED}: median / best of the fp32 mm timings ~0.9",
            "memory_bytes": f"{_CPU_MEASURED}: /proc/meminfo MemTotal 24,684,084 kB divided by the 8 ranks per node",
            "memory_bandwidth": f"{_CPU_MEASURED}: Tensor.copy_ of 256 MiB fp32, 1 thread, best 27.1-27.8 GB/s "
            "counting bytes read + written",
            "memory_efficiency": f"{_CPU_MEASURED}: median / best of the copy timings ~0.95",
            "kernel_overhead": f"{_CPU_MEASURED}: eager torch.add of 8 floats, 1.1-1.4 us per call",
        },
    )
    loopback = Link(
        name="gloo-loopback",
        bandwidth=1.1e9,
        latency=8.5e-5,
        source=f"{_CPU_MEASURED}: gloo all_reduce between 2 forked 1-thread processes (FileStore), medians; "
        "fit t = 2*alpha + b/beta (ring, n=2): 4-byte all_reduce 111-247 us -> alpha ~85 us per step; "
        "16-64 MiB all_reduce -> beta 0.97-1.31 GB/s",
    )
    network = replace(
        loopback,
        name="gloo-tcp (assumed)",
        source="assumption: no multi-machine CPU measurement; taken equal to the measured loopback link",
    )
    memcpy = Link(  # offloading on a CPU rank is a memcpy
        name="host-memcpy",
        bandwidth=device.memory_bandwidth / 2,
        latency=device.kernel_overhead,
        source=f"derived from this profile's measured memory_bandwidth ({_CPU_MEASURED}): a host copy of b bytes "
        "reads b and writes b, and the 27 GB/s counts both, so b moves at ~13.5 GB/s; latency = the measured "
        "1.2 us eager-op overhead (one Tensor.copy_ call)",
    )
    return ClusterProfile("cpu", device, 8, 1, intra_node=loopback, inter_node=network, host_link=memcpy)


def _hopper(name: str, memory_bytes: int, memory_bandwidth: float, memory_source: str) -> ClusterProfile:
    datasheet = "NVIDIA H100 Tensor Core GPU datasheet (SXM5 column, dense = half the sparsity figure)"
    device = DeviceSpec(
        name=name,
        peak_flops={
            "float32": 67e12,
            "tfloat32": 494.5e12,
            "bfloat16": 989e12,
            "float16": 989e12,
            "float8_e4m3fn": 1979e12,
            "float64": 67e12,
        },
        memory_bytes=memory_bytes,
        memory_bandwidth=memory_bandwidth,
        flops_efficiency=0.7,
        memory_efficiency=0.8,
        kernel_overhead=5e-6,
        sources={
            "peak_flops": f"{datasheet}: FP32 67 TF, TF32 989 TF sparse, BF16/FP16 1,979 TF sparse, FP8 3,958 TF "
            "sparse, FP64 tensor core 67 TF; 'float32' is the non-tensor-core rate because PyTorch keeps TF32 "
            "matmuls off by default",
            "memory_bytes": memory_source,
            "memory_bandwidth": memory_source,
            "flops_efficiency": _GPU_EFF,
            "memory_efficiency": _GPU_EFF,
            "kernel_overhead": _GPU_EFF,
        },
    )
    nvlink = Link(
        name="nvlink4",
        bandwidth=450e9,
        latency=3e-6,
        source="NVIDIA H100 datasheet / NVLink4: 18 links, 900 GB/s bidirectional = 450 GB/s per direction per "
        "GPU through NVSwitch (peak; NCCL all_reduce bus bandwidth measures ~360 GB/s); latency: assumption, "
        "a few us per ring step for NCCL over NVSwitch",
    )
    infiniband = Link(
        name="ndr-infiniband",
        bandwidth=50e9,
        latency=5e-6,
        source="DGX H100 / ConnectX-7: 8 x 400 Gb/s NDR InfiniBand per node, one per GPU = 50 GB/s per direction "
        "per GPU; latency: assumption, ~5 us per ring step across the IB fabric",
    )
    pcie = _pcie(5, f"NVIDIA {'H200' if name == 'h200' else 'H100'} datasheet (SXM): PCIe Gen5 128 GB/s "
                 "bidirectional = 64 GB/s per direction per GPU (a Gen5 x16 link per GPU, as in DGX H100/H200)")
    return ClusterProfile(name, device, 8, 1, intra_node=nvlink, inter_node=infiniband, host_link=pcie)


def _a100() -> ClusterProfile:
    datasheet = "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column, dense)"
    device = DeviceSpec(
        name="a100-80gb",
        peak_flops={"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12,
                    "float64": 19.5e12},
        memory_bytes=80 * 2**30,
        memory_bandwidth=2.039e12,
        flops_efficiency=0.7,
        memory_efficiency=0.8,
        kernel_overhead=5e-6,
        sources={
            "peak_flops": f"{datasheet}: FP32 19.5 TF, TF32 156 TF, BF16/FP16 312 TF, FP64 tensor core 19.5 TF",
            "memory_bytes": f"{datasheet}: 80 GB HBM2e (nvidia-smi reports 81,920 MiB)",
            "memory_bandwidth": f"{datasheet}: 2,039 GB/s",
            "flops_efficiency": _GPU_EFF,
            "memory_efficiency": _GPU_EFF,
            "kernel_overhead": _GPU_EFF,
        },
    )
    nvlink = Link(
        name="nvlink3",
        bandwidth=300e9,
        latency=3e-6,
        source=f"{datasheet} / NVLink3: 12 links, 600 GB/s bidirectional = 300 GB/s per direction per GPU "
        "through NVSwitch; latency: assumption, a few us per ring step",
    )
    infiniband = Link(
        name="hdr-infiniband",
        bandwidth=25e9,
        latency=5e-6,
        source="Narayanan et al., 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
        "Megatron-LM', SC21 (Selene, DGX A100 nodes): 8 x 200 Gb/s HDR InfiniBand per node, one per GPU = "
        "25 GB/s per direction per GPU; latency: assumption, ~5 us per ring step",
    )
    pcie = _pcie(4, f"{datasheet}: PCIe Gen4 64 GB/s bidirectional = 32 GB/s per direction per GPU")
    return ClusterProfile("a100-80gb", device, 8, 1, intra_node=nvlink, inter_node=infiniband, host_link=pcie)


@functools.lru_cache(maxsize=1)
def _presets() -> Mapping[str, ClusterProfile]:
    """Built once, on first use, and handed out read-only: presets are data, not state."""
    h100 = _hopper(
        "h100-sxm",
        81_559 * 2**20,
        3.35e12,
        "NVIDIA H100 datasheet (SXM5): 80 GB HBM3, 3.35 TB/s; memory_bytes = the 81,559 MiB nvidia-smi reports "
        "(80 GiB would overstate what an allocator can get by 361 MiB)",
    )
    h200 = _hopper(
        "h200",
        143_771 * 2**20,
        4.8e12,
        "NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s; memory_bytes = the 143,771 MiB nvidia-smi reports "
        "(141 GiB would overstate it by 613 MiB); compute, NVLink and networking as H100 SXM (DGX H200: "
        "8 x ConnectX-7 400 Gb/s)",
    )
    profiles = (_cpu(), h100, _a100(), h200)
    return MappingProxyType({p.name: p for p in profiles})


def known_clusters() -> tuple[str, ...]:
    return tuple(_presets())


_SIZE = re.compile(r"^(\d+)x(\d+)$")


def get_cluster(spec: str | Path | ClusterProfile | None) -> ClusterProfile:
    """Resolve a cluster spec: ``None`` (the local ``"cpu"``), a preset name with an optional
    ``":<nodes>x<per_node>"`` size, a path to a ``.json`` profile, or a ready ClusterProfile."""
    if spec is None:
        return _presets()["cpu"]
    if isinstance(spec, ClusterProfile):
        return spec
    text = str(spec).strip()
    if text.lower().endswith(".json"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"cluster profile file {text!r} does not exist")
        profile = ClusterProfile.from_dict(json.loads(path.read_text()))
        logger.debug("loaded cluster profile %s from %s", profile.name, path)
        return profile
    name, _, size = text.lower().partition(":")
    presets = _presets()
    if name not in presets:
        raise ValueError(
            f"unknown cluster {name!r}; known clusters: {', '.join(known_clusters())} "
            f"(optionally with a size, e.g. 'h100-sxm:4x8', or a path to a .json profile)"
        )
    profile = presets[name]
    if not size:
        return profile
    match = _SIZE.match(size)
    if match is None:
        raise ValueError(
            f"cannot parse cluster size {size!r} in {text!r}; write '<nodes>x<devices_per_node>', "
            f"e.g. '{name}:4x8' for 4 nodes of 8 devices"
        )
    return profile.with_size(int(match.group(1)), int(match.group(2)))
