"""``autoshard calibrate``'s link measurements (what to measure: ``calibration_config.CalibrationConfig``): the
collectives (all_reduce, all_gather, reduce_scatter) timed over a real gloo group of forked ranks on every mesh
axis, each fitted to the ring formula ``t = steps * latency + c * bytes / bandwidth`` through a small and a
large message (:func:`fit_ring`). ``autoshard.cluster.calibrate`` measures compute and builds the profile.

Each of those is timed right after a barrier, with every rank arriving together. Inside a training step a
collective that waits on compute finds the ranks apart (on shared cores a rank may be descheduled for a whole
time slice), so each axis also gets a sync probe (:class:`SyncFit`): a loop of equal compute chunks, with and
without a small all_reduce after each; what the collective adds per iteration beyond its own after-barrier time is
the link's ``sync`` (``autoshard.cluster.profile.Link``).
"""

from __future__ import annotations

import datetime
import json
import logging
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoshard.cluster.calibration_config import CalibrationConfig
from autoshard.errors import InputError, LaunchError

logger = logging.getLogger(__name__)

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class CollectiveFit:
    """Median times of one collective on one mesh axis, and the ring latency/bandwidth that reproduce them."""

    kind: str
    axis: int
    group_size: int
    small_bytes: int
    small_s: float
    large_bytes: int
    large_s: float
    latency: float
    bandwidth: float


@dataclass(frozen=True)
class SyncFit:
    """One axis' sync probe: seconds per iteration of the compute chunk alone and followed by a small all_reduce
    (slowest rank), the all_reduce's after-barrier median, and ``sync``, the rest (>= 0)."""

    axis: int
    group_size: int
    compute_s: float
    with_collective_s: float
    collective_s: float
    sync: float


# ---------------------------------------------------------------------------------------------- collectives


def fit_ring(
    kind: str, n: int, small_bytes: float, small_s: float, large_bytes: float, large_s: float
) -> tuple[float, float]:
    """``(latency, bandwidth)`` with which :func:`autoshard.cost.collectives.algorithm_time` (``ring``, one node)
    gives ``small_s`` for ``small_bytes`` and ``large_s`` for ``large_bytes`` on ``n`` devices.

    Ring: ``t = steps * latency + c * bytes / bandwidth`` with ``steps = n - 1`` and ``c = (n - 1) / n``, both
    doubled for all_reduce. Two points, two unknowns. Noise can make the line ill-posed (large no slower than
    small, or a negative intercept); then the bandwidth comes from the large message alone after taking the
    small one's time as latency, and the latency is clamped at 0."""
    if kind not in COLLECTIVE_KINDS or n < 2:
        raise InputError(f"fit_ring: need kind in {COLLECTIVE_KINDS} and n >= 2, got {kind!r}, n={n}")
    passes = 2 if kind == "all_reduce" else 1
    steps, c = passes * (n - 1), passes * (n - 1) / n
    slope = (large_s - small_s) / (large_bytes - small_bytes)
    if slope > 0:
        bandwidth = c / slope
        latency = (small_s - c * small_bytes / bandwidth) / steps
        if latency >= 0:
            return latency, bandwidth
    latency = max(small_s, 0.0) / steps
    rest = large_s - steps * latency
    bandwidth = c * large_bytes / rest if rest > 0 else c * large_bytes / max(large_s, 1e-9)
    return latency, bandwidth


def _axis_groups(shape: tuple[int, ...], axis: int) -> list[list[int]]:
    """Rank lists of the groups along ``axis`` of a row-major mesh of ``shape``."""
    ranks = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    moved = ranks.movedim(axis, -1).reshape(-1, shape[axis])
    return [row.tolist() for row in moved]


