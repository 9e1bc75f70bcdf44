"""``autoshard calibrate``: measure this machine and write a cluster profile the planner can use.

The cost model reads a :class:`~autoshard.cluster.presets.DeviceSpec` (roofline: ``flops / (peak_flops[dtype] *
flops_efficiency)``, ``bytes / (memory_bandwidth * memory_efficiency)``, ``kernel_overhead``) and, per mesh axis,
a :class:`~autoshard.cluster.presets.Link` (``latency`` per ring step, ``bandwidth`` per device) priced with the ring
formulas of :mod:`autoshard.cost.collectives`. This module measures each of those figures:

* **compute**: ``torch.mm`` of square matrices per dtype (float32, bfloat16 and float16 where they run) at a few
  sizes, on ``threads`` threads (one "device" = one process; the gloo tests run 1 thread per rank), in
  ``ranks`` processes at once (the ranks of a job share this machine's cores and memory bandwidth), keeping the
  slowest rank's figures.
  ``peak_flops`` is the best single run at the fastest size, ``flops_efficiency`` = typical / best there, so the
  model's ``peak * efficiency`` is the typical achieved rate. "Typical" is the larger of the median call and the
  mean over a sustained run of 0.1 s: with more ranks than cores, the sustained mean is what a rank gets.
* **memory**: ``Tensor.copy_`` of a large fp32 buffer, bytes read + written; best and typical / best as above.
* **kernel overhead**: typical time of an eager ``torch.add`` on 8 floats.
* **collectives**: all_reduce / all_gather / reduce_scatter over a real gloo process group of ``ranks`` forked
  processes (mesh ``(ranks,)`` or ``(2, ranks // 2)``), on every mesh axis, with a small and a large message.
  Each pair is fitted to the ring formula ``t = steps * latency + c * bytes / bandwidth`` (``steps = n - 1``,
  ``c = (n - 1) / n``, both doubled for all_reduce) through both points, so the model reproduces the measured
  medians; the profile's link takes the median latency and bandwidth over the fits.
* **sync**: per axis, a loop of equal compute chunks with and without a small all_reduce after each
  (``autoshard.cluster.calibrate_links.SyncFit``): what a collective that compute waits on costs beyond its
  after-barrier time (ranks arriving apart); the link's ``sync`` is the median over axes.

Every figure is the median of ``reps`` repetitions after ``warmup`` un-timed ones, and every ``source`` says
"measured by autoshard calibrate on <date>, <host/cpu>, <sizes>". The raw timings are kept under the JSON key
``"calibration"`` (ignored by :func:`~autoshard.cluster.presets.get_cluster`).
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from autoshard.cluster.calibrate_links import CollectiveFit, SyncFit, measure_collectives, run_all
from autoshard.cluster.calibration_config import CalibrationConfig
from autoshard.cluster.profile import ClusterProfile, DeviceSpec, Link
from autoshard.errors import LaunchError

logger = logging.getLogger(__name__)

__all__ = [
    "Calibration",
    "calibrate",
    "measure_copy_bandwidth",
    "measure_kernel_overhead",
    "measure_matmul",
    "summary",
    "write_profile",
]


@dataclass(frozen=True)
class Calibration:
    """A measured profile plus the raw figures behind it."""

    profile: ClusterProfile
    matmul_flops: dict[str, dict[int, float]]  # dtype -> size -> median FLOP/s
    collectives: tuple[CollectiveFit, ...]
    syncs: tuple[SyncFit, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = self.profile.to_dict()
        data["calibration"] = {
            "matmul_median_flops": {d: {str(s): f for s, f in v.items()} for d, v in self.matmul_flops.items()},
            "collectives": [asdict(c) for c in self.collectives],
            "syncs": [asdict(c) for c in self.syncs],
        }
        return data


# --------------------------------------------------------------------------------------------------- timing


def _median_time(fn: Callable[[], Any], warmup: int, reps: int, window_s: float = 0.1) -> tuple[float, float]:
    """(typical, best) seconds of ``fn()``: best over ``reps`` timed calls after ``warmup`` un-timed ones; typical
    the larger of their median and the mean over a sustained run of at least ``window_s`` seconds. The sustained
    mean counts the time a rank spends descheduled when ranks share cores (4 ranks on 2 cores each get half of
    one), which a median of short calls does not see."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    calls, t0 = 0, time.perf_counter()
    while calls < reps or time.perf_counter() - t0 < window_s:
        fn()
        calls += 1
    sustained = (time.perf_counter() - t0) / calls
    return max(statistics.median(times), sustained), min(times)


