"""The recomputation search: under a memory budget, which layers to save, recompute selectively or recompute in
full, planned as few times as the arithmetic allows.

``plan_graph`` is where every plan of a whole program starts (``compile``, ``plan``, the offline planner, a
pipeline's stages): without a budget, or with ``config.recompute`` given, it is one solve (``search/planned.py``);
under a budget it weighs recomputation per layer as its docstring says. The arithmetic of a mix (``mix_peak``,
``best_mix``) prices (saved, selective, full) layer counts from one plan's layout and its layers' replay costs
(``compiler/capture_recompute.py: layer_replays``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoshard.cluster.profile import ClusterProfile
from autoshard.compiler.capture_recompute import LayerReplay, layer_replays, mix_specs, typical_replay
from autoshard.compiler.context import PlanningCache
from autoshard.config import PlanConfig
from autoshard.errors import InfeasibleBudget
from autoshard.ir import repeated_layers
from autoshard.notation import FULL, SELECTIVE, describe, spec
from autoshard.plans.plan import RecipeSummary
from autoshard.search.planned import Planned, plan_once, prepare_once

log = logging.getLogger(__name__)


def plan_graph(
    model: nn.Module,
    example_inputs: Sequence[Any],
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    broadcast_solution: bool = False,
    progress: Any = None,
    stage: bool = False,
    cache: PlanningCache | None = None,
    recipes_known: Callable[[tuple[RecipeSummary, ...]], None] | None = None,
) -> Planned:
    """Plan ``model``; ``stage=True`` plans a pipeline stage (tensor outputs, input gradients; see capture).

    Under a memory budget (and no ``config.recompute`` given) recomputation is weighed per layer
    (``autoshard/compiler/capture_recompute.py`` tags a mix): the plans that save everything, recompute every
    repeated layer in full, and selectively (all but the matmuls); then, from the last two's layouts and their layers'
    replay costs (``layer_replays``), the mix of saved, selective and fully recomputed layers predicted to fit the
    budget fastest (``best_mix``) is planned when it is predicted ahead, and once more with the estimate corrected. The
    fastest that fits is kept: the budget may have forced the plan that saves everything into slower layouts, and
    recomputing only some layers, or only their cheap ops, may be enough. A plan that saves everything and peaks
    below ``SLACK`` of the budget is not bound by it and is kept without the others. The plan's recipes are each
    recipe's faster fitting form of saving everything and recomputing every layer (``search/recipes_alone.py``
    then prices each as it runs alone). ``cache``: shared with other calls on the same example (the recipes'
    searches), else one of its own. ``recipes_known``: called with the plan's recipes once they are known (after the
    attempts that save everything and recompute every layer, before the other mixes), so that the recipes'
    searches alone can start while this one goes on (``search/recipes_alone.py``)."""
    layers = repeated_layers(model) if config.memory_budget is not None and not stage and not config.recompute else None
    # the attempts below differ only in the recomputation tagged: one capture and one candidate cache serve all
    cache = cache or PlanningCache()
    once = functools.partial(
        plan_once,
        model,
        example_inputs,
        mesh,
        cluster,
        broadcast_solution=broadcast_solution,
        progress=progress,
        stage=stage,
        cache=cache,
    )
    if layers is None or not layers[0]:
        return once(config)
    container, total = layers
    plans: list[Planned] = []
    failed: list[InfeasibleBudget] = []

    def attempt(specs: tuple[str, ...], recipes: bool = False) -> Planned | None:
        # the recipes are read from the attempts that save everything and that recompute every layer only
        # (``_recipes_of``): the other attempts solve the plan alone
        try:
            plans.append(
                once(dataclasses.replace(config, recompute=specs, solve_recipes=config.solve_recipes and recipes))
            )
            return plans[-1]
        except InfeasibleBudget as e:
            failed.append(e)
            return None

    saving = attempt((), recipes=True)
    if saving is not None and saving.plan.peak_memory.total <= SLACK * config.memory_budget:
        # the budget does not bind the plan that saves everything: recomputing could only cost time (the recipes,
        # whose layouts the budget may bind, are solved recomputing every layer too: the forms people would run)
        full = attempt((container,), recipes=True) if config.solve_recipes else None
        return saving.with_plan(dataclasses.replace(saving.plan, recipes=_recipes_of([r for r in (saving, full) if r])))
    full = attempt((container,), recipes=True)
    reps = {}
    if full is not None and (replays := layer_replays(full.graph, full.ctx.mesh_shape, cluster.device, FULL)):
        reps[FULL] = typical_replay(replays.values())
    # the selective plan holds more than the full one and its layout is no faster: planned where the full plan's
    # step less the replays selective recomputation spares is ahead of the plans so far
    sel = None
    selective = FULL in reps and (
        full.plan.step_time_s - total * (reps[FULL].full_s - reps[FULL].cheap_s) < _fastest(plans)
    )
    if recipes_known is not None:
        if selective:  # (built once here, before the recipes' searches are forked: they plan it too)
            prepare_once(
                model,
                example_inputs,
                mesh,
                cluster,
                dataclasses.replace(config, recompute=(spec(container, SELECTIVE),), solve_recipes=False),
                cache,
                stage=stage,
            )
        recipes_known(_recipes_of([r for r in (saving, full) if r is not None]))
    if selective:
        sel = attempt((spec(container, SELECTIVE),))
    if sel is not None and (replays := layer_replays(sel.graph, sel.ctx.mesh_shape, cluster.device, SELECTIVE)):
        reps[SELECTIVE] = typical_replay(replays.values())
    pure = {(total, 0, 0), (0, total, 0), (0, 0, total)}
    options = []  # (predicted step, counts, anchor run, anchor counts, its typical layer)
    for run, mode, anchor in ((full, FULL, (0, 0, total)), (sel, SELECTIVE, (0, total, 0))):
        if mode in reps:
            rep = reps[mode]
            found = best_mix(
                total,
                rep,
                anchor,
                run.plan.step_time_s,
                run.plan.peak_memory.total,
                0.98 * config.memory_budget,
                allow_full=mode == FULL,
            )
            log.info(
                "plan: a layer of %s in the %s plan's layout: full recomputation frees %.3g B for %.3g s, "
                "selective %.3g B for %.3g s; fastest mix (saved, selective, full) %s",
                container,
                mode,
                rep.full_bytes,
                rep.full_s,
                rep.cheap_bytes,
                rep.cheap_s,
                found,
            )
            if found is not None and found[0] not in pure:
                options.append((found[1], found[0], run, anchor, rep, mode))
    ahead = [o for o in options if o[0] < _fastest(plans)]
    if ahead:  # the mix predicted fastest, if ahead; once more with the estimate corrected by what it missed
        _, counts, run, anchor, rep, mode = min(ahead, key=lambda o: o[0])
        tried = set(pure)
        while counts not in tried:
            tried.add(counts)
            got = attempt(mix_specs(container, counts))
            peak = got.plan.peak_memory.total if got is not None else failed[-1].least_bytes
            if not peak:
                break
            offset = peak - mix_peak(rep, anchor, run.plan.peak_memory.total, counts)
            found = best_mix(
                total,
                rep,
                anchor,
                run.plan.step_time_s,
                run.plan.peak_memory.total,
                0.98 * config.memory_budget,
                offset,
                allow_full=mode == FULL,
            )
            if found is None or len(tried) > len(pure) + 1:
                break
            counts = found[0]
    if not plans:
        least = min(failed, key=lambda e: e.least_bytes or math.inf)
        fixed = [e.fixed_bytes for e in failed]  # (a floor for micro-batches: the lowest of every attempt's)
        least.fixed_bytes = min(fixed) if None not in fixed else None  # type: ignore[type-var]
        floors = [e.step_floor for e in failed]  # (what no micro-batch count goes below: the lowest of them)
        least.step_floor = min(floors) if None not in floors else None  # type: ignore[type-var]
        raise least
    best = min(plans, key=lambda p: p.plan.step_time_s)
    best = best.with_plan(
        dataclasses.replace(best.plan, recipes=_recipes_of([r for r in (saving, full) if r is not None]))
    )
    if best.plan.recompute:
        log.info(
            "plan: recomputing %s in the backward (%s)",
            describe(best.ctx.config.recompute),
            ", ".join(
                f"{p.plan.step_time_s:.6f} s with {describe(p.ctx.config.recompute) or 'every activation saved'}"
                for p in plans
            ),
        )
    return best


def _fastest(plans: Sequence[Planned]) -> float:
    return min((p.plan.step_time_s for p in plans), default=math.inf)


SLACK = 0.9  # a plan whose peak is below this share of the budget is taken as not bound by it


def _recipes_of(runs: Sequence[Planned]) -> tuple[RecipeSummary, ...]:
    """The recipes as people run them, each the faster that fits of saving every activation and recomputing every
    layer (the runs that planned those): the mixes the planner found are its own, not the recipes'."""
    best: dict[str, RecipeSummary] = {}
    for run in runs:
        for r in run.plan.recipes:
            cur = best.get(r.name)
            if cur is None or (r.fits, -r.step_time_s) > (cur.fits, -cur.step_time_s):
                best[r.name] = r
    return tuple(best.values())