def _sync_probe(group: Any, iters: int) -> tuple[float, float]:
    """(compute only, compute + a small all_reduce) mean seconds per iteration of a loop of equal compute chunks
    (sixteen 128x128 matmuls, about 0.7 ms on one core: what a small layer computes between two tensor-parallel
    all-reduces), each loop run five times, alternating, the median kept. Means over a loop, not medians of
    single calls: a rank descheduled mid-loop is the cost being measured."""
    import torch.distributed as dist

    a, small = torch.randn(128, 128), torch.ones(64)

    def loop(collective: bool) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            for _ in range(16):
                torch.mm(a, a)
            if collective:
                dist.all_reduce(small, group=group)
        return (time.perf_counter() - t0) / iters

    loop(True)  # warm-up
    runs = [(loop(False), loop(True)) for _ in range(5)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def _collective_worker(rank: int, cfg: CalibrationConfig, tmpdir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(os.path.join(tmpdir, "store"), cfg.ranks)
        dist.init_process_group(
            "gloo", rank=rank, world_size=cfg.ranks, store=store, timeout=datetime.timedelta(seconds=cfg.timeout_s)
        )
        shape = cfg.mesh_shape()
        # the *_single names replace the *_tensor ones in newer torch; same (output, input) arguments
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        times: dict[str, float] = {}
        for axis in range(len(shape)):
            group = None
            for members in _axis_groups(shape, axis):  # every rank creates every group, in the same order
                g = dist.new_group(members)
                if rank in members:
                    group = g
            n = shape[axis]
            for kind in COLLECTIVE_KINDS:
                for nbytes in (cfg.small_message_bytes, cfg.large_message_bytes):
                    full = torch.ones(max(n, nbytes // 4 // n * n))
                    shard = torch.ones(full.numel() // n)
                    samples = []
                    for i in range(cfg.warmup + cfg.reps):
                        dist.barrier(group=group)
                        t0 = time.perf_counter()
                        if kind == "all_reduce":
                            dist.all_reduce(full, group=group)
                        elif kind == "all_gather":
                            gather(full, shard, group=group)
                        else:
                            scatter(shard, full, group=group)
                        if i >= cfg.warmup:
                            samples.append(time.perf_counter() - t0)
                    times[f"{axis}/{kind}/{full.numel() * 4}"] = statistics.median(samples)
            times[f"{axis}/sync/compute"], times[f"{axis}/sync/with"] = _sync_probe(group, max(30, cfg.reps))
        Path(tmpdir, f"rank{rank}.json").write_text(json.dumps(times))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent through the file
        Path(tmpdir, f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_all(procs: Sequence[Any], timeout_s: float) -> None:
    """Start the child processes, wait for all of them up to ``timeout_s`` in all, and stop any still running."""
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)


def measure_collectives(cfg: CalibrationConfig) -> tuple[tuple[CollectiveFit, ...], tuple[SyncFit, ...]]:
    """Fork ``cfg.ranks`` gloo ranks (FileStore) and time every collective on every mesh axis; per
    (axis, kind, size) the slowest rank's median, fitted per (axis, kind) with :func:`fit_ring`; and each axis'
    sync probe (:class:`SyncFit`, the slowest rank's loops).

    Fork before any multi-threaded torch work in this process (libgomp's pool does not survive fork);
    :func:`calibrate` does."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="autoshard_calibrate_") as tmpdir:
        procs = [ctx.Process(target=_collective_worker, args=(r, cfg, tmpdir), daemon=True) for r in range(cfg.ranks)]
        run_all(procs, cfg.timeout_s)
        errors = sorted(Path(tmpdir).glob("error*.txt"))
        if errors or any(p.exitcode != 0 for p in procs):
            detail = "; ".join(e.read_text() for e in errors) or f"exit codes {[p.exitcode for p in procs]}"
            raise LaunchError(f"calibrate: a gloo rank failed or timed out ({cfg.timeout_s} s): {detail}", detail)
        per_rank = [json.loads(Path(tmpdir, f"rank{r}.json").read_text()) for r in range(cfg.ranks)]
    slowest = {key: max(r[key] for r in per_rank) for key in per_rank[0]}
    shape, fits, syncs = cfg.mesh_shape(), [], []
    for axis, n in enumerate(shape):
        small = min(t for k, t in slowest.items() if k.startswith(f"{axis}/all_reduce/"))
        bare, loaded = slowest[f"{axis}/sync/compute"], slowest[f"{axis}/sync/with"]
        syncs.append(SyncFit(axis, n, bare, loaded, small, max(0.0, loaded - bare - small)))
        logger.info(
            "axis %d sync probe: compute %.3g s, with all_reduce %.3g s, all_reduce alone %.3g s -> sync %.3g s",
            axis,
            bare,
            loaded,
            small,
            syncs[-1].sync,
        )
        for kind in COLLECTIVE_KINDS:
            (sb, ss), (lb, ls) = sorted(
                (int(k.rsplit("/", 1)[1]), t) for k, t in slowest.items() if k.startswith(f"{axis}/{kind}/")
            )
            latency, bandwidth = fit_ring(kind, n, sb, ss, lb, ls)
            fits.append(CollectiveFit(kind, axis, n, sb, ss, lb, ls, latency, bandwidth))
            logger.info(
                "axis %d %s n=%d: %d B %.3g s, %d B %.3g s -> latency %.3g s, bandwidth %.3g B/s",
                axis,
                kind,
                n,
                sb,
                ss,
                lb,
                ls,
                latency,
                bandwidth,
            )
    return tuple(fits), tuple(syncs)


__all__ = ["COLLECTIVE_KINDS", "CollectiveFit", "SyncFit", "fit_ring", "measure_collectives", "run_all"]
