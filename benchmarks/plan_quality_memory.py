"""The memory-bound section of ``benchmarks/plan_quality.py`` (issue 13 part 7: plans that win where memory binds).

    python benchmarks/plan_quality.py --memory-bound             # this section only (about a minute)

For each case (model, cluster, mesh, global batch x sequence length) DDP's need is measured first: the predicted
peak memory per device of the DDP recipe solved without a budget (``autoshard.recipe("ddp", ...)``). The plan is
then solved at 25%, 50% and 75% of that need, each budget capped at the device's memory (Llama-3-70B's DDP needs
far more than a device holds, so its three fractions all become the device's memory and are one row). Every
recipe (ddp, zero1, zero2, fsdp, hsdp, tp, fsdp+tp) is solved alongside the plan under the same budget, so a
recipe that fits is the best program that recipe allows within that budget.

Columns: the case; DDP's need; the budget (fractions of DDP's need, "cap": the device's memory); the plan's step
time, its peak memory and that peak as a share of the budget; for every recipe plan / recipe step time when the
recipe fits ("OOM": over the budget, "n/a": does not apply), so <= 1.00 means the plan is at least as fast; the
fastest recipe that fits and the plan's ratio to it with ok / WORSE (OVER: faster, but the plan's own peak is
above the budget; "!" after a recipe's ratio: the recipe is said to fit, but its own peak is above the budget);
the solver's status (OPT: proven optimal, else the gap); the planning time; then what the plan uses: parameters
sharded on some mesh axis out of all the captured graph's parameters (three sampled layers stand for all), per
axis, those whose gradients and optimizer state are sharded apart from them (ZeRO-1 / ZeRO-2,
``TensorLayout.zero``), and the program inputs' placements (tokens, targets).

The plan may recompute activations per layer (``autoshard/search/recompute.py``: every layer saved, every layer
recomputed in full, and the fastest mix of saved, selective and fully recomputed layers that fits); "uses" says which
layers recompute and what the replays cost. The recipes are compared as they would be planned alone (``--recipe R``):
each with its own recomputation mix and gradient-accumulation count (``autoshard/search/recipes_alone.py``). "free" is
the plan without any budget (its layouts unconstrained, nothing recomputed): no plan under a budget can be faster, so
free / best recipe bounds the ratio any plan could reach on that row.

Goal (issue 13): the plan / best fitting recipe is never above 1.00, and its geometric mean is <= 0.85 over the
rows where the budget excludes DDP. A budget no plan fits prints the smallest budget any plan needs.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import autoshard
from autoshard.cluster.presets import get_cluster
from autoshard.config import RECIPES
from autoshard.errors import InfeasibleBudget
from autoshard.models.zoo import get_model
from autoshard.notation import describe

log = logging.getLogger("plan_quality")

GIB = 2**30
FRACTIONS = (0.25, 0.50, 0.75)
GOAL_MAX = 1.00
GOAL_GEO = 0.85


@dataclass(frozen=True)
class MemCase:
    model: str
    cluster: str
    mesh: tuple[int, ...]
    batch: int
    seq: int | None = 2048  # None: the model's default sequence length


MEMORY_CASES = (
    MemCase("llama3-8b", "h100-sxm:8x8", (8, 8), 64),
    MemCase("llama3-8b", "a100-80gb:8x8", (8, 8), 64),
    MemCase("llama3-70b", "h100-sxm:16x8", (16, 8), 128),
    MemCase("llama3-70b", "a100-80gb:16x8", (16, 8), 128),
)


@dataclass
class Row:
    """One budget of one case, as solved (``plan`` None: ``error`` says why)."""

    case: MemCase
    fractions: tuple[float, ...]
    budget: int
    capped: bool
    ddp_need: int
    wall_s: float
    plan: autoshard.Plan | None = None
    error: str = ""
    least_bytes: int | None = None
    free_s: float | None = None  # the plan without a budget: a bound on any plan's step time

    def bound(self) -> float | None:
        """free / best fitting recipe: the smallest ratio any plan under this budget could reach."""
        b = self.best()
        return self.free_s / b.step_time_s if b is not None and self.free_s and b.step_time_s > 0 else None

    def best(self):
        return self.plan.best_recipe() if self.plan is not None else None

    def ratio(self) -> float | None:
        b = self.best()
        return self.plan.step_time_s / b.step_time_s if b is not None and b.step_time_s > 0 else None

    def excludes_ddp(self) -> bool:
        return self.budget < self.ddp_need

    def over(self) -> bool:
        """The plan's own peak (``Plan.peak_memory``) is above the budget it was solved under."""
        return self.plan is not None and self.plan.peak_memory.total > self.budget * (1 + 1e-6)

    def recipe_over(self) -> list[str]:
        """Recipes said to fit whose own peak is above the budget (the flag and the peak disagree)."""
        return [
            b.name
            for b in (self.plan.recipes if self.plan else ())
            if b.applies and b.fits and b.peak_memory_bytes > self.budget * (1 + 1e-6)
        ]


