"""The memory-bound rows users run (issue 45 part 3): the plan against each recipe planned alone.

    python benchmarks/plan_quality_published.py            # every row (several minutes on 2 cores)
    python benchmarks/plan_quality_published.py --rows 8b   # rows whose label contains these

Published training configurations, planned offline in bf16 mixed precision (fp32 masters, gradients and AdamW
state; bf16 parameters and activations, FSDP2's policy: ``precision_policy="params"``), the budget the device's usable
memory: torchtitan's Llama-3.1-8B rows (sequence 8192, local batch 2, FSDP, on 8, 16 and 128 H100s), MLPerf Training's
Llama-3.1-8B shape (sequence 8192, global batch 32, one node of 8), Llama-3-70B on 256 H100s (local batch 16 over dp =
32), Mixtral-8x7B on 64 and a 128K-token sequence on 64. For each: the plan's step, the fastest recipe that fits
**planned alone** (its own recomputation and gradient-accumulation searches: ``autoshard/search/recipes_alone.py``; the
plan's recipe rows are those plans), ratio = plan / that recipe, the solver's lower bound on the plan's objective (times
the micro-batches: the solver prices one; its objective counts collectives per consumer edge, so it can sit above the
plan-level step), and how plan and recipe recompute and accumulate. Goals: ratio <= 1.000 on every row; geometric mean
<= 0.90 over the rows where memory binds (the best recipe recomputes or accumulates). Predictions of the cost model, not
measurements.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import autoshard
from autoshard.errors import InfeasibleBudget
from autoshard.notation import describe


@dataclass(frozen=True)
class Row:
    label: str
    model: str
    cluster: str
    seq: int
    batch: int  # global batch (sequences)
    mesh: tuple[int, ...] | None = None  # None: nodes x devices per node


ROWS = (
    Row("torchtitan 8B, 8 GPUs (Table 1)", "llama3-8b", "h100-sxm:1x8", 8192, 16),
    Row("torchtitan 8B, 16 GPUs", "llama3-8b", "h100-sxm:2x8", 8192, 32),
    Row("torchtitan 8B, 128 GPUs (Table 3)", "llama3-8b", "h100-sxm:16x8", 8192, 256),
    Row("MLPerf Llama-3.1-8B, 8 GPUs", "llama3-8b", "h100-sxm:1x8", 8192, 32),
    # torchtitan's 2-D row (FSDP 32 x TP 8, local batch 16): it must plan in one step, no micro-batches
    Row("torchtitan 70B 2-D, 256 GPUs, local batch 16", "llama3-70b", "h100-sxm:32x8", 8192, 512),
    Row("Mixtral-8x7B, 64 GPUs", "mixtral-8x7b", "h100-sxm:8x8", 4096, 64),
    Row("Llama-3-8B, 128K tokens, 64 GPUs", "llama3-8b", "h100-sxm:8x8", 131072, 4, (4, 16)),
)


def how(recompute: str, microbatches: int) -> str:
    parts = [f"recompute {recompute}" if recompute else "", f"{microbatches} micro-batches" if microbatches > 1 else ""]
    return "; ".join(p for p in parts if p) or "-"


def run(rows: list[Row]) -> None:
    print(
        f"{'row':<36}{'plan s':>9}{'best recipe alone':>19}{'s':>9}{'ratio':>8}{'bound s':>9}{'GiB':>7}{'wall s':>8}"
        "  plan / recipe"
    )
    ratios: list[tuple[float, bool]] = []
    for r in rows:
        t0 = time.perf_counter()
        try:
            plan = autoshard.plan(
                r.model, r.mesh, cluster=r.cluster, seq=r.seq, global_batch=r.batch, mixed_precision="bf16"
            )
        except InfeasibleBudget as e:
            print(f"{r.label:<36}  no plan fits: {str(e)[:100]}", flush=True)
            continue
        wall = time.perf_counter() - t0
        best = plan.best_recipe()
        mine = how(describe(plan.recompute_layers), plan.microbatches)
        if best is None:
            print(
                f"{r.label:<36}{plan.step_time_s:>9.3f}{'none fits':>19}{'-':>9}{'-':>8}"
                f"{plan.solver.bound_s * plan.microbatches:>9.3f}{plan.peak_memory.total / 2**30:>7.1f}"
                f"{wall:>8.1f}  {mine}",
                flush=True,
            )
            continue
        ratio = plan.step_time_s / best.step_time_s
        bound = bool(best.recompute) or best.microbatches > 1
        ratios.append((ratio, bound))
        print(
            f"{r.label:<36}{plan.step_time_s:>9.3f}{best.name:>19}{best.step_time_s:>9.3f}{ratio:>8.3f}"
            f"{plan.solver.bound_s * plan.microbatches:>9.3f}{plan.peak_memory.total / 2**30:>7.1f}"
            f"{wall:>8.1f}  {mine} / "
            f"{how(best.recompute, best.microbatches)}",
            flush=True,
        )
    if ratios:
        worst = max(x for x, _ in ratios)
        bound = [x for x, b in ratios if b]
        geo = math.exp(sum(math.log(x) for x in bound) / len(bound)) if bound else math.nan
        verdict = "met" if worst <= 1 + 1e-9 else "NOT met"
        print(
            f"summary: {len(ratios)} rows; max ratio {worst:.3f} (goal <= 1.000 {verdict}); "
            f"geometric mean over {len(bound)} memory-bound rows {geo:.3f} (goal <= 0.90 "
            f"{'met' if bound and geo <= 0.90 else 'NOT met'})"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="*", default=None, help="only rows whose label contains one of these")
    a = p.parse_args(argv)
    rows = [r for r in ROWS if not a.rows or any(k.lower() in r.label.lower() for k in a.rows)]
    run(rows)


if __name__ == "__main__":
    main()
