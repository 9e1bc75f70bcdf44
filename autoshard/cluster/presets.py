"""Cluster presets and spec strings: the hardware profiles (``autoshard.cluster.profile``) autoshard ships, every
number with its source, and :func:`get_cluster`, which resolves a spec::

    "h100-sxm"          one node of the preset's default size (8 devices)
    "h100-sxm:4x8"      4 nodes x 8 devices per node = 32 devices
    "/path/to/x.json"   ClusterProfile.to_dict() output, written by hand or by a measuring script
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

from autoshard.cluster.machine import this_machine
from autoshard.cluster.profile import ClusterProfile, DeviceSpec, Link, pcie_link
from autoshard.errors import InputError

logger = logging.getLogger(__name__)

__all__ = ["get_cluster", "known_clusters"]


# ---------------------------------------------------------------------------------------------------------------
# Presets. Datasheet numbers are dense (no 2:4 sparsity). Efficiencies are assumptions, stated as such.
# ---------------------------------------------------------------------------------------------------------------

_CPU_MEASURED = "measured on autoshard's 2-core CI machine (not the machine it runs on), torch 2.13, 2026-11-22"
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
    return ClusterProfile(
        "cpu", device, 8, 1, intra_node=loopback, inter_node=network, host_link=memcpy, all_to_all="ring"
    )  # gloo: DTensor all-gathers a Shard(i) -> Shard(j) move


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
    pcie = pcie_link(
        5,
        f"NVIDIA {'H200' if name == 'h200' else 'H100'} datasheet (SXM): PCIe Gen5 128 GB/s "
        "bidirectional = 64 GB/s per direction per GPU (a Gen5 x16 link per GPU, as in DGX H100/H200)",
    )
    return ClusterProfile(name, device, 8, 1, intra_node=nvlink, inter_node=infiniband, host_link=pcie)


def _a100() -> ClusterProfile:
    datasheet = "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column, dense)"
    device = DeviceSpec(
        name="a100-80gb",
        peak_flops={"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12, "float64": 19.5e12},
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
    pcie = pcie_link(4, f"{datasheet}: PCIe Gen4 64 GB/s bidirectional = 32 GB/s per direction per GPU")
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
    # the machine of torchtitan's published H100 tables (Meta's Grand Teton): benchmarks/torchtitan_table.py
    h100_96 = _hopper(
        "h100-96gb-500w",
        95 * 2**30,
        2.4e12,
        "torchtitan docs/performance.md (Grand Teton hosts): 'H100 GPUs with 95 GiB memory', '96GB HBM2e with 2.4 "
        "TB/sec peak memory bandwidth', 8 per host over NVLink, 400 Gb/s RDMA per GPU between hosts (as the "
        "h100-sxm preset's 400 Gb/s NDR per GPU), 'the default 500W power limit'. Not modelled: that power cap "
        "(the compute figures are the 700 W datasheet's; torchtitan notes 700 W could be faster)",
    )
    profiles = (_cpu(), h100, _a100(), h200, h100_96)
    return MappingProxyType({p.name: p for p in profiles})


def known_clusters() -> tuple[str, ...]:
    return tuple(_presets())


_SIZE = re.compile(r"^(\d+)x(\d+)$")


def get_cluster(spec: str | Path | ClusterProfile | None) -> ClusterProfile:
    """Resolve a cluster spec: ``None`` (this machine: ``cluster/machine.py``), a preset name with an optional
    ``":<nodes>x<per_node>"`` size, a path to a ``.json`` profile, or a ready ClusterProfile."""
    if spec is None:  # this machine: its measured profile, else its memory at the cpu preset's rates, said (machine.py)
        return this_machine(_presets()["cpu"])
    if isinstance(spec, ClusterProfile):
        return spec
    text = str(spec).strip()
    if text.lower().endswith(".json"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise InputError(f"cluster profile file {text!r} does not exist")
        profile = ClusterProfile.from_dict(json.loads(path.read_text()))
        logger.debug("loaded cluster profile %s from %s", profile.name, path)
        return profile
    name, _, size = text.lower().partition(":")
    presets = _presets()
    if name not in presets:
        raise InputError(
            f"unknown cluster {name!r}; known clusters: {', '.join(known_clusters())} "
            f"(optionally with a size, e.g. 'h100-sxm:4x8', or a path to a .json profile)"
        )
    profile = presets[name]
    if not size:
        return profile
    match = _SIZE.match(size)
    if match is None:
        raise InputError(
            f"cannot parse cluster size {size!r} in {text!r}; write '<nodes>x<devices_per_node>', "
            f"e.g. '{name}:4x8' for 4 nodes of 8 devices"
        )
    return profile.with_size(int(match.group(1)), int(match.group(2)))