def measure_matmul(dtype: torch.dtype, size: int, warmup: int = 2, reps: int = 5) -> tuple[float, float]:
    """(typical, best) FLOP/s of ``torch.mm`` of two ``size x size`` matrices (``2 * size**3`` FLOPs). Raises
    RuntimeError where the dtype has no matmul on this machine."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    median, best = _median_time(lambda: torch.mm(a, b), warmup, reps)
    flops = 2.0 * size**3
    return flops / median, flops / best


def measure_copy_bandwidth(nbytes: int, warmup: int = 2, reps: int = 5) -> tuple[float, float]:
    """(typical, best) bytes/s of ``dst.copy_(src)`` of ``nbytes`` fp32, counting bytes read + written."""
    src = torch.randn(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    median, best = _median_time(lambda: dst.copy_(src), warmup, reps)
    moved = 2.0 * src.numel() * 4
    return moved / median, moved / best


def measure_kernel_overhead(warmup: int = 20, reps: int = 200) -> float:
    """Typical seconds of one eager ``torch.add`` on 8 floats (dispatch cost, no work)."""
    x = torch.ones(8)
    return _median_time(lambda: torch.add(x, x), warmup, reps)[0]


# ------------------------------------------------------------------------------------------------- profile


def _compute_worker(cfg: CalibrationConfig, path: str, start: Any) -> None:
    """Matmul FLOP/s per dtype and size, copy bandwidth and kernel overhead, measured in one of ``cfg.ranks``
    child processes that run together (see :func:`measure_compute`); results as JSON at ``path``."""
    torch.set_num_threads(cfg.threads)
    try:
        start.wait(cfg.timeout_s)
        matmul: dict[str, dict[int, float]] = {}
        peak: dict[str, float] = {}
        efficiency = 1.0
        for dtype_name in cfg.dtypes:
            try:
                runs = {
                    s: measure_matmul(getattr(torch, dtype_name), s, cfg.warmup, cfg.reps) for s in cfg.matmul_sizes
                }
            except RuntimeError as exc:
                logger.info(
                    "%s matmul unsupported here (%s); it falls back to float32 in the cost model", dtype_name, exc
                )
                continue
            matmul[dtype_name] = {s: med for s, (med, _) in runs.items()}
            fastest = max(runs, key=lambda s: runs[s][0])
            peak[dtype_name] = runs[fastest][1]
            if dtype_name == "float32":
                efficiency = runs[fastest][0] / runs[fastest][1]
        copy = measure_copy_bandwidth(cfg.copy_bytes, cfg.warmup, cfg.reps)
        overhead = measure_kernel_overhead(max(cfg.warmup, 10), max(cfg.reps * 10, 50))
        Path(path).write_text(
            json.dumps({"matmul": matmul, "peak": peak, "efficiency": efficiency, "copy": copy, "overhead": overhead})
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the parent through the file
        Path(path + ".error").write_text(f"{type(exc).__name__}: {exc}")
        raise


def measure_compute(cfg: CalibrationConfig) -> dict[str, Any]:
    """The compute side of the calibration: ``cfg.ranks`` forked processes measure at the same time, as the
    ranks of a job on this machine compute at the same time (4 ranks on 2 cores each get about half of one),
    and the slowest rank's figures are kept. In child processes also because multi-threaded torch work in this
    process would leave an OpenMP thread pool that does not survive the ``fork`` of gloo workers started next."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="autoshard_calibrate_") as tmpdir:
        paths = [os.path.join(tmpdir, f"compute{r}.json") for r in range(cfg.ranks)]
        start = ctx.Barrier(cfg.ranks)
        procs = [ctx.Process(target=_compute_worker, args=(cfg, p, start), daemon=True) for p in paths]
        run_all(procs, cfg.timeout_s)
        if any(proc.exitcode != 0 for proc in procs) or not all(os.path.exists(p) for p in paths):
            errors = [Path(p + ".error").read_text() for p in paths if os.path.exists(p + ".error")]
            detail = "; ".join(errors) or f"exit codes {[proc.exitcode for proc in procs]}"
            raise LaunchError(
                f"calibrate: the compute measurement failed or timed out ({cfg.timeout_s} s): {detail}", detail
            )
        runs = [json.loads(Path(p).read_text()) for p in paths]
    matmul = {
        d: {int(k): min(r["matmul"][d][k] for r in runs) for k in sizes} for d, sizes in runs[0]["matmul"].items()
    }
    peak = {d: min(r["peak"][d] for r in runs) for d in runs[0]["peak"]}
    return {
        "matmul": matmul,
        "peak": peak,
        "efficiency": min(r["efficiency"] for r in runs),
        "copy": (min(r["copy"][0] for r in runs), min(r["copy"][1] for r in runs)),
        "overhead": max(r["overhead"] for r in runs),
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def memory_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes} B"