def budgets(ddp_need: int, device_bytes: int) -> list[tuple[tuple[float, ...], int, bool]]:
    """(fractions, budget bytes, capped) per distinct budget: each fraction of DDP's need, capped at the device."""
    out: list[tuple[tuple[float, ...], int, bool]] = []
    for f in FRACTIONS:
        want = int(ddp_need * f)
        b, capped = (device_bytes, True) if want > device_bytes else (want, False)
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0] + (f,), b, capped)
        else:
            out.append(((f,), b, capped))
    return out


def ddp_need(case: MemCase, time_limit: float) -> tuple[int, float, float]:
    """DDP's predicted peak bytes per device without a budget, its step time, and the seconds that took."""
    t0 = time.perf_counter()
    p = autoshard.recipe(
        "ddp",
        case.model,
        case.cluster,
        mesh=case.mesh,
        seq=case.seq,
        global_batch=case.batch,
        memory_budget="none",
        time_limit_s=time_limit,
    )
    return p.peak_memory.total, p.step_time_s, time.perf_counter() - t0


def free_plan(case: MemCase, time_limit: float) -> float:
    """The step time of the plan without a budget (no recipes solved): no plan under a budget is faster."""
    return autoshard.plan(
        case.model,
        case.mesh,
        cluster=case.cluster,
        seq=case.seq,
        global_batch=case.batch,
        memory_budget="none",
        time_limit_s=time_limit,
        solve_recipes=False,
    ).step_time_s


def solve_rows(case: MemCase, time_limit: float) -> list[Row]:
    need, ddp_step, t_need = ddp_need(case, time_limit)
    free = free_plan(case, time_limit)
    device = get_cluster(case.cluster).device.memory_bytes
    log.info(
        "%s %s: DDP needs %.1f GiB (%.0f ms/step), device %.1f GiB; %.1f s",
        case.model,
        case.cluster,
        need / GIB,
        ddp_step * 1e3,
        device / GIB,
        t_need,
    )
    rows = []
    for fractions, budget, capped in budgets(need, device):
        t0 = time.perf_counter()
        row = Row(case, fractions, budget, capped, need, 0.0, free_s=free)
        try:
            row.plan = autoshard.plan(
                case.model,
                case.mesh,
                cluster=case.cluster,
                seq=case.seq,
                global_batch=case.batch,
                memory_budget=budget,
                time_limit_s=time_limit,
            )
        except InfeasibleBudget as e:
            row.error, row.least_bytes = "no plan fits", e.least_bytes
        except Exception as e:  # report and go on
            log.exception("%s %s budget %d failed", case.model, case.cluster, budget)
            row.error = f"failed: {type(e).__name__}: {str(e)[:100]}"
        row.wall_s = time.perf_counter() - t0
        log.info("  budget %.1f GiB: %.1f s", budget / GIB, row.wall_s)
        rows.append(row)
    return rows


def uses(plan: autoshard.Plan) -> str:
    """What the plan does with its parameters and batch: sharded counts per axis, ZeRO state sharding, batch."""
    params: dict[str, object] = {}
    for t in (t for s in plan.stages for t in s.tensors if t.role == "parameter"):
        params.setdefault(t.name, t)
    names = plan.mesh.names
    sharded = sum(any(p.startswith("S") for p in t.placements) for t in params.values())
    per_axis = " ".join(
        f"{n} {sum(t.placements[i].startswith('S') for t in params.values())}" for i, n in enumerate(names)
    )
    z1 = sum(t.zero == "zero1" for t in params.values())
    z2 = sum(t.zero == "zero2" for t in params.values())
    try:
        inputs = " ".join(f"[{','.join(pl)}]" for pl in plan.input_placements())
    except ValueError:
        inputs = "?"
    redo = (
        f"; recompute {describe(plan.recompute_layers)} (+{plan.recompute_s * 1e3:.1f} ms)"
        if plan.recompute_layers
        else "; recompute none"
    )
    return f"sharded {sharded}/{len(params)} ({per_axis}), zero1 {z1}, zero2 {z2}; inputs {inputs}{redo}"