def _mix_bytes(replay: LayerReplay, counts: tuple[int, int, int]) -> float:
    saved, sel, full = counts
    again = replay.full_again if full else replay.cheap_again if sel else 0.0
    return saved * replay.full_bytes + sel * (replay.full_bytes - replay.cheap_bytes) + again


def _mix_s(replay: LayerReplay, counts: tuple[int, int, int]) -> float:
    return counts[1] * replay.cheap_s + counts[2] * replay.full_s


def mix_peak(
    replay: LayerReplay, anchor: tuple[int, int, int], anchor_bytes: float, counts: tuple[int, int, int]
) -> float:
    """The peak of a (saved, selective, full) mix estimated from a plan of the ``anchor`` mix (peak
    ``anchor_bytes``) in its layout: each saved layer keeps what full recomputation frees, a selective one what it
    does not replay; the replay's working set (``cost/memory.py``: the largest replayed layer) is a full layer's,
    a selective one's, or none."""
    return anchor_bytes + _mix_bytes(replay, counts) - _mix_bytes(replay, anchor)


def best_mix(
    layers: int,
    replay: LayerReplay,
    anchor: tuple[int, int, int],
    anchor_s: float,
    anchor_bytes: float,
    budget: float,
    offset: float = 0.0,
    allow_full: bool = True,
) -> tuple[tuple[int, int, int], float] | None:
    """The (saved, selective, full) layer counts (at most two modes; no full layers unless ``allow_full``) that
    fit ``budget`` fastest in the layout of a plan of the ``anchor`` mix (step ``anchor_s``, peak
    ``anchor_bytes``), and that mix's predicted step; ``offset``: what an earlier estimate missed by. None when
    no mix fits."""
    best: tuple[tuple[int, int, int], float] | None = None
    for a, b in itertools.product(range(layers + 1), repeat=2):
        counts = (a, b, layers - a - b)
        if counts[2] < 0 or sum(c > 0 for c in counts) > 2 or (counts[2] and not allow_full):
            continue
        step = anchor_s - _mix_s(replay, anchor) + _mix_s(replay, counts)
        if mix_peak(replay, anchor, anchor_bytes, counts) + offset <= budget and (
            best is None or step < best[1] - 1e-12
        ):
            best = (counts, step)
    return best


__all__ = ["SLACK", "best_mix", "mix_peak", "plan_graph"]