def calibrate(cfg: CalibrationConfig | None = None, name: str = "calibrated-cpu") -> Calibration:
    """Measure this machine (see the module docstring) and build a :class:`Calibration` whose profile has one
    node of ``cfg.ranks`` devices (one per gloo rank)."""
    cfg = cfg or CalibrationConfig()
    fits, syncs = measure_collectives(cfg)  # fork first, before any multi-threaded work here
    cpu = cpu_name()
    stamp = (
        f"measured by autoshard calibrate on {datetime.datetime.now(datetime.timezone.utc).date()}, "
        f"{socket.gethostname()}/{cpu}, torch {torch.__version__}, {cfg.threads} thread(s) per rank, "
        f"median of {cfg.reps} after {cfg.warmup} warm-up"
    )
    compute = measure_compute(cfg)
    matmul: dict[str, dict[int, float]] = compute["matmul"]
    peak: dict[str, float] = compute["peak"]
    efficiency: float = compute["efficiency"]
    copy_median, copy_best = compute["copy"]
    overhead: float = compute["overhead"]
    sizes = ", ".join(f"{s}x{s}" for s in cfg.matmul_sizes)
    rates = "; ".join(
        f"{d} " + ", ".join(f"{s}: {f / 1e9:.3g}" for s, f in v.items()) + " GFLOP/s median" for d, v in matmul.items()
    )
    device = DeviceSpec(
        name=f"{cpu} ({cfg.threads} thread(s) per rank)",
        peak_flops=peak,
        memory_bytes=memory_total() // cfg.ranks,
        memory_bandwidth=copy_best,
        flops_efficiency=min(1.0, efficiency),
        memory_efficiency=min(1.0, copy_median / copy_best),
        kernel_overhead=overhead,
        sources={
            "peak_flops": f"{stamp}: torch.mm of square matrices {sizes}; best run at the fastest size; {rates}",
            "flops_efficiency": f"{stamp}: float32 median / best at the fastest size",
            "memory_bytes": f"{stamp}: physical memory (sysconf) divided by the {cfg.ranks} ranks",
            "concurrency": f"{stamp}: compute, copy and overhead measured in {cfg.ranks} processes at once, slowest "
            "rank kept",
            "memory_bandwidth": f"{stamp}: Tensor.copy_ of {_mib(cfg.copy_bytes)} fp32, best run, bytes read + written",
            "memory_efficiency": f"{stamp}: median / best of the copy",
            "kernel_overhead": f"{stamp}: eager torch.add of 8 floats, median",
        },
    )
    detail = "; ".join(
        f"axis {f.axis} {f.kind} n={f.group_size}: {_mib(f.small_bytes)} {f.small_s * 1e6:.0f} us, "
        f"{_mib(f.large_bytes)} {f.large_s * 1e3:.2f} ms"
        for f in fits
    )
    sync = "; ".join(
        f"axis {f.axis}: {f.compute_s * 1e6:.0f} -> {f.with_collective_s * 1e6:.0f} us per chunk, "
        f"all_reduce alone {f.collective_s * 1e6:.0f} us"
        for f in syncs
    )
    link = Link(
        name=f"gloo-loopback ({cfg.ranks} forked ranks)",
        latency=statistics.median(f.latency for f in fits),
        bandwidth=statistics.median(f.bandwidth for f in fits),
        sync=statistics.median(f.sync for f in syncs) if syncs else 0.0,
        source=f"{stamp}, mesh {cfg.mesh_shape()}, messages {_mib(cfg.small_message_bytes)} and "
        f"{_mib(cfg.large_message_bytes)}: all_reduce/all_gather/reduce_scatter fitted to the ring formula "
        f"through both sizes, median over axes and kinds of the fits; slowest rank's medians: {detail}; sync: a "
        f"small all_reduce after each equal compute chunk, beyond its after-barrier time, median over axes: {sync}",
    )
    network = Link(
        name="gloo-tcp (assumed = loopback)",
        latency=link.latency,
        bandwidth=link.bandwidth,
        sync=link.sync,
        source="assumption: calibrate runs on one machine; taken equal to the measured loopback link",
    )
    memcpy = Link(
        name="host-memcpy",
        bandwidth=copy_best / 2,
        latency=overhead,
        source=f"derived from the measured memory_bandwidth / 2 (a copy reads and writes) and "
        f"kernel_overhead ({stamp})",
    )
    profile = ClusterProfile(
        name, device, cfg.ranks, 1, intra_node=link, inter_node=network, host_link=memcpy, all_to_all="ring"
    )  # gloo ranks: DTensor all-gathers a Shard(i) -> Shard(j) move
    return Calibration(profile, matmul, fits, syncs)


