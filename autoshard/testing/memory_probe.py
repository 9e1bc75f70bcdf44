"""Measured peak CPU memory of a training step, by category, from the PyTorch profiler's memory timeline.

``measure_peak(step)`` runs ``step()`` once under ``torch.profiler.profile(activities=[CPU], profile_memory=True,
record_shapes=True, with_stack=True)``, exports the memory timeline (``export_memory_timeline(<tmp>.raw.json,
device="cpu")``: a JSON ``[times, sizes]`` where ``sizes[k]`` are the bytes per category after the events of
``times[k]``) and returns a :class:`MemoryPeak`: the largest row sum (the step's peak), that row by category,
the baseline (the row of tensors that already existed when the profiler started) and the last row.

What the timeline counts (checked on torch 2.13 CPU; ``tests/unit/test_memory_probe.py`` asserts each point):

- every allocation through c10's CPU allocator made during the window: eager ops, the optimizer's foreach
  temporaries, Inductor-compiled code (its C++ wrapper allocates with ``empty_strided_cpu``), DTensor local
  shards (plain tensors underneath) and the output tensors of gloo collectives (allocated by torch);
- tensors that existed before the profiler started only when the step touches them (reads them in an op or
  frees them): they enter at the first time stamp as "pre-existing" and make the baseline. A tensor that is
  held but never used during the step is invisible (its bytes are not in the peak);
- not: memory that is not a c10 CPU allocation (gloo's own transport buffers, Python objects, the allocator's
  fragmentation, RSS of libraries), so the peak is the tensors' bytes, not the process's resident size.

Categories are the profiler's names (``parameter``, ``optimizer state``, ``input``, ``temporary``,
``activation``, ``gradient``, ``autograd detail``, ``unknown``). They are inferred from the autograd graph and
module structure, so they are reliable for plain eager modules only: the optimizer's foreach temporaries are
"unknown" even there; inside an Inductor-compiled region saved activations have been filed as "parameter"; and
a program run through a custom ``autograd.Function`` on DTensor local shards (autoshard's runtime) comes out
almost all "unknown". Totals are right in every case. For a breakdown that does not depend on the profiler's
guesses, use ``regions`` (what each block allocated and kept), ``owners`` (bytes by storage address, e.g. the
gradients) and the baseline (pre-existing parameters and optimizer state).

``regions``: names of ``torch.profiler.record_function`` blocks the step opens (for example ``"forward_backward"``
and ``"optimizer"``); ``MemoryPeak.regions[name]`` is the peak while that block ran (with its row by category),
so a step's peak can be attributed to the phase that makes it.

``tracker_peak(step, *modules_and_optimizers)`` is a cross-check for eager code through
``torch.distributed._tools.mem_tracker.MemTracker`` (dispatch-level tracking; blind to compiled code).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from autoshard.errors import InputError, UsageError

log = logging.getLogger(__name__)

__all__ = [
    "ALLOCATOR_CATEGORIES",
    "CATEGORIES",
    "MemoryPeak",
    "RegionPeak",
    "category_names",
    "measure_peak",
    "peak_of_timeline",
    "tracker_peak",
]

# the profiler's order of categories in a timeline row (after a leading always-zero column), as
# torch.profiler._memory_profiler._CATEGORY_TO_INDEX lists them on torch 2.11-2.13; used when that is unavailable
CATEGORIES: tuple[str, ...] = (
    "parameter",
    "optimizer state",
    "input",
    "temporary",
    "activation",
    "gradient",
    "autograd detail",
    "unknown",
)


def category_names() -> tuple[str, ...]:
    """The timeline's category names in row order, read from the installed torch (fallback: :data:`CATEGORIES`)."""
    try:
        from torch.profiler import _memory_profiler as mp

        order = list(mp._CATEGORY_TO_INDEX)  # Category members, then None
        return tuple("unknown" if c is None else c.name.lower().replace("_", " ") for c in order)
    except (ImportError, AttributeError):  # pragma: no cover - a torch that moved the private table
        return CATEGORIES


@dataclass(frozen=True)
class RegionPeak:
    """The peak while one ``record_function`` block ran: bytes and the row by category at that time."""

    peak_bytes: int
    by_category: Mapping[str, int]


