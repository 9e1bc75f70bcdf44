"""``autoshard.plan(..., pipeline="auto")`` on the offline path: run the stage search, choose among its options
(and the plain plan without stages, and Megatron's recipe when the recipes are solved too), and build the chosen
pipelined Plan (``pipeline.plan``) with the options as its recipe rows. The search, Megatron's configurations, the
chosen plan and the plain plan share one :class:`~autoshard.pipeline.solves.StageSolves` (captures and solves).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autoshard.cluster.meshes import mesh_names
from autoshard.cluster.profile import ClusterProfile
from autoshard.config import PlanConfig
from autoshard.errors import InfeasibleBudget, InputError, LaunchError
from autoshard.notation import format_seconds
from autoshard.pipeline.megatron import megatron_recipe
from autoshard.pipeline.plan import FLAT_NAME, pipelined_plan
from autoshard.pipeline.pricing import PipelineOption
from autoshard.pipeline.search import MEGATRON, search_pipeline, stage_meshes
from autoshard.pipeline.solves import FakeStageMeshes, StageSolves
from autoshard.plans.plan import Plan, RecipeSummary

log = logging.getLogger(__name__)


def _describe(o: PipelineOption) -> str:
    what = "no stages" if o.stages == 1 else f"{o.stages} stages of {o.submesh}"
    what += f" ({o.recipe} layout)" if o.recipe else ""
    if o.split is None:
        return f"{what}: {o.note or 'no split fits'}"
    if o.stages == 1:
        return f"{what}: {format_seconds(o.step_time_s)}"
    return f"{what}, {o.split.schedule} x {o.microbatches} micro-batches: {format_seconds(o.step_time_s)}"


def flat_summary(options: Sequence[PipelineOption]) -> RecipeSummary | None:
    """The fastest 1-stage option (the intra-op plan of the whole cluster) as a row of the recipe comparison."""
    flat = next((o for o in options if o.stages == 1 and o.recipe != MEGATRON and not o.estimated), None)
    flat = flat or next((o for o in options if o.stages == 1 and o.recipe != MEGATRON), None)
    if flat is None:
        return None
    if flat.split is None:
        return RecipeSummary(FLAT_NAME, math.inf, 0, False, flat.note or "no 1-stage plan fits the memory budget")
    return RecipeSummary(
        FLAT_NAME,
        flat.step_time_s,
        max(flat.split.stage_memory_bytes),
        True,
        "the intra-op plan of the whole cluster" + (" (estimated)" if flat.estimated else ""),
    )


def recipe_rows(options: Sequence[PipelineOption]) -> list[RecipeSummary]:
    """Megatron's recipe ("pp+tp+dp") among the options as a row of the recipe comparison."""
    rows = []
    for o in options:
        if o.recipe != MEGATRON:
            continue
        name = MEGATRON
        if o.split is None:
            rows.append(RecipeSummary(name, math.inf, 0, False, o.note))
            continue
        redo = ", recompute" if o.split.recompute else ""
        mesh = o.layout.split(";")[0] if o.layout else str(o.submesh)  # the layout summary starts with the mesh
        note = f"pp={o.stages} x {mesh}, {o.split.schedule} x {o.microbatches} micro-batches{redo}"
        rows.append(RecipeSummary(name, o.step_time_s, max(o.split.stage_memory_bytes), True, note))
    return rows


def choose(options: Sequence[PipelineOption], stages: int | None = None) -> tuple[PipelineOption | None, str]:
    """The option to plan (None: the plain plan of the whole batch) and why, from ``search_pipeline``'s options
    (fastest first; Megatron's recipe row is not a candidate). With ``stages`` only that stage count is considered, and
    its failing to fit is an error. One stage over several micro-batches (gradient accumulation) is chosen
    when it is the fastest: the whole batch at once did not fit."""
    free = [o for o in options if o.recipe != MEGATRON and not o.estimated]
    if stages is not None:
        mine = [o for o in free if o.stages == stages]
        if not mine:
            raise InputError(
                f"no {stages}-stage configuration was planned: each stage needs at least one of the "
                "model's repeated layers (a ModuleList of identical blocks); use fewer stages"
            )
        if mine[0].split is None:
            raise InfeasibleBudget(f"{_describe(mine[0])}; try more stages, a smaller batch or more memory")
        return mine[0], f"pp={stages} fixed by the mesh: {_describe(mine[0])}"
    ok = [o for o in free if o.split is not None]
    if not ok:
        return None, "no configuration fits the memory budget: " + "; ".join(_describe(o) for o in free)
    best = ok[0]
    piped = next((o for o in ok if o.stages > 1), None)
    if best.stages == 1 and best.microbatches > 1:
        return best, f"no stages, gradient accumulation over {best.microbatches} micro-batches ({_describe(best)})"
    if best.stages == 1:
        why = f"one stage is fastest ({_describe(best)})"
        return None, why + (f"; best pipelined: {_describe(piped)}" if piped else "; no pipelined option fits")
    flat = next((o for o in free if o.stages == 1), None)
    return best, _describe(best) + (f" beats {_describe(flat)}" if flat is not None else "")


