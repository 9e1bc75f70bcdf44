"""``compile(..., autotune=k)``: candidates timed on the real mesh, the fastest kept, the choice cached on disk.

The cost model ranks plans; the clock decides. The candidates are the solved plan, the solver's next ``k - 1``
best plans whose parameter or input layouts differ from every earlier one (``IntraOpProblem.solve(exclude=...)``:
plans that differ only inside the program would time alike), and every manual recipe that fits the budget
(duplicates of an earlier candidate dropped). Each is compiled from a copy of the model as a saved plan
(``compile(..., plan=candidate)``: no solve) and trained for ``WARMUP`` + ``STEPS`` steps (forward, backward and an
AdamW step with lr 0, so the state it allocates is real and the weights do not move) on the same global batch, a
barrier before each timed step; its time is the median, the slowest rank's. The fastest candidate is compiled on
the user's model and returned: with autotuning on, the plan is never slower than a recipe that fits, as measured.

The returned plan records every candidate: its own ``measured_s``, and the others in ``plan.recipes`` with their
predicted and measured times (the report's "vs manual recipes" table gains a measured column). The winner is
cached under a key of the plan's fingerprint (program, input shapes, mesh, cluster, precision, torch and autoshard
versions), ``k``, the backend and the budget, in ``$AUTOSHARD_CACHE/autotune`` (default ``~/.cache/autoshard``:
``cluster/machine.py``); the next run with the same key compiles the cached plan without timing. On a process
group rank 0 reads and writes the cache and sends its choice to the others.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from autoshard.cluster.machine import cache_dir
from autoshard.compiler.context import PassContext
from autoshard.compiler.solve import annotate
from autoshard.compiler.solve_memory import solve_within
from autoshard.errors import InfeasibleBudget, InputError, SolverTimeout
from autoshard.messages import warn
from autoshard.plans.plan import Plan, RecipeSummary
from autoshard.search.planned import Planned, build_plan
from autoshard.solver.intra_op import Solution

log = logging.getLogger(__name__)

WARMUP, STEPS = 2, 5


def cache_file(plan: Plan, k: int, backend: str) -> Path:
    """Where the choice for ``plan``'s program (its fingerprint), ``k``, ``backend`` and budget is kept."""
    root = cache_dir() / "autotune"
    key = json.dumps([list(map(list, plan.fingerprint)), k, backend, plan.memory_budget_bytes])
    return root / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _face(ctx: PassContext, sol: Solution) -> dict[int, int]:
    """The choice of the parameter and input groups: what makes two plans distinct for timing."""
    canon = ctx.layer_of_group or {}
    return {
        g.id: sol.choice[g.id] for g in ctx.groups if g.kind in ("parameter", "input") and canon.get(g.id, g.id) == g.id
    }


def candidates(gm: fx.GraphModule, ctx: PassContext, plan: Plan, k: int) -> list[tuple[str, Plan]]:
    """The plans to time (see the module docstring), named "autoshard", "autoshard #2", ..., or the recipe's name."""
    out = [("autoshard", plan)]
    seen = [_face(ctx, ctx.solution)]
    for i in range(2, k + 1):
        try:
            sol = solve_within(
                gm,
                ctx,
                ctx.config.memory_budget,
                time_limit_s=ctx.config.time_limit_s,
                num_workers=ctx.config.num_workers,
                seed=ctx.config.seed,
                what=f"plan #{i}",
                exclude=seen,
            )
        except (InfeasibleBudget, SolverTimeout, ValueError) as e:
            log.info("autotune: no plan #%d (%s)", i, e)
            break
        seen.append(_face(ctx, sol))
        _add(out, f"autoshard #{i}", gm, ctx, sol)
    for r in ctx.recipes:
        if r.solution is None or not r.fits or _face(ctx, r.solution) in seen:
            continue
        seen.append(_face(ctx, r.solution))
        _add(out, r.name, gm, ctx, r.solution, recipe=r.name)
    annotate(gm, ctx)  # the graph carries the solved plan again
    return out


def _add(
    out: list[tuple[str, Plan]], name: str, gm: fx.GraphModule, ctx: PassContext, sol: Solution, recipe: str = ""
) -> None:
    """``sol``'s plan appended to ``out`` as candidate ``name``; a candidate whose plan cannot be made (a move no
    collective makes: the integer program forbids those, so this is a bug to report) is dropped with a warning
    naming it and the move, and the others are timed."""
    annotate(gm, ctx, sol)
    try:
        out.append((name, build_plan(gm, ctx, sol, recipe=recipe)))
    except InputError as e:
        warn(
            log,
            "autotune: candidate %s dropped, its plan cannot be made (%s); please report this model",
            name,
            str(e)[:300],
        )