def _solver(plan: autoshard.Plan) -> str:
    return "OPT" if plan.solver.status == "OPTIMAL" else f"{plan.solver.status[:4]} {plan.solver.gap:.0%}"


def _cell(plan: autoshard.Plan, name: str, budget: int) -> str:
    b = next((b for b in plan.recipes if b.name == name), None)
    if b is None or not b.applies:
        return "n/a"
    over = "!" if b.peak_memory_bytes > budget * (1 + 1e-6) else ""  # "fits" by the solver, not by its own peak
    return f"{plan.step_time_s / b.step_time_s:.2f}{over}" if b.fits else "OOM"


REC_W = 8


def header() -> str:
    return (
        f"{'model':<11}{'cluster':<15}{'mesh':>6}{'batch x seq':>12}{'DDP GiB':>8}  {'budget':<16}{'plan ms':>8}"
        f"{'GiB':>7}{'used':>6}"
        + "".join(f"{r:>{REC_W}}" for r in RECIPES)
        + f"  {'best':<8}{'ratio':>6} {'goal':<6}{'free':>6} {'solver':<9}{'s':>5}  uses"
    )


def format_row(row: Row) -> str:
    c = row.case
    seq = c.seq if c.seq is not None else get_model(c.model).default_seq
    frac = "/".join(f"{f:.0%}" for f in row.fractions)
    budget = f"{frac} {'cap' if row.capped else f'{row.budget / GIB:.1f}'}"
    prefix = (
        f"{c.model:<11}{c.cluster:<15}{'x'.join(map(str, c.mesh)):>6}{f'{c.batch} x {seq}':>12}"
        f"{row.ddp_need / GIB:>8.1f}  {budget:<16}"
    )
    if row.plan is None:
        least = f", the smallest budget any plan needs is {row.least_bytes / GIB:.1f} GiB" if row.least_bytes else ""
        none = (
            "; no recipe fits either (recipes are among the plans the solver ruled out)"
            if row.error == "no plan fits"
            else ""
        )
        return f"{prefix}{row.error} in {row.budget / GIB:.1f} GiB{least}{none}; {row.wall_s:.1f} s"
    p = row.plan
    peak = p.peak_memory.total
    cells = "".join(f"{_cell(p, r, row.budget):>{REC_W}}" for r in RECIPES)
    best, ratio = row.best(), row.ratio()
    if best is None:
        tail = f"  {'none':<8}{'-':>6} {'-':<6}{'-':>6} "
    else:
        goal = "WORSE" if ratio > GOAL_MAX + 1e-9 else "OVER" if row.over() else "ok"
        free = f"{row.bound():.3f}" if row.bound() is not None else "-"
        tail = f"  {best.name:<8}{ratio:>6.3f} {goal:<6}{free:>6} "
    return (
        f"{prefix}{p.step_time_s * 1e3:>8.1f}{peak / GIB:>7.1f}{peak / row.budget:>6.0%}{cells}{tail}"
        f"{_solver(p):<9}{row.wall_s:>5.1f}  {uses(p)}"
    )


