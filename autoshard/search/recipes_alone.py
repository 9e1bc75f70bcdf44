"""The recipes priced as they run alone, and a plan never slower than any of them.

Under a memory budget the recomputation and gradient-accumulation searches (``search/recompute.py``,
``search/accumulate.py``) shape a plan as much as its layouts do. The recipes solved alongside the plan
(``compiler/solve_recipes.py``) see only two of those forms (every activation saved, every layer recomputed), so
a recipe planned alone (``--recipe fsdp``) could recompute fewer layers, or selectively, and step faster than the
row the plan was compared with. ``plan_flat`` closes that gap for the plan of one mesh without pipeline stages:

1. the plan's own search, with the recipes solved alongside (they say which recipes apply and give the numbers of
   those that do not fit);
2. each recipe that applies and whose parameters, gradients and optimizer state fit the budget, planned alone by
   the same searches with ``PlanConfig.recipe`` set (what ``--recipe R`` runs): its row is that plan's step,
   peak, recomputation and micro-batches. (A row solved alongside that saves every activation of the whole batch
   and peaks below ``SLACK`` of the budget is already what that search returns: its first attempt, kept.)
3. the plan solved once more at the recomputation and micro-batch count of each recipe that came out faster:
   the same program with every layout free is never slower than the recipe's pinned layouts when solved to
   optimality;
4. should a recipe still be ahead (a solve stopped within the solver's gap or time limit), its program is kept
   as the plan, as ``solve`` keeps a faster recipe's layouts (``status`` says so).

So for every recipe R that fits, the plan's step is at most ``--recipe R``'s, and each row of the comparison
(CLI, report, HTML page, ``explain``) is the recipe's own best form. Without a budget the recipes alongside already
are their plans alone (one solve each, no recomputation or accumulation to search) and nothing more is run. All
searches of one call share one capture per micro-batch count (``Caches``).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoshard.cluster.profile import ClusterProfile
from autoshard.config import PlanConfig
from autoshard.errors import InfeasibleBudget, LaunchError
from autoshard.inputs import Call
from autoshard.notation import describe, format_bytes
from autoshard.plans.explain import headline
from autoshard.plans.plan import Plan, RecipeSummary
from autoshard.runtime.accumulate import Accumulation
from autoshard.search.accumulate import Caches, plan_accumulated, plan_micro
from autoshard.search.planned import Planned
from autoshard.search.recompute import SLACK

log = logging.getLogger(__name__)

Found = tuple[Planned, Accumulation | None]


def plan_flat(
    model: nn.Module,
    inputs: tuple | dict | Call,
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    real_group: bool,
    microbatches: int | None,
    weigh_next: bool = False,
    progress: Any = None,
) -> Found:
    """The plan of ``model`` on ``mesh`` (no pipeline stages) with its Accumulation, never slower than any recipe
    planned alone; its ``recipes`` priced as they run alone (see the module docstring)."""
    caches: Caches = {}
    if config.recipe is not None or not config.solve_recipes or config.memory_budget is None:
        return plan_accumulated(
            model, inputs, mesh, cluster, config, real_group, microbatches, weigh_next, progress, caches
        )
    budget = config.memory_budget

    def one(name: str) -> Found:
        return plan_accumulated(
            model,
            inputs,
            mesh,
            cluster,
            dataclasses.replace(config, recipe=name, solve_recipes=False),
            real_group,
            microbatches,
            weigh_next,
            None,
            caches,
        )

    # the recipes' searches start in side processes as soon as the whole batch's recipes are known, while the
    # plan's own search goes on; they are kept only when the plan's recipes turn out to be those (the whole batch
    # fits), else they are stopped and run again from the rows the plan ends with
    early = AloneSearches(one, parallel=not real_group and microbatches is None)
    guessed: list[bool] = []

    def known(recipes: tuple[RecipeSummary, ...]) -> None:
        if early.parallel and not guessed:
            guessed.append(True)
            early.start(_wanted(recipes, budget)[1])

    try:
        first = plan_accumulated(
            model,
            inputs,
            mesh,
            cluster,
            config,
            real_group,
            microbatches,
            weigh_next,
            progress,
            caches,
            recipes_known=known,
        )
        rows, wanted = _wanted(first[0].plan.recipes, budget)
        if guessed and early.names == wanted:  # (what each search finds does not depend on when it started)
            outcomes = early.results()
        else:
            early.close()
            outcomes = each_alone(wanted, one, parallel=not real_group)
    finally:
        early.close()
    alone: dict[str, Alone] = {}
    for name, got in outcomes.items():
        if isinstance(got, InfeasibleBudget):
            log.info("plan: recipe %s alone does not fit the budget: %s", name, got)
            rows[name] = dataclasses.replace(
                rows[name],
                fits=False,
                note=_join(
                    rows[name].note, "does not fit the budget with any recomputation or micro-batch count tried"
                ),
            )
        else:
            alone[name] = got
    best = first
    for name, got in sorted(alone.items(), key=lambda kv: kv[1].plan.step_time_s):
        if not _fits(got.plan, budget) or not _ahead(got.plan, best[0].plan):
            continue
        # the plan at the recipe's recomputation and micro-batches: its layouts include the recipe's
        again = _free_at(model, inputs, mesh, cluster, config, real_group, got.plan, caches)
        if again is not None and _fits(again[0].plan, budget) and _ahead(again[0].plan, best[0].plan):
            log.info(
                "plan: solved at recipe %s's recomputation (%s) and %d micro-batch(es): %.6f s, ahead of the "
                "first search's %.6f s",
                name,
                describe(got.plan.recompute_layers) or "none",
                got.plan.microbatches,
                again[0].plan.step_time_s,
                best[0].plan.step_time_s,
            )
            best = again
        if _ahead(got.plan, best[0].plan):
            log.info(
                "plan: recipe %s planned alone steps in %.6f s, the plan in %.6f s; keeping the recipe's program",
                name,
                got.plan.step_time_s,
                best[0].plan.step_time_s,
            )
            found = got.found if got.found is not None else one(name)  # (planned in a side process: again here)
            best = _kept(found, name, best[0].plan)
    plan = best[0].plan
    priced = []
    for name, row in rows.items():
        if name in alone:
            row = _row(name, alone[name].plan, row, plan, budget)
        elif best is not first and row.differences:  # (they were taken against the first search's plan)
            row = dataclasses.replace(row, differences=())
        priced.append(row)
    return best[0].with_plan(dataclasses.replace(plan, recipes=tuple(priced))), best[1]


@dataclasses.dataclass(frozen=True)
class Alone:
    """A recipe planned alone: its Plan (recomputation and micro-batches in it), and the Planned with its
    Accumulation when it was planned in this process (None: in a side process, which sends the Plan only)."""

    plan: Plan
    found: Found | None = None


def each_alone(
    names: list[str], one: Callable[[str], Found], parallel: bool = True
) -> dict[str, Alone | InfeasibleBudget]:
    """``one(name)`` for every name: each in a forked process of its own, as many at a time as there are cores,
    where that is allowed (``parallel``: not on a process group; fork available; not itself a daemon process),
    else one after the other here. A side process sends its Plan back, or its InfeasibleBudget's message."""
    searches = AloneSearches(one, parallel)
    try:
        searches.start(names)
        return searches.results()
    finally:
        searches.close()