@dataclass(frozen=True)
class MemoryPeak:
    """One step's tensor memory on this rank (bytes). ``by_category`` is the row at the peak; ``baseline`` the
    pre-existing tensors the step touched (0 everywhere if the timeline shows none); ``final`` the last row."""

    peak_bytes: int
    by_category: Mapping[str, int]
    baseline_bytes: int
    baseline: Mapping[str, int]
    final_bytes: int
    regions: Mapping[str, RegionPeak] = field(default_factory=dict)
    rows: int = 0  # timeline rows (distinct time stamps)
    wall_s: float = 0.0  # the profiled step's wall time (profiling included)
    # of the memory the step itself allocated and still held at the peak: bytes per owner name (``owners=``), the
    # rest under "other"; and per region, the bytes allocated inside it that were still alive when it ended
    owned_at_peak: Mapping[str, int] = field(default_factory=dict)
    retained: Mapping[str, int] = field(default_factory=dict)
    made_in_at_peak: Mapping[str, int] = field(default_factory=dict)  # per region: its allocations alive at the peak
    method: str = "timeline"  # or "allocator": the fallback of measure_peak(baseline=...)

    @property
    def step_bytes(self) -> int:
        """What the step allocates on top of what it found: peak minus baseline."""
        return self.peak_bytes - self.baseline_bytes

    def category(self, name: str) -> int:
        """Bytes of one category at the peak (0 if absent)."""
        return int(self.by_category.get(name, 0))

    def summary(self, unit: int = 2**20) -> str:
        """One line: peak, baseline and the non-zero categories at the peak, in MiB by default."""
        cats = ", ".join(f"{k} {v / unit:.2f}" for k, v in self.by_category.items() if v)
        return f"peak {self.peak_bytes / unit:.2f} (baseline {self.baseline_bytes / unit:.2f}; {cats})"


def _row(sizes: Sequence[int], names: Sequence[str]) -> dict[str, int]:
    """A timeline row as {category: bytes}; the row has one leading column the profiler never fills."""
    values = list(sizes)[-len(names) :]
    return {n: int(v) for n, v in zip(names, values)}


def _peak_index(totals: Sequence[int], lo: int, hi: int) -> int:
    """Index of the largest total in ``totals[lo:hi]`` (the first one on ties)."""
    best = lo
    for k in range(lo, hi):
        if totals[k] > totals[best]:
            best = k
    return best


def peak_of_timeline(
    times: Sequence[int],
    sizes: Sequence[Sequence[int]],
    names: Sequence[str] | None = None,
    windows: Mapping[str, tuple[int, int]] | None = None,
) -> MemoryPeak:
    """The :class:`MemoryPeak` of an exported timeline ``[times, sizes]`` (times in microseconds).

    The first row is the baseline when it carries the pre-existing tensors: the profiler stamps them at the
    earliest time it saw, so its first two rows then share a time stamp. ``windows`` maps a region name to its
    (start, end) in the timeline's microseconds; the region's peak includes the row in force at its start.
    """
    names = tuple(names or category_names())
    if len(times) != len(sizes):
        raise InputError(f"timeline has {len(times)} time stamps but {len(sizes)} rows")
    if not sizes:
        empty = {n: 0 for n in names}
        return MemoryPeak(0, empty, 0, dict(empty), 0, {}, 0)
    for k, r in enumerate(sizes):
        if len(r) < len(names):
            raise InputError(f"timeline row {k} has {len(r)} columns, fewer than the {len(names)} categories")
    totals = [sum(_row(r, names).values()) for r in sizes]
    top = _peak_index(totals, 0, len(totals))
    has_base = len(times) > 1 and times[0] == times[1]
    baseline = _row(sizes[0], names) if has_base else {n: 0 for n in names}
    regions: dict[str, RegionPeak] = {}
    for name, (start, end) in (windows or {}).items():
        before = [k for k, t in enumerate(times) if t <= start]
        lo = before[-1] if before else 0
        inside = [k for k, t in enumerate(times) if start <= t <= end]
        hi = (inside[-1] + 1) if inside else lo + 1
        k = _peak_index(totals, lo, hi)
        regions[name] = RegionPeak(totals[k], _row(sizes[k], names))
    return MemoryPeak(
        peak_bytes=totals[top],
        by_category=_row(sizes[top], names),
        baseline_bytes=sum(baseline.values()),
        baseline=baseline,
        final_bytes=totals[-1],
        regions=regions,
        rows=len(times),
    )


