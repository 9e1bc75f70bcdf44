"""Measuring training steps: warm-up, then the median (p10, p90) wall time of N timed steps, and side-by-side runs.

``time_steps`` times one step function on this rank: ``warmup`` untimed calls first (compilation, allocator,
first collectives), then ``steps`` timed calls, each preceded by a barrier on ``group`` when one is given so
that every rank starts the step together and the clock measures the step, not the skew between ranks.

``run_variants`` builds and times several named variants one after another on this rank (every rank must be
given the same list, in the same order: the variants' collectives pair up by order). A step function may carry
a ``notes`` dict attribute (a predicted step time, say): it is copied into ``Row.extra``. A variant that raises
while being built or run is recorded with its error and the next one runs. The first warm-up call's result
is kept in ``Row.extra["first"]`` when it is a number (the benchmark returns the loss: a check that every
variant trains the same model on the same batch); a variant that fails on only some
ranks would leave the others waiting in a collective, so variants should fail (if at all) on every rank.

``side_by_side`` launches ``world_size`` gloo ranks once (``autoshard.testing.launch.launch``, or the ``launch`` given:
``launch(world_size, fn, arg) -> [result of rank 0, rank 1, ...]``) and returns rank 0's rows.

Also here: ``call_loss`` (a model called on its example inputs as its users call it, the loss of the result) and
``spearman`` (rank correlation of predicted and measured times).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor

from autoshard.errors import InputError, InternalError
from autoshard.testing.launch import launch as launch_ranks

log = logging.getLogger(__name__)

__all__ = [
    "Timing",
    "Row",
    "Variant",
    "call_loss",
    "time_steps",
    "run_variants",
    "side_by_side",
    "quantile",
    "spearman",
]

#: A variant: (name, build) where ``build()`` returns the step function to time (one call = one training step).
Variant = tuple[str, Callable[[], Callable[[], Any]]]


@dataclass(frozen=True)
class Timing:
    """Wall-time statistics of the timed steps, in seconds."""

    median_s: float
    p10_s: float
    p90_s: float
    samples: tuple[float, ...] = field(repr=False)

    @property
    def steps(self) -> int:
        return len(self.samples)


@dataclass(frozen=True)
class Row:
    """One variant's result: its timing, or the error that stopped it; plus build seconds and any notes."""

    name: str
    timing: Timing | None
    build_s: float = 0.0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median_s(self) -> float:
        return self.timing.median_s if self.timing is not None else float("nan")


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` with linear interpolation between the closest ranks."""
    if not values:
        raise InputError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise InputError(f"q must be within [0, 1], got {q}")
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank); nan for fewer than 3 pairs or a constant side."""
    if len(xs) != len(ys) or len(xs) < 3:
        return float("nan")

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (sx * sy) if sx > 0 and sy > 0 else float("nan")


def call_loss(model: Any, inputs: Any) -> Tensor:
    """The loss of ``model`` called with positional ``inputs`` (a tuple) or keyword ``inputs`` (a dict); a
    ModelOutput's ``loss`` when the model returns one."""
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return out if isinstance(out, Tensor) else out.loss


def time_steps(
    step: Callable[[], Any],
    steps: int,
    warmup: int = 1,
    *,
    group: Any = None,
    barrier: bool | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Call ``step`` ``warmup`` times untimed, then ``steps`` times timed; return the median, p10 and p90.

    ``barrier`` (default: when a process group is initialized) runs ``dist.barrier(group)`` before each timed
    step, outside the timed interval. ``clock`` returns seconds (a fake clock makes the statistics testable).
    """
    if steps < 1:
        raise InputError(f"steps must be >= 1, got {steps}")
    if warmup < 0:
        raise InputError(f"warmup must be >= 0, got {warmup}")
    if barrier is None:
        barrier = dist.is_available() and dist.is_initialized()
    for _ in range(warmup):
        step()
    samples: list[float] = []
    for _ in range(steps):
        if barrier:
            dist.barrier(group=group)
        t0 = clock()
        step()
        samples.append(clock() - t0)
    return _timing(samples)


def _timing(samples: Sequence[float]) -> Timing:
    return Timing(
        median_s=statistics.median(samples),
        p10_s=quantile(samples, 0.1),
        p90_s=quantile(samples, 0.9),
        samples=tuple(samples),
    )


def run_variants(
    variants: Sequence[Variant],
    steps: int,
    warmup: int = 1,
    *,
    group: Any = None,
    barrier: bool | None = None,
    clock: Callable[[], float] = time.perf_counter,
    interleave: bool = False,
) -> list[Row]:
    """Build and time each variant in turn on this rank; one :class:`Row` per variant, in order.

    ``interleave``: build and warm up every variant first, then time them round-robin (step 1 of each variant,
    then step 2 of each, ...), so that a change in the machine's load during the run falls on every variant
    alike instead of on whichever ran then."""
    if interleave:
        return _run_interleaved(variants, steps, warmup, group, barrier, clock)
    rows: list[Row] = []
    for name, build in variants:
        log.info("variant %s: building", name)
        t0 = time.perf_counter()
        try:
            step, build_s, extra = _build_and_warm(build, warmup)
            timing = time_steps(step, steps, 0, group=group, barrier=barrier, clock=clock)
        except Exception as e:  # recorded in the table; the next variant still runs
            log.warning("variant %s failed: %s\n%s", name, e, traceback.format_exc())
            rows.append(Row(name, None, time.perf_counter() - t0, f"{type(e).__name__}: {e}"))
            continue
        log.info("variant %s: median %.4f s over %d steps (build %.1f s)", name, timing.median_s, steps, build_s)
        rows.append(Row(name, timing, build_s, extra=extra))
    return rows


def _build_and_warm(
    build: Callable[[], Callable[[], Any]], warmup: int
) -> tuple[Callable[[], Any], float, dict[str, Any]]:
    """(step, build seconds, notes) after ``warmup`` untimed calls; the notes are the step's own ``notes`` plus
    the first warm-up call's result under ``"first"`` when it is a number (e.g. the loss)."""
    t0 = time.perf_counter()
    step = build()
    build_s = time.perf_counter() - t0
    extra: dict[str, Any] = dict(getattr(step, "notes", {}))
    for i in range(warmup):
        first = step()
        if i == 0 and isinstance(first, (int, float)):
            extra["first"] = first
    return step, build_s, extra


def _run_interleaved(
    variants: Sequence[Variant],
    steps: int,
    warmup: int,
    group: Any,
    barrier: bool | None,
    clock: Callable[[], float],
) -> list[Row]:
    if steps < 1:
        raise InputError(f"steps must be >= 1, got {steps}")
    if barrier is None:
        barrier = dist.is_available() and dist.is_initialized()
    live: dict[str, tuple[Callable[[], Any], float, dict[str, Any]]] = {}
    failed: dict[str, Row] = {}
    for name, build in variants:
        log.info("variant %s: building", name)
        t0 = time.perf_counter()
        try:
            live[name] = _build_and_warm(build, warmup)
        except Exception as e:  # recorded in the table; the next variant still runs
            log.warning("variant %s failed: %s\n%s", name, e, traceback.format_exc())
            failed[name] = Row(name, None, time.perf_counter() - t0, f"{type(e).__name__}: {e}")
    samples: dict[str, list[float]] = {name: [] for name in live}
    for _ in range(steps):
        for name in [n for n, _ in variants if n in live]:
            try:
                if barrier:
                    dist.barrier(group=group)
                t0 = clock()
                live[name][0]()
                samples[name].append(clock() - t0)
            except Exception as e:  # the variant stops; the others go on
                log.warning("variant %s failed while timed: %s", name, e)
                failed[name] = Row(name, None, live[name][1], f"{type(e).__name__}: {e}")
                del live[name]
    rows = []
    for name, _ in variants:
        if name in failed:
            rows.append(failed[name])
        else:
            _, build_s, extra = live[name]
            rows.append(Row(name, _timing(samples[name]), build_s, extra=extra))
    return rows


def _side_by_side_worker(rank: int, world_size: int, arg: tuple[Any, ...]) -> list[Row]:
    make_variants, make_arg, steps, warmup, interleave = arg
    variants = make_variants(rank, world_size, make_arg)
    return run_variants(variants, steps, warmup, interleave=interleave)


def side_by_side(
    world_size: int,
    make_variants: Callable[[int, int, Any], Sequence[Variant]],
    steps: int,
    warmup: int = 1,
    *,
    launch: Callable[[int, Callable[[int, int, Any], Any], Any], list[Any]] | None = None,
    arg: Any = None,
    interleave: bool = False,
) -> list[Row]:
    """Run every variant of ``make_variants(rank, world_size, arg)`` in one launch of ``world_size`` ranks.

    ``make_variants`` must be a module-level function (it crosses a fork or a pickle) and return the same names
    on every rank; each variant's ``build`` runs on its rank (same seed, same weights, same global batch are the
    caller's to arrange). ``interleave`` as for :func:`run_variants`. ``launch`` defaults to
    :func:`autoshard.testing.launch.launch` (gloo, its default time-out). Returns rank 0's rows.
    """
    results = (launch or launch_ranks)(
        world_size, _side_by_side_worker, (make_variants, arg, steps, warmup, interleave)
    )
    rows: list[Row] = results[0]
    names = [r.name for r in rows]
    for rank, other in enumerate(results[1:], start=1):
        if [r.name for r in other] != names:
            raise InternalError(f"rank {rank} ran variants {[r.name for r in other]}, rank 0 ran {names}")
    return rows