def _may_fork() -> bool:
    return (
        (os.cpu_count() or 1) > 1
        and "fork" in multiprocessing.get_all_start_methods()
        and not multiprocessing.current_process().daemon
    )


class AloneSearches:
    """``one(name)`` for some names in forked processes, as many at a time as there are cores: started with
    ``start`` (the caller goes on with its own work), gathered by ``results``, stopped by ``close``. Where no
    process may be forked (``parallel`` false, one core, no fork, a daemon process) ``results`` runs them here."""

    def __init__(self, one: Callable[[str], Found], parallel: bool = True) -> None:
        self.one = one
        self.parallel = parallel and _may_fork()
        self.names: list[str] = []
        self._queue: list[str] = []
        self._running: list[tuple[str, Any, Any]] = []
        self._out: dict[str, Alone | InfeasibleBudget] = {}

    def start(self, names: list[str]) -> None:
        self.names, self._queue = list(names), list(names)
        if self.parallel:
            self._fill()

    def _fill(self) -> None:
        procs = max(1, min(len(self.names), os.cpu_count() or 1))
        while self._queue and len(self._running) < procs:
            self._fork(self._queue.pop(0))

    def _fork(self, name: str) -> None:
        ctx = multiprocessing.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        one = self.one

        def child() -> None:
            torch.set_num_threads(1)
            try:
                result: tuple[str, Any] = ("ok", one(name)[0].plan)
            except InfeasibleBudget as e:
                result = ("infeasible", (str(e), e.least_bytes))
            except BaseException as e:  # noqa: BLE001 - its text and traceback, for the parent to raise
                result = ("error", (f"{type(e).__name__}: {e}", traceback.format_exc()))
            send.send(result)

        proc = ctx.Process(target=child, daemon=True)
        proc.start()
        send.close()
        self._running.append((name, proc, recv))

    def results(self) -> dict[str, Alone | InfeasibleBudget]:
        """Each name's Alone (or the InfeasibleBudget it met), in the order given to ``start``."""
        if not self.parallel:
            for name in self._queue:
                try:
                    found = self.one(name)
                    self._out[name] = Alone(found[0].plan, found)
                except InfeasibleBudget as e:
                    self._out[name] = e
            self._queue = []
        while self._queue or self._running:
            self._fill()
            ready = multiprocessing.connection.wait([r for _, _, r in self._running])
            for name, proc, recv in [x for x in self._running if x[2] in ready]:
                self._running.remove((name, proc, recv))
                try:
                    status, value = recv.recv()
                except EOFError:
                    raise LaunchError(
                        f"the process planning recipe {name} alone died (exit code {proc.exitcode})"
                    ) from None
                proc.join()
                if status == "error":
                    raise LaunchError(f"planning recipe {name} alone failed: {value[0]}", value[1])
                self._out[name] = Alone(value) if status == "ok" else InfeasibleBudget(value[0], value[1])
        return {name: self._out[name] for name in self.names}

    def close(self) -> None:
        """Stop the side processes still running (their results are not wanted)."""
        for _, proc, _ in self._running:
            proc.terminate()
            proc.join()
        self._running, self._queue = [], []


