"""Megatron-LM's fixed pipeline configurations, priced by autoshard's model.

:func:`evaluate_config` prices a manual TP x PP x DP layout the way Megatron-LM runs it:
each stage is a ``dp x tp`` sub-mesh planned with the intra-op recipe pinned (``tp``: Megatron's column/row
parallel layers on the ``tp`` axis, batch and replicated parameters on ``dp``; ``ddp`` when tp = 1), the layers
are split evenly (``inter_op.even_split``), and the schedule is 1F1B or interleaved 1F1B. :func:`megatron_recipe`
is Megatron's recipe ("pp+tp+dp"): TP = the devices of a node, the smallest PP (whole nodes per stage) whose
stages fit the memory budget, DP over the rest, micro-batches of 1 or 2 sequences per data-parallel rank.
The offline pipeline planner (``pipeline/plan_offline.py``) lists it among the search's options
(``recipe == "pp+tp+dp"``), so the search says how its own choice compares.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from autoshard.cluster.profile import ClusterProfile
from autoshard.config import PlanConfig
from autoshard.errors import InputError
from autoshard.pipeline.pricing import PipelineOption, p2p_seconds
from autoshard.pipeline.search import MEGATRON
from autoshard.pipeline.solves import FakeStageMeshes, StageSolves
from autoshard.solver.inter_op import best_split

log = logging.getLogger(__name__)

MEGATRON_SCHEDULES = ("1F1B", "Interleaved1F1B")  # what Megatron-LM ran in 2021 (Narayanan et al., SC21)


def evaluate_config(
    model: nn.Module,
    example_inputs: Sequence[Any],
    cluster: ClusterProfile,
    config: PlanConfig,
    *,
    tp: int,
    pp: int,
    microbatches: int,
    dp: int | None = None,
    schedule: str | None = None,
    recompute: bool | None = True,
    max_chunks: int = 4,
    solves: StageSolves | None = None,
) -> PipelineOption:
    """A fixed Megatron-style layout: ``pp`` stages of ``dp x tp`` devices (TP on the inner, intra-node axis;
    stages and DP outside it), ``microbatches`` micro-batches, layers split evenly, intra-op recipe pinned
    (``tp``, or ``ddp`` when tp = 1). ``schedule`` None: the faster of 1F1B and interleaved 1F1B (chunks up to
    ``max_chunks`` that divide the layers evenly); one stage accumulates gradients (1F1B with S = 1). The recipe
    is solved on the sub-mesh's program in ``solves`` (the stage search's, when it is handed over)."""
    n = cluster.num_devices()
    dp = n // (tp * pp) if dp is None else dp
    if tp * pp * dp != n or min(tp, pp, dp) < 1:
        raise InputError(f"tp={tp} x pp={pp} x dp={dp} = {tp * pp * dp} devices, but {cluster.name} has {n}")
    batch = int(example_inputs[0].shape[0])
    if batch % microbatches or (batch // microbatches) % dp:
        raise InputError(
            f"global batch {batch} in {microbatches} micro-batches does not split over dp={dp}; "
            f"use a micro-batch count that divides {batch} into multiples of {dp} sequences"
        )
    sub, names = ((dp, tp), ("dp", "tp")) if dp > 1 and tp > 1 else ((tp,), ("tp",)) if tp > 1 else ((dp,), ("dp",))
    recipe = "tp" if tp > 1 else "ddp"
    scheds = (schedule,) if schedule else ("1F1B",) if pp == 1 else MEGATRON_SCHEDULES
    if solves is None:
        from autoshard.pipeline.blocks import main_sequence

        solves = StageSolves(
            model,
            example_inputs,
            config,
            FakeStageMeshes(cluster),
            (main_sequence(model) or ("",))[0],
            strict_inputs=False,
        )
    kc = solves.costs(pp, (sub, names, microbatches), recipe)
    split, layout = None, ""
    if kc is not None:
        p2p = p2p_seconds(cluster, dp * tp, pp, kc.boundary_bytes / (dp * tp))
        split = best_split(
            list(kc.layers),
            kc.head,
            kc.tail,
            pp,
            microbatches,
            config.memory_budget,
            p2p,
            scheds,
            max_chunks,
            recompute,
            even=True,
        )
        layout = kc.layout
    note = "" if split is not None else "does not fit the memory budget"
    log.info(
        "config tp=%d pp=%d dp=%d, %d micro-batches: %s",
        tp,
        pp,
        dp,
        microbatches,
        f"{split.step_time_s:.6f} s ({split.schedule} x{split.chunks})" if split else note,
    )
    return PipelineOption(pp, sub, microbatches, split, note, recipe=recipe, layout=layout)


def megatron_recipe(
    model: nn.Module,
    example_inputs: Sequence[Any],
    cluster: ClusterProfile,
    config: PlanConfig,
    *,
    microbatch_sizes: Sequence[int] = (1, 2),
    recompute: bool | None = True,
    solves: StageSolves | None = None,
) -> PipelineOption:
    """Megatron-LM's recipe ("pp+tp+dp"): TP = devices per node, PP = the smallest number of whole-node stages
    whose stages fit ``config.memory_budget`` (the device's memory when None), DP = the remaining nodes; of the
    micro-batch sizes (sequences per data-parallel rank) the faster that fits. Full activation recomputation,
    as Megatron's GPT runs use (``recompute=None`` would use it only where needed)."""
    from autoshard.ir import repeated_layers

    if config.memory_budget is None:
        config = dataclasses.replace(config, memory_budget=cluster.device.memory_bytes)
    tp, nodes = cluster.devices_per_node, cluster.nodes
    found = repeated_layers(model)
    depth = found[1] if found else 1
    batch = int(example_inputs[0].shape[0])
    tried = []
    for pp in (p for p in range(1, nodes + 1) if nodes % p == 0 and p <= depth):
        dp = nodes // pp
        best: PipelineOption | None = None
        for mbs in sorted(microbatch_sizes):
            if batch % (dp * mbs) or batch // (dp * mbs) < pp:
                continue
            o = evaluate_config(
                model,
                example_inputs,
                cluster,
                config,
                tp=tp,
                pp=pp,
                dp=dp,
                microbatches=batch // (dp * mbs),
                recompute=recompute,
                solves=solves,
            )
            if o.split is None:
                break  # the recipe's state is the same and B >= pp: larger micro-batches only need more memory
            if best is None or o.step_time_s < best.step_time_s:
                best = o
        if best is not None:
            return dataclasses.replace(best, recipe=MEGATRON, note=f"tp={tp} pp={pp} dp={dp}")
        tried.append(pp)
    return PipelineOption(0, (), 0, None, f"{MEGATRON}: no PP in {tried} fits the memory budget", recipe=MEGATRON)


__all__ = ["MEGATRON_SCHEDULES", "evaluate_config", "megatron_recipe"]