def summary(rows: list[Row], total_s: float, failed_cases: int = 0) -> list[str]:
    ratios = [r.ratio() for r in rows if r.ratio() is not None]
    bound = [r.ratio() for r in rows if r.ratio() is not None and r.excludes_ddp()]
    no_plan = sum(r.plan is None and r.error == "no plan fits" for r in rows)
    failed = sum(r.plan is None and r.error != "no plan fits" for r in rows) + failed_cases
    no_recipe = sum(r.plan is not None and r.best() is None for r in rows)
    lines = [
        f"memory-bound summary: {len(rows)} budgets, {len(ratios)} compared with the best recipe that fits"
        + "".join(
            f", {n} {w}"
            for n, w in (
                (no_plan, "with no plan (InfeasibleBudget)"),
                (no_recipe, "with a plan but no recipe that fits"),
                (failed, "failed"),
            )
            if n
        )
        + f"; {total_s:.0f} s"
    ]
    if not ratios:
        lines.append("verdict: nothing to compare (no row has both a plan and a recipe that fits)")
        return lines
    worst = max(ratios)
    over = [r for r in rows if r.over()]
    max_ok = worst <= GOAL_MAX + 1e-9
    lines.append(
        f"max plan / best fitting recipe {worst:.3f} (goal never above {GOAL_MAX:.2f}: "
        f"{'met' if max_ok else 'NOT met'})"
    )
    if over:
        lines.append(
            f"the plan's own peak (Plan.peak_memory) is over its budget on {len(over)} of {len(rows)} rows: "
            + ", ".join(f"{r.plan.peak_memory.total / r.budget - 1:+.2%}" for r in over)
            + " (the solver's memory constraint counts less than the plan's accounting)"
        )
    if mixed := sorted({n for r in rows for n in r.recipe_over()}):
        lines.append(f"recipes marked as fitting whose own peak is over the budget ('!'): {', '.join(mixed)}")
    if bound:
        geo = math.exp(sum(math.log(r) for r in bound) / len(bound))
        geo_ok = geo <= GOAL_GEO + 1e-9
        lines.append(
            f"geometric mean plan / best fitting recipe where the budget excludes DDP: {geo:.3f} over "
            f"{len(bound)} budgets (goal <= {GOAL_GEO:.2f}: {'met' if geo_ok else 'NOT met'}); "
            f"the plan is {1 / geo - 1:.1%} faster on average"
        )
        free = [r.bound() for r in rows if r.ratio() is not None and r.excludes_ddp() and r.bound() is not None]
        if len(free) == len(bound):
            lines.append(
                f"bound: the plans without a budget over the same recipes, geometric mean "
                f"{math.exp(sum(math.log(r) for r in free) / len(free)):.3f} (no plan under the budgets "
                f"can do better)"
            )
    else:
        geo_ok = False
        lines.append("geometric mean: no row where the budget excludes DDP has a plan and a fitting recipe")
    problems = [
        w
        for bad, w in (
            (not max_ok, "a fitting recipe beats the plan on some row (a solver or cost-model bug)"),
            (bool(over), f"the plan is over its own budget on {len(over)} rows, so those wins are not real"),
            (not geo_ok, f"the plan's margin over the best fitting recipe is below the {1 / GOAL_GEO - 1:.0%} asked"),
            (bool(failed), f"{failed} failed (see stderr)"),
        )
        if bad
    ]
    verdict = (
        "goal met: the plan never loses to a fitting recipe and beats the best one by the margin asked"
        if not problems
        else "goal NOT met: " + "; ".join(problems)
    )
    lines.append(f"verdict: {verdict}")
    return lines


def run(time_limit: float, only: list[str] | None = None) -> list[Row]:
    """Print the memory-bound table and its summary; returns the rows."""
    cases = [c for c in MEMORY_CASES if not only or any(k.lower() in c.model for k in only)]
    print(
        f"\nmemory-bound: the plan vs every recipe that fits budgets of 25/50/75% of DDP's need (plan / recipe step "
        f"time; <= 1.00: the plan is at least as fast); time limit {time_limit:g} s per solve"
    )
    print(header())
    rows: list[Row] = []
    failed_cases = 0
    t0 = time.perf_counter()
    for case in cases:
        try:
            case_rows = solve_rows(case, time_limit)
        except Exception as e:  # DDP's need could not be computed: say so, go on
            log.exception("memory-bound case %s %s failed", case.model, case.cluster)
            print(f"{case.model:<11}{case.cluster:<15} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            failed_cases += 1
            continue
        for row in case_rows:
            print(format_row(row), flush=True)
        rows += case_rows
    for row in rows:
        p = row.plan
        if p is not None and p.solver.objective_s > 0 and abs(p.step_time_s / p.solver.objective_s - 1) > 0.01:
            print(
                f"note: {row.case.model} {row.case.cluster} budget {row.budget / GIB:.1f} GiB: plan step "
                f"{p.step_time_s * 1e3:.1f} ms is not the solver's objective {p.solver.objective_s * 1e3:.1f} ms"
            )
    for line in summary(rows, time.perf_counter() - t0, failed_cases):
        print(line)
    return rows