def _call(sharded: Any, inputs: Any) -> torch.Tensor:
    if isinstance(inputs, dict):
        return sharded.step(**inputs)
    if hasattr(inputs, "kwargs") and hasattr(inputs, "args"):
        return sharded.step(*inputs.args, **inputs.kwargs)
    return sharded.step(*inputs)


def time_plan(build: Callable[[], Any], inputs: Any, real_group: bool) -> tuple[float, int]:
    """Median seconds per training step of ``build()``'s module (the slowest rank's on a process group), and on
    CUDA the peak device bytes from building it to the last step, above what was allocated before (the largest
    rank's; 0 elsewhere: CPU peaks need the profiler, ``autoshard/testing/memory_probe.py``)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    sharded = build()
    opt = torch.optim.AdamW(sharded.parameters(), lr=0.0, foreach=True)
    times = []
    for i in range(WARMUP + STEPS):
        if real_group:
            dist.barrier()
        t0 = time.perf_counter()
        _call(sharded, inputs)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    worst = torch.tensor([statistics.median(times), float(peak)], dtype=torch.float64)
    if real_group:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst[0]), int(worst[1])


def _from_rank0(real_group: bool, value: Any) -> Any:
    if not real_group:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def autotune(
    model: torch.nn.Module,
    inputs: Any,
    k: int,
    backend: str,
    real_group: bool,
    plan_graph: Callable[[], Planned],
    compile_plan: Callable[[torch.nn.Module, Plan], Any],
) -> Any:
    """The module of the fastest candidate, compiled on ``model`` (see the module docstring). ``plan_graph()``
    plans the program; ``compile_plan(module, plan)`` compiles a saved plan on a module."""
    if k < 1:
        raise InputError(f"autotune={k}: give the number of solved plans to time (>= 1), or 0 / None for none")
    planned = plan_graph()
    plan, gm, ctx = planned.plan, planned.graph, planned.ctx
    path = cache_file(plan, k, backend)
    cached = None
    if not real_group or dist.get_rank() == 0:
        cached = path.read_text() if path.exists() else None
    cached = _from_rank0(real_group, cached)
    if cached is not None:
        log.info("autotune: the choice for this program is cached (%s); not timing again", path)
        saved = Plan.from_json(cached)
        return _with_trials(compile_plan(model, saved), saved)
    pristine = copy.deepcopy(model)  # each candidate is compiled on a copy: compiling replaces the parameters
    t0 = time.perf_counter()
    trials = []
    # rank 0's candidates on every rank (the next-best solves are not broadcast by the solve pass)
    found = candidates(gm, ctx, plan, k) if not real_group or dist.get_rank() == 0 else None
    found = [(n, Plan.from_json(p)) for n, p in _from_rank0(real_group, found and [(n, c.to_json()) for n, c in found])]
    for name, cand in found:
        measured, peak = time_plan(lambda c=cand: compile_plan(copy.deepcopy(pristine), c), inputs, real_group)
        log.info("autotune: %s predicted %.3f ms, measured %.3f ms", name, cand.step_time_s * 1e3, measured * 1e3)
        trials.append((name, cand, measured, peak))
    name, best, measured, peak = min(trials, key=lambda t: t[2])
    others = {b.name: b for b in best.recipes or plan.recipes}
    summary = tuple(
        dataclasses.replace(others[n], measured_s=m, measured_peak_bytes=pk)
        if n in others
        else RecipeSummary(n, c.step_time_s, c.peak_memory.total, True, "autotune candidate", m, measured_peak_bytes=pk)
        for n, c, m, pk in trials
        if n != name
    )
    chosen = dataclasses.replace(best, recipes=summary, measured_s=measured, measured_peak_bytes=peak)
    log.info(
        "autotune: %s is the fastest of %d candidates (%.3f ms per step measured); %.1f s of autotuning",
        name,
        len(trials),
        measured * 1e3,
        time.perf_counter() - t0,
    )
    if not real_group or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(chosen.to_json())
    return _with_trials(compile_plan(model, chosen), chosen)


def _with_trials(sharded: Any, chosen: Plan) -> Any:
    """The compiled module's plan (rebuilt from ``chosen``'s choices) with ``chosen``'s measurements."""
    sharded.plan = dataclasses.replace(
        sharded.plan,
        recipes=chosen.recipes,
        measured_s=chosen.measured_s,
        recipe=chosen.recipe,
        measured_peak_bytes=chosen.measured_peak_bytes,
    )
    return sharded


__all__ = ["autotune", "cache_file", "candidates", "time_plan"]