def _wanted(recipes: tuple[RecipeSummary, ...], budget: float) -> tuple[dict[str, RecipeSummary], list[str]]:
    """The rows by name (a recipe whose state alone is over the budget marked so) and the recipes to plan alone:
    each that applies, whose state fits, and whose row is not already its plan alone (a row that saves every
    activation of the whole batch and peaks below ``SLACK`` of the budget is that search's first attempt)."""
    rows: dict[str, RecipeSummary] = {}
    wanted = []
    for row in recipes:
        rows[row.name] = row
        if not row.applies:
            continue
        if row.state_bytes > budget:
            rows[row.name] = dataclasses.replace(
                row,
                fits=False,
                note=_join(
                    row.note,
                    f"its parameters, gradients and optimizer state alone take {format_bytes(row.state_bytes)} "
                    f"per device, over the {format_bytes(budget)} budget",
                ),
            )
            continue
        if row.fits and not row.recompute and row.microbatches == 1 and row.peak_memory_bytes <= SLACK * budget:
            continue
        wanted.append(row.name)
    return rows, wanted


def _row(name: str, p: Plan, first: RecipeSummary, plan: Plan, budget: float) -> RecipeSummary:
    """A recipe's row from its plan alone (``first``: its row from the recipes solved alongside)."""
    m = p.peak_memory
    return RecipeSummary(
        name,
        p.step_time_s,
        m.total,
        _fits(p, budget),
        first.note,
        differences=headline(plan, p),
        recompute=describe(p.recompute_layers),
        microbatches=p.microbatches,
        state_bytes=m.state,
    )


def _free_at(
    model: nn.Module,
    inputs: tuple | dict | Call,
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    real_group: bool,
    recipe: Plan,
    caches: Caches,
) -> Found | None:
    """The plan solved (layouts free, no recipes alongside) at a recipe's recomputation and micro-batch count."""
    cfg = dataclasses.replace(config, recompute=tuple(recipe.recompute_layers), solve_recipes=False)
    try:
        return plan_micro(model, inputs, mesh, cluster, cfg, real_group, recipe.microbatches, None, caches)
    except InfeasibleBudget:
        return None


def _kept(found: Found, name: str, instead_of: Plan) -> Found:
    """A recipe's plan alone, made the plan: its program as solved, labelled as the solved plan that kept it."""
    planned, accumulation = found
    planned.ctx.config = dataclasses.replace(planned.ctx.config, recipe=None)
    solver = dataclasses.replace(planned.plan.solver, status=f"{instead_of.solver.status}, {name} kept")
    return planned.with_plan(dataclasses.replace(planned.plan, recipe="", solver=solver)), accumulation


def _ahead(a: Plan, b: Plan) -> bool:
    return a.step_time_s < b.step_time_s * (1 - 1e-9)


def _fits(p: Plan, budget: float) -> bool:
    return p.peak_memory.total <= budget


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


__all__ = ["plan_flat"]
