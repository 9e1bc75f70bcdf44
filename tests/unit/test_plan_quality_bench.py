"""The memory-bound section of benchmarks/plan_quality.py: its budgets and its verdict, on stub plans (no solve)."""

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import plan_quality_memory as pqm  # noqa: E402

from autoshard.plans.plan import RecipeSummary  # noqa: E402

G = pqm.GIB
CASE = pqm.MemCase("llama3-8b", "h100-sxm:8x8", (8, 8), 64)


def test_budgets_fractions_and_cap():
    assert pqm.budgets(40 * G, 80 * G) == [((0.25,), 10 * G, False), ((0.5,), 20 * G, False), ((0.75,), 30 * G, False)]
    # DDP needs more than the device: the fractions over it collapse into one capped budget
    assert pqm.budgets(200 * G, 80 * G) == [((0.25,), 50 * G, False), ((0.5, 0.75), 80 * G, True)]
    assert pqm.budgets(600 * G, 80 * G) == [((0.25, 0.5, 0.75), 80 * G, True)]


class _Plan:
    def __init__(self, step, peak, recipes):
        self.step_time_s, self.recipes = step, tuple(recipes)
        self.peak_memory = SimpleNamespace(total=peak)

    def best_recipe(self):
        ok = [b for b in self.recipes if b.applies and b.fits]
        return min(ok, key=lambda b: b.step_time_s) if ok else None


def _row(step, peak, budget, recipes, need=80 * G):
    return pqm.Row(CASE, (0.5,), budget, False, need, 1.0, plan=_Plan(step, peak, recipes))


def _verdict(rows):
    return pqm.summary(rows, 1.0)[-1]


def test_ratio_uses_the_fastest_fitting_recipe_only():
    row = _row(
        0.8,
        10 * G,
        20 * G,
        [
            RecipeSummary("tp", 0.5, 30 * G, False),
            RecipeSummary("fsdp", 1.0, 9 * G, True),
            RecipeSummary("hsdp", float("inf"), 0, False),
        ],
    )
    assert row.best().name == "fsdp" and abs(row.ratio() - 0.8) < 1e-12
    assert not row.over() and row.excludes_ddp()
    assert (
        _verdict([row]) == "verdict: goal met: the plan never loses to a fitting recipe and beats the best one "
        "by the margin asked"
    )


def test_verdict_names_each_failure():
    fits = [RecipeSummary("fsdp", 1.0, 9 * G, True)]
    slow = _row(1.1, 10 * G, 20 * G, fits)  # a fitting recipe is faster
    over = _row(0.5, 21 * G, 20 * G, fits)  # faster, but over its own budget
    verdict = _verdict([slow, over])
    assert "beats the plan" in verdict and "over its own budget on 1 rows" in verdict
    assert "below the 18% asked" not in verdict  # geometric mean sqrt(1.1 * 0.5) = 0.74
    close = _row(0.95, 10 * G, 20 * G, fits)
    assert "below the 18% asked" in _verdict([close])


def test_geomean_only_where_ddp_is_excluded_and_infeasible_rows_reported():
    fits = [RecipeSummary("fsdp", 1.0, 9 * G, True)]
    ddp_fits = _row(1.0, 10 * G, 90 * G, fits)  # budget above DDP's need: not where memory binds
    bound = _row(0.8, 10 * G, 20 * G, fits)
    bound.free_s = 0.7  # the plan without a budget: 0.7 / 1.0 is as far as any plan could go
    none = pqm.Row(CASE, (0.25,), 5 * G, False, 80 * G, 2.0, error="no plan fits", least_bytes=7 * G)
    lines = pqm.summary([ddp_fits, bound, none], 1.0)
    assert "1 with no plan (InfeasibleBudget)" in lines[0]
    assert any("0.800 over 1 budgets" in line for line in lines)
    assert any(line.startswith("bound:") and "geometric mean 0.700" in line for line in lines)
    text = pqm.format_row(none)
    assert "no plan fits in 5.0 GiB" in text and "needs is 7.0 GiB" in text and "no recipe fits either" in text