def _check_stages(cluster: ClusterProfile, stages: int, sub_shape: Sequence[int] | None) -> None:
    """A fixed stage count must be one the search plans: equal sub-meshes of whole nodes (or of one node)."""
    allowed = dict(stage_meshes(cluster))
    if stages not in allowed:
        raise InputError(
            f"a pp axis of {stages} stages does not split {cluster.name} into equal sub-meshes of whole nodes (or "
            f"one node evenly); possible stage counts: {sorted(allowed)}"
        )
    if sub_shape is not None and tuple(sub_shape) != allowed[stages]:
        want = ",".join(f"{n}={k}" for n, k in zip(mesh_names(allowed[stages]), allowed[stages]))
        raise InputError(
            f"{stages} stages on {cluster.name} plan each stage on a sub-mesh {allowed[stages]}, not "
            f"{tuple(sub_shape)}; give the mesh as pp={stages},{want}"
        )


def plan_with_pipeline(
    model: nn.Module,
    example_inputs: Sequence[Any],
    cluster: ClusterProfile,
    config: PlanConfig,
    flat: Callable[..., Plan],
    *,
    stages: int | None = None,
    sub_shape: Sequence[int] | None = None,
    axis_names: Sequence[str] | None = None,
    progress: Callable[[str, float, str], None] | None = None,
) -> Plan:
    """The pipelined plan when more than one stage wins (or ``stages`` fixes the count), else
    ``flat(solves, report)`` (the plan without stages; ``solves`` a :class:`StageSolves` whose capture it may
    take, or None; ``report``: show progress).

    ``stages`` and ``sub_shape`` (a mesh with a ``pp`` axis: its size and the other axes) fix the stage count
    and sub-mesh; ``axis_names`` names the sub-mesh axes. With ``config.solve_recipes`` (and no fixed stage
    count) the plan without stages is also made the usual way (recipes and all; ``flat(solves)`` takes the
    search's capture of the whole batch) and kept when it is at least as fast; its recipe rows join the pipelined
    plan's comparison. Options are only chosen among the configurations the search solved, not estimated ones.
    """
    if stages is not None:
        _check_stages(cluster, stages, sub_shape)
    from autoshard.pipeline.blocks import main_sequence, no_sequence_error

    found = main_sequence(model)
    if found is None:
        if stages is not None:
            raise no_sequence_error(model, f"plan it without a pp axis (here one of {stages} stages)")
        log.info(
            "pipeline: no stages: %s has no sequence of blocks (an nn.ModuleList or nn.Sequential of 2 or "
            "more) to split into stages",
            type(model).__name__,
        )
        return flat(None, True)
    if progress:
        progress("pipeline", 0.0, "")
    solves = StageSolves(model, example_inputs, config, FakeStageMeshes(cluster), found[0], strict_inputs=False)
    whole = config.solve_recipes and stages is None

    def aside(shared: StageSolves | None) -> tuple[PipelineOption | None, Plan | InfeasibleBudget | None]:
        """Megatron's recipe (the report says how the search's choice compares) and the plan without stages."""
        base: Plan | InfeasibleBudget | None = None
        if whole:
            try:
                # (no progress lines from a forked process). Under a memory budget the plan without stages runs
                # its recomputation, accumulation and recipes-alone searches (search/recipes_alone.py): the kept
                # capture serves one solve only
                base = flat(shared if config.memory_budget is None else None, shared is not None)
            except InfeasibleBudget as e:
                base = e
        recipe = None
        if config.solve_recipes:
            recipe = megatron_recipe(model, example_inputs, cluster, config, solves=shared)
        return recipe, base

    with Aside(aside, config.solve_recipes) as side:
        options = search_pipeline(
            model, example_inputs, cluster, config, stage_options=[stages] if stages else None, solves=solves
        )
        recipe, base = side.result(solves)
    if recipe is not None:
        options = sorted([*options, recipe], key=lambda o: (o.estimated, o.step_time_s, o.stages, o.recipe))
    recipes = recipe_rows(options)
    chosen, why = choose(options, stages)
    if progress:
        progress("pipeline", 1.0, why)
    if chosen is None:
        log.info("pipeline: no stages: %s", why)
        if isinstance(base, InfeasibleBudget):
            raise base
        return _with_rows(base if base is not None else flat(solves, True), recipes)
    log.info("pipeline: %s", why)
    plan = pipelined_plan(model, example_inputs, cluster, config, chosen, axis_names, solves)
    rows = [flat_summary(options)]
    if whole:
        if isinstance(base, InfeasibleBudget) or base is None:
            rows = [RecipeSummary(FLAT_NAME, math.inf, 0, False, "no plan without stages fits the memory budget")]
        else:
            if base.step_time_s <= plan.step_time_s:
                log.info(
                    "pipeline: no stages: the plan without stages (%s, recipes weighed) is as fast as %s",
                    format_seconds(base.step_time_s),
                    why,
                )
                return _with_rows(base, recipes)
            rows = [
                *base.recipes,
                RecipeSummary(
                    FLAT_NAME,
                    base.step_time_s,
                    base.peak_memory.total,
                    True,
                    "the plan of the whole cluster without stages",
                ),
            ]
    return _with_rows(plan, [r for r in rows if r is not None] + recipes)


