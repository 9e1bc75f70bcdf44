"""Inductor's FX overlap scheduler (``torch._inductor.fx_passes.overlap_scheduling``), run off-GPU.

``benchmarks/overlap_vs_inductor.py`` measures it against autoshard's own ``autoshard/compiler/overlap.py`` on the same
lowered graphs. Off-GPU two things stop it as shipped (torch 2.13): its roofline estimate of every compute node
asks for the GPU's memory bandwidth (which imports Triton), and it needs a memory limit (``None`` leaves its
memory tracker unset). Here the roofline is replaced, for the duration of the call, by the estimator given
(autoshard's cost model), and the default limits are kept.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch.fx as fx

Estimator = Callable[[fx.Node, "int | None"], "float | None"]


def available() -> bool:
    """Whether this torch has the scheduler (2.11 and 2.13 do)."""
    import importlib.util

    return importlib.util.find_spec("torch._inductor.fx_passes.overlap_scheduling") is not None


def inductor_schedule_overlap(gm: fx.GraphModule, estimate: Estimator, bucketing: bool = True) -> fx.GraphModule:
    """Inductor's ``schedule_overlap_bucketing`` on ``gm`` (a graph of ``_c10d_functional`` collectives and
    their waits), every node's runtime (ms) from ``estimate(node, override_size)``; ``bucketing``: also its
    overlap-preserving collective bucketing (and FSDP all-gather pre-bucketing). Returns the new graph module."""
    from torch._inductor.fx_passes import overlap_scheduling as sched

    wanted = {
        "collective_bucketing": bucketing,
        "custom_runtime_estimation": estimate,
        "compute_estimator": "analytical",
        "pre_bucketing_fsdp_collectives": bucketing,
    }
    known = inspect.signature(sched.schedule_overlap_bucketing).parameters  # (2.11 may lack the last two)
    roofline = sched.estimate_roofline_runtime_ms
    sched.estimate_roofline_runtime_ms = lambda node: estimate(node, None) or 0.0
    try:
        out = sched.schedule_overlap_bucketing(gm, **{k: v for k, v in wanted.items() if k in known})
    finally:
        sched.estimate_roofline_runtime_ms = roofline
    out.recompile()
    return out
