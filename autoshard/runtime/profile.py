"""A few real training steps under torch.profiler, written as one Chrome trace with the plan's predicted step
beside them (``plans/trace.py``): prediction and measurement open in one viewer (Perfetto, ``chrome://tracing``).

The measured events are torch.profiler's own (CPU, and CUDA kernels on a GPU), each step marked by a range named
``autoshard step i``; the predicted processes (their pids from ``plans.trace.PREDICTED_PID``) are shifted to start
where the last measured step starts. Each rank writes its own file: rank 0 at ``path``, rank r beside it as
``<name>.rank<r><suffixes>``.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from autoshard.errors import InputError
from autoshard.plans.plan import Plan
from autoshard.plans.trace import merge, predicted_trace, read_trace, write_trace

log = logging.getLogger(__name__)


class Steps(Protocol):
    """What is profiled: a compiled module's training step and its plan."""

    plan: Plan

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...


def rank_path(path: str | Path) -> Path:
    """This rank's file: ``path`` on rank 0 (or without a process group), ``name.rank<r>.json.gz`` on rank r."""
    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        return path
    stem, _, suffixes = path.name.partition(".")
    return path.with_name(f"{stem}.rank{rank}" + (f".{suffixes}" if suffixes else ""))


def profile_steps(
    module: Steps,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    steps: int,
    warmup: int,
    optimizer: torch.optim.Optimizer | None,
    path: str | Path,
) -> Path:
    """Run ``warmup`` then ``steps`` training steps of ``module`` on the call ``(args, kwargs)`` (each followed by
    ``optimizer.step()`` and ``zero_grad()`` when given), the latter under torch.profiler; write the trace with the
    prediction beside it (see the module docstring) and return this rank's path."""
    if steps < 1 or warmup < 0:
        raise InputError(f"profile(steps={steps}, warmup={warmup}): give steps >= 1 and warmup >= 0")

    def one() -> None:
        module.step(*args, **kwargs)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()

    for _ in range(warmup):
        one()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(f"autoshard step {i}"):
                one()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "measured.json"
        prof.export_chrome_trace(str(raw))
        measured = read_trace(raw)
    last = f"autoshard step {steps - 1}"
    starts = [e["ts"] for e in measured.get("traceEvents", ()) if e.get("name") == last and e.get("ph") == "X"]
    out = rank_path(path)
    write_trace(merge(measured, predicted_trace(module.plan), at_us=min(starts, default=0.0)), out)
    log.info("profile: %d steps measured, the predicted step beside them, in %s", steps, out)
    return out


__all__ = ["Steps", "profile_steps", "rank_path"]