class Aside:
    """``work(None)`` in a forked process while the caller goes on (Megatron's configurations and the plan without
    stages are solves of their own: on a second core they cost no wall time); ``result(shared)`` waits for it. Where
    no fork can be had (one core, a process group, no fork) or ``wanted`` is false, ``result`` runs
    ``work(shared)`` here, sharing the search's solves. The process is not a daemon, so that the plan without
    stages may plan its recipes alone in processes of its own (``search/recipes_alone.py``); stopped early, it
    stops those first (SIGTERM is its SystemExit)."""

    def __init__(self, work: Callable[[Any], Any], wanted: bool) -> None:
        self.work, self.proc, self.conn = work, None, None
        if wanted and _can_fork():
            ctx = multiprocessing.get_context("fork")
            self.conn, send = ctx.Pipe(duplex=False)

            def child() -> None:
                torch.set_num_threads(1)
                signal.signal(signal.SIGTERM, _exit_on_term)
                t0 = time.perf_counter()
                try:
                    out: tuple[str, Any] = ("ok", work(None))
                    log.info("pipeline: the side process took %.1f s", time.perf_counter() - t0)
                except BaseException as e:  # noqa: BLE001 (handed to the parent, which raises it)
                    out = ("error", e)
                try:
                    send.send(out)
                except Exception as e:  # an unpicklable value: its text
                    send.send(("error", RuntimeError(f"{type(out[1]).__name__}: {out[1]} ({e})")))

            self.proc = ctx.Process(target=child, daemon=False)
            self.proc.start()
            send.close()

    def __enter__(self) -> Aside:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
        if self.proc is not None:
            self.proc.join()

    def result(self, shared: Any) -> Any:
        if self.proc is None:
            return self.work(shared)
        assert self.conn is not None
        t0 = time.perf_counter()
        try:
            status, value = self.conn.recv()
            log.info("pipeline: waited %.1f s for the side process", time.perf_counter() - t0)
        except EOFError:
            raise LaunchError(
                f"the process planning Megatron's recipe and the plan without stages died "
                f"(exit code {self.proc.exitcode})"
            ) from None
        if status == "error":
            raise value
        return value


def _exit_on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # (the side process's own side processes are stopped on the way out)


def _can_fork() -> bool:
    import torch.distributed as dist

    return (
        (os.cpu_count() or 1) > 1
        and "fork" in multiprocessing.get_all_start_methods()
        and not (dist.is_available() and dist.is_initialized())
    )


def _with_rows(plan: Plan, rows: Sequence[RecipeSummary]) -> Plan:
    have = {b.name for b in plan.recipes}
    return dataclasses.replace(plan, recipes=(*plan.recipes, *(r for r in rows if r.name not in have)))


__all__ = ["choose", "flat_summary", "plan_with_pipeline", "recipe_rows"]