def write_profile(calibration: Calibration, path: str | Path) -> Path:
    """Write the profile (plus the raw figures under ``"calibration"``) as JSON; ``get_cluster(path)`` reads it."""
    out = Path(path)
    out.write_text(json.dumps(calibration.to_dict(), indent=2) + "\n")
    return out


def summary(calibration: Calibration) -> Sequence[str]:
    """Human-readable lines of the headline figures (the CLI prints them)."""
    p = calibration.profile
    dev, link = p.device, p.intra_node
    lines = [f"profile {p.name}: {p.nodes} node x {p.devices_per_node} devices, {dev.name}"]
    lines += [f"  matmul {d:<9} peak {f / 1e9:8.2f} GFLOP/s" for d, f in dev.peak_flops.items()]
    lines += [
        f"  flops_efficiency {dev.flops_efficiency:.2f}, memory bandwidth {dev.memory_bandwidth / 1e9:.2f} GB/s "
        f"(efficiency {dev.memory_efficiency:.2f}), kernel overhead {dev.kernel_overhead * 1e6:.2f} us",
        f"  link {link.name}: latency {link.latency * 1e6:.1f} us/step, bandwidth {link.bandwidth / 1e9:.3f} GB/s, "
        f"sync {link.sync * 1e6:.1f} us",
    ]
    lines += [
        f"    axis {f.axis} {f.kind:<14} n={f.group_size} latency {f.latency * 1e6:8.1f} us  bandwidth "
        f"{f.bandwidth / 1e9:.3f} GB/s"
        for f in calibration.collectives
    ]
    lines += [
        f"    axis {f.axis} sync probe      n={f.group_size} compute {f.compute_s * 1e6:.0f} us, with all_reduce "
        f"{f.with_collective_s * 1e6:.0f} us, all_reduce alone {f.collective_s * 1e6:.0f} us -> sync "
        f"{f.sync * 1e6:.0f} us"
        for f in calibration.syncs
    ]
    return lines
