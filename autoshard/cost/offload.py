"""What holding a parameter's optimizer state in host memory costs per step (ZeRO-Offload).

The schedule priced is ZeRO-Offload's (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training",
USENIX ATC 2021, section 4) as ``autoshard/runtime/offload.py`` runs it, for one parameter whose master (the copy
the optimizer updates, in its state layout) and optimizer state live on the host:

1. the backward delivers the gradient on the device in the state layout (reduce-scattered, ZeRO-2 style, so each
   rank moves only its shard), then copies it to the host: ``grad_bytes`` device -> host over ``host_link``;
2. the host steps the master with that gradient (any ``torch.optim`` optimizer, on CPU tensors): memory-bound,
   reading the master, the gradient and the ``factor`` state tensors and writing the master and the state;
3. the updated master is copied to the device (host -> device over ``host_link``) and, when the compute layout is
   less sharded than the state, all-gathered there (priced by the caller with the collectives' model).

What overlaps: in ZeRO-Offload the gradient copies overlap the backward and, with its one-step delayed update,
the host step overlaps the next forward. autoshard's runtime does none of that (the copies run after the rank's
program returns, the host step when the user calls ``optimizer.step()``, the upload at the next forward), so the
three terms are added to the step with no overlap credit. The host link is full duplex; the two copies are in
different phases of the step and are added, not overlapped.

Host memory rate (step 2): on a CPU cluster ("host-memcpy" host link) the host is the device, and its profiled
memory bandwidth is used. On GPU servers the host's DRAM bandwidth is shared by the node's GPUs:

- DGX A100: 2 x AMD EPYC 7742 (NVIDIA DGX A100 datasheet), 8 channels of DDR4-3200 each = 204.8 GB/s per socket
  (AMD EPYC 7742 product page): 409.6 GB/s per node, 51.2 GB/s per GPU;
- DGX H100 / H200: 2 x Intel Xeon Platinum 8480C (NVIDIA DGX H100 datasheet), 8 channels of DDR5-4800 each =
  307.2 GB/s per socket (Intel ARK): 614.4 GB/s per node, 76.8 GB/s per GPU;

at an assumed 60% of peak for a streaming kernel. Measured once (2026-11-26) on a lent single-H200 machine with
16 host cores (not a DGX): pinned copies at 55 GB/s each way; AdamW over 512 M host parameters streamed 124 GB/s
with ``fused=True`` and 24 GB/s with torch's CPU default (a kernel per operation); in
``benchmarks/gpu_meta_offload.py`` (5.9 B parameters, 3.9 B offloaded) the plan priced offloading at 3.08 s of a
3.28 s step, and the step measured 1.59 s, its ``optimizer.step()`` 0.78 s. The rate stays the per-GPU share of
a full 8-GPU node: pessimistic on a host that serves one GPU, unmeasured on a loaded DGX.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cluster.profile import ClusterProfile

# DRAM bandwidth of the host per GPU (bytes/s) by device family, and the share a streaming optimizer step reaches
HOST_DRAM_PER_DEVICE = {"a100": 409.6e9 / 8, "h100": 614.4e9 / 8, "h200": 614.4e9 / 8}
HOST_DRAM_DEFAULT = 409.6e9 / 8  # an unknown GPU server: the DGX A100's host
HOST_EFFICIENCY = 0.6


@dataclass(frozen=True)
class OffloadCost:
    """Seconds per step of one offloaded parameter shard: the two host-link copies and the host optimizer step."""

    to_host_s: float
    host_step_s: float
    to_device_s: float

    @property
    def total_s(self) -> float:
        return self.to_host_s + self.host_step_s + self.to_device_s


@dataclass(frozen=True)
class OffloadSummary:
    """What a plan holds in host memory: ``params`` of its ``total`` parameters (every layer counted) have their
    master and optimizer state there (``mode``: "optimizer" or "params"), ``host_bytes`` per device, costing
    ``step_s`` per step over the host link ``link`` (copies and the host optimizer step)."""

    mode: str
    params: int
    total: int
    host_bytes: int
    step_s: float
    link: str


def host_is_device(cluster: ClusterProfile) -> bool:
    """A CPU cluster: "host memory" is the device's own (its host link is a memcpy)."""
    return cluster.host_link.name.startswith("host-memcpy")


def host_memory_rate(cluster: ClusterProfile) -> float:
    """Bytes/s one device's host-side optimizer step streams (see the module docstring for the sources)."""
    dev = cluster.device
    if host_is_device(cluster):
        return dev.memory_bandwidth * dev.memory_efficiency
    name = dev.name.lower()
    peak = next((bw for key, bw in HOST_DRAM_PER_DEVICE.items() if key in name), HOST_DRAM_DEFAULT)
    return peak * HOST_EFFICIENCY


def offload_cost(shard_bytes: int, grad_bytes: int, factor: int, cluster: ClusterProfile) -> OffloadCost:
    """One step of ZeRO-Offload for a master shard of ``shard_bytes`` per device whose gradient shard is
    ``grad_bytes`` and whose optimizer state is ``factor`` x ``shard_bytes``."""
    link = cluster.host_link
    if shard_bytes <= 0:
        return OffloadCost(0.0, 0.0, 0.0)
    down = link.latency + grad_bytes / link.bandwidth
    # reads master, gradient and state, writes master and state
    touched = shard_bytes * (1 + factor) * 2 + grad_bytes
    step = touched / host_memory_rate(cluster)
    up = link.latency + shard_bytes / link.bandwidth
    return OffloadCost(down, step, up)


__all__ = ["OffloadCost", "OffloadSummary", "host_is_device", "host_memory_rate", "offload_cost"]