def _region_windows(prof: Any, names: Iterable[str]) -> dict[str, tuple[int, int]]:
    """(start, end) in microseconds, on the memory timeline's clock, of the first block named each of ``names``
    (the union of its occurrences when a name repeats); names the trace lacks are left out (logged)."""
    wanted = set(names)
    if not wanted:
        return {}
    found: dict[str, tuple[int, int]] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.name in wanted:
            s, t = e.start_time_ns // 1000, e.end_time_ns // 1000
            old = found.get(e.name)
            found[e.name] = (min(s, old[0]), max(t, old[1])) if old else (s, t)
        stack.extend(e.children)
    for n in sorted(wanted - set(found)):
        log.warning("memory_probe: no record_function block named %r ran during the step", n)
    return found


def _allocations(prof: Any) -> list[tuple[int, int, int]]:
    """Every CPU allocation (+bytes) and free (-bytes) the profiler recorded: (time in us, pointer, bytes), in time
    order. These are the allocator's own events, so they include allocations no tensor op owns (compiled code)."""
    from torch._C._profiler import _EventType

    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu":
            out.append((e.start_time_ns, int(e.typed[1].ptr), int(e.typed[1].alloc_size)))
    out.sort()
    return [(t // 1000, p, b) for t, p, b in out]


ALLOCATOR_CATEGORIES: tuple[str, ...] = ("pre-existing", "allocated in step")


def _allocator_timeline(allocs: Sequence[tuple[int, int, int]], base: int) -> tuple[list[int], list[list[int]]]:
    """A ``[times, sizes]`` timeline from the allocator's events: a first row of ``base`` pre-existing bytes (so
    :func:`peak_of_timeline` reads it as the baseline), then the running sum of allocations and frees per time.
    A pre-existing tensor the step frees lowers the running sum below the baseline's share, as it should."""
    t0 = allocs[0][0] if allocs else 0
    times, sizes = [t0], [[0, base, 0]]
    for t, _, size in allocs:
        if t != times[-1] or len(times) == 1:
            times.append(t)
            sizes.append(list(sizes[-1]))
        sizes[-1][2] += size
    return times, sizes


def _live_at(allocs: Sequence[tuple[int, int, int]], t_us: int) -> dict[int, tuple[int, int]]:
    """Pointer -> (time allocated, bytes) of the step's allocations alive after the events of ``t_us``."""
    live: dict[int, tuple[int, int]] = {}
    for t, ptr, size in allocs:
        if t > t_us:
            break
        if size > 0:
            live[ptr] = (t, size)
        else:
            live.pop(ptr, None)
    return live


def _pointer(x: torch.Tensor | int) -> int:
    if isinstance(x, int):
        return x
    local = getattr(x, "_local_tensor", x)  # a DTensor's storage is its local shard's
    return int(local.untyped_storage().data_ptr())


def _profile_once(step: Callable[[], Any], keep_timeline: str | os.PathLike | None) -> tuple[Any, Any, Any, float]:
    """One profiled ``step()``: the profiler, the exported ``times`` and ``sizes`` (``None`` and the error's first
    line when the profiler's memory pass failed) and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    wall = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory(prefix="autoshard_memory_") as tmp:
            path = os.path.join(tmp, "timeline.raw.json")  # ".raw.json" (not .gz): the [times, sizes] rows
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # "deprecated" (advice for CUDA snapshots)
                prof.export_memory_timeline(path, device="cpu")
            with open(path) as f:
                times, sizes = json.load(f)
    except AssertionError as e:  # the profiler's data-flow pass, e.g. "duplicate outputs: aten::_foreach_sqrt"
        return prof, None, (str(e).splitlines() or [""])[0][:160], wall
    if keep_timeline is not None:
        with open(keep_timeline, "w") as f:
            json.dump([times, sizes], f)
    return prof, times, sizes, wall


def measure_peak(
    step: Callable[[], Any],
    *,
    regions: Sequence[str] = (),
    owners: Callable[[], Mapping[str, Iterable[torch.Tensor | int]]] | None = None,
    keep_timeline: str | os.PathLike | None = None,
    attempts: int = 2,
    baseline: Callable[[], int] | None = None,
) -> MemoryPeak:
    """Run ``step()`` once under the profiler and return its peak tensor memory on this process's CPU.

    ``regions``: names of ``torch.profiler.record_function`` blocks inside ``step`` whose own peaks to report.
    ``owners``: called after the step; names -> tensors (or storage pointers) whose storage the step allocated,
    e.g. the gradients (record them inside the step, before ``zero_grad(set_to_none=True)`` drops them). Their
    bytes live at the peak are ``MemoryPeak.owned_at_peak[name]``, the rest of what the step allocated "other".
    A pointer the allocator reused for an earlier short-lived tensor is attributed by address, so keep owners
    to tensors alive at the peak you are asking about.
    ``keep_timeline``: a path to copy the exported ``[times, sizes]`` JSON to (for plotting or a later look).
    ``attempts``: the profiler's memory pass sometimes fails on a step (an AssertionError "duplicate outputs" in
    its data-flow graph, seen on foreach optimizer ops in Inductor-compiled training); then another step is
    measured, up to this many (a step with collectives must then be re-run on every rank alike: there use
    ``attempts=1`` with ``baseline``, or one rank waits in a collective the others never enter). If all fail and
    ``baseline`` is given (bytes the step starts with: parameters, optimizer state, inputs), the result is rebuilt from
    the allocator's own events: that baseline plus the running sum of the step's allocations and frees
    (``method="allocator"``, categories "pre-existing" and "allocated in step"); without ``baseline`` a RuntimeError
    says so. Run warm-up steps first: the first step allocates the optimizer state and (compiled code) compiles.
    """
    for attempt in range(1, attempts + 1):
        prof, times, sizes, wall = _profile_once(step, keep_timeline)
        if times is not None:
            break
        log.warning("memory_probe: the memory timeline failed (%s) on step %d of %d", sizes, attempt, attempts)
    allocs = _allocations(prof)
    method = "timeline" if times is not None else "allocator"
    if times is None:
        if baseline is None:
            raise UsageError(
                f"memory_probe: the profiler's memory timeline failed {attempts} times ({sizes}); "
                "pass baseline= to fall back on the allocator's events"
            )
        times, sizes = _allocator_timeline(allocs, int(baseline()))
    windows = _region_windows(prof, regions)
    names = category_names() if method == "timeline" else ALLOCATOR_CATEGORIES
    result = peak_of_timeline(times, sizes, names, windows=windows)
    t_peak = times[max(range(len(sizes)), key=lambda k: sum(sizes[k]))] if sizes else 0
    live = _live_at(allocs, t_peak)
    sizes_live = {p: b for p, (_, b) in live.items()}
    owned: dict[str, int] = {}
    claimed: set[int] = set()
    for name, tensors in (owners() if owners is not None else {}).items():
        ptrs = {_pointer(x) for x in tensors} - claimed
        claimed |= ptrs
        owned[name] = sum(sizes_live.get(p, 0) for p in ptrs)
    owned["other"] = sum(b for p, b in sizes_live.items() if p not in claimed)
    retained = {
        name: sum(b for t, b in _live_at(allocs, end).values() if t >= start) for name, (start, end) in windows.items()
    }
    made_in = {name: sum(b for t, b in live.values() if start <= t <= end) for name, (start, end) in windows.items()}
    result = dataclasses.replace(
        result, wall_s=wall, owned_at_peak=owned, retained=retained, made_in_at_peak=made_in, method=method
    )
    log.debug("memory_probe: %s over %d rows in %.2f s", result.summary(), result.rows, wall)
    return result


def tracker_peak(step: Callable[[], Any], *tracked: torch.nn.Module | torch.optim.Optimizer) -> dict[str, int]:
    """Cross-check for eager code: ``step()`` once under ``MemTracker`` (tracking ``tracked`` modules and
    optimizers); its peak snapshot on the CPU as {MemTracker's category name: bytes}, with "Total".

    It tracks storages through the dispatcher, so allocations inside compiled code are not seen.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    if tracked:
        tracker.track_external(*tracked)
    with tracker:
        step()
    snap = tracker.get_tracker_snapshot("peak")
    cpu = next((v for d, v in snap.items() if torch.device(d).type == "cpu"), {})
    return {str(k): int(v) for k, v in cpu.items()}
