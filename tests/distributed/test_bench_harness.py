"""The benchmark measurement harness (autoshard.testing.bench): warm-up, median/p10/p90, side-by-side variants on gloo.

No timed assertions: the statistics are checked on a fake clock, the gloo run on what ran, not how fast.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from autoshard.testing.bench import Row, Variant, quantile, run_variants, side_by_side, time_steps


class FakeClock:
    """A clock that only moves when a step says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_warmup_steps_are_not_timed() -> None:
    clock = FakeClock()
    durations = iter([100.0, 50.0, 1.0, 2.0, 3.0])  # the first two calls are slow: warm-up
    calls: list[int] = []

    def step() -> None:
        calls.append(1)
        clock.now += next(durations)

    t = time_steps(step, steps=3, warmup=2, barrier=False, clock=clock)
    assert len(calls) == 5
    assert t.samples == (1.0, 2.0, 3.0)
    assert t.median_s == 2.0
    assert t.steps == 3


def test_median_and_percentiles_on_a_fake_clock() -> None:
    clock = FakeClock()
    durations = iter([5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 10.0, 0.5])

    def step() -> None:
        clock.now += next(durations)

    t = time_steps(step, steps=10, warmup=1, barrier=False, clock=clock)  # 5.0 is the warm-up
    assert t.median_s == pytest.approx(5.0)  # sorted samples 0.5,1,2,3,4,6,7,8,9,10: (4 + 6) / 2
    assert t.p10_s == pytest.approx(0.95)
    assert t.p90_s == pytest.approx(9.1)
    assert t.p10_s <= t.median_s <= t.p90_s


def test_quantile_edges_and_errors() -> None:
    assert quantile([3.0], 0.5) == 3.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.0) == 1.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 1.0) == 4.0
    with pytest.raises(ValueError):
        quantile([], 0.5)
    with pytest.raises(ValueError):
        time_steps(lambda: None, steps=0, barrier=False)


def test_sleep_workload_median_is_plausible() -> None:
    t = time_steps(lambda: time.sleep(0.01), steps=3, warmup=1, barrier=False)
    assert t.median_s >= 0.009  # a sleep never returns early; no upper bound (shared machine)
    assert t.p10_s <= t.median_s <= t.p90_s


def test_a_failing_variant_is_recorded_and_the_next_runs() -> None:
    def bad() -> Any:
        raise RuntimeError("boom")

    rows = run_variants([("bad", bad), ("good", lambda: lambda: None)], steps=2, warmup=0, barrier=False)
    assert [r.name for r in rows] == ["bad", "good"]
    assert rows[0].timing is None and "boom" in (rows[0].error or "")
    assert rows[1].timing is not None and rows[1].timing.steps == 2 and rows[1].error is None


def test_run_variants_keeps_the_first_result_and_warms_up_once_per_step() -> None:
    calls: list[int] = []

    def build() -> Any:
        def step() -> float:
            calls.append(1)
            return float(len(calls))

        return step

    rows = run_variants([("v", build)], steps=3, warmup=2, barrier=False)
    assert len(calls) == 5  # 2 warm-up + 3 timed
    assert rows[0].extra["first"] == 1.0
    assert rows[0].timing is not None and rows[0].timing.steps == 3


def _variants(rank: int, world_size: int, arg: Any) -> list[Variant]:
    """Each variant's step all-reduces a counter, so the ranks must run the variants in step."""
    counts: dict[str, torch.Tensor] = {}

    def make(name: str, n_reduce: int) -> Variant:
        def build() -> Any:
            counts[name] = torch.zeros(())

            def step() -> None:
                for _ in range(n_reduce):
                    x = torch.ones(())
                    dist.all_reduce(x)
                    counts[name] += x

            return step

        return name, build

    return [make("one", 1), make("two", 2), make("three", 3)]


def test_side_by_side_returns_one_row_per_variant_from_rank_zero() -> None:
    rows = side_by_side(2, _variants, steps=3, warmup=1, arg=None)
    assert [r.name for r in rows] == ["one", "two", "three"]
    for r in rows:
        assert r.error is None and r.timing is not None
        assert r.timing.steps == 3
        assert r.median_s > 0.0


def _row(name: str, median: float) -> Row:
    from autoshard.testing.bench import Timing

    return Row(name, Timing(median, median, median, (median,)))


def test_runtime_table_ratios_against_best_hand_written_and_twin() -> None:
    import importlib.util
    import os
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "runtime_vs_manual.py")
    spec = importlib.util.spec_from_file_location("runtime_vs_manual", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["runtime_vs_manual"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    rows = [
        _row("autoshard", 0.03),
        _row("autoshard fsdp", 0.05),
        _row("DDP", 0.02),
        _row("FSDP2", 0.04),
        _row("FSDP2 (compiled)", 0.025),
        Row("TP", None, error="RuntimeError: no"),
    ]
    text = mod.table("t", rows)
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "best hand-written: DDP" in text
    assert "| 1.50 |" in lines["autoshard"]  # 30 ms / 20 ms
    assert "2.00 (FSDP2 (compiled))" in lines["autoshard fsdp"]  # against the faster of the twin's rows
    assert "failed" in lines["TP"]


def test_runtime_table_predicted_column_and_rank_correlation() -> None:
    import importlib.util
    import os
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "runtime_vs_manual.py")
    spec = importlib.util.spec_from_file_location("runtime_vs_manual", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["runtime_vs_manual"] = mod
    spec.loader.exec_module(mod)
    assert mod.spearman([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == pytest.approx(1.0)
    assert mod.spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert abs(mod.spearman([1.0, 2.0, 2.0, 4.0], [1.0, 3.0, 2.0, 4.0]) - 0.9486832980505138) < 1e-12  # a tie
    rows = [_row("autoshard", 0.030), _row("autoshard ddp", 0.040), _row("DDP", 0.020), _row("FSDP2", 0.050)]
    for r, pred in zip(rows, (0.033, 0.030, 0.045, 0.060)):
        r.extra["predicted_s"] = pred
    text = mod.table("t", rows)
    lines = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 33.0 | 1.10 |" in lines["autoshard"]  # predicted ms, predicted / measured
    assert "| 45.0 | 2.25 |" in lines["DDP"]
    # 2 of 4 within 20% (1.10, 1.20); measured order 20<30<40<50 vs predicted 45,33,30,60 -> rho = 0.2
    assert "2 within ±20%" in text and "Spearman rank correlation 0.20" in text


def test_interleaved_variants_are_timed_round_robin_after_all_warm_ups() -> None:
    calls: list[str] = []
    clock = FakeClock()

    def make(name: str, cost: float, fail_at: int | None = None) -> Variant:
        def build() -> Any:
            n = [0]

            def step() -> float:
                n[0] += 1
                if fail_at is not None and n[0] == fail_at:
                    raise RuntimeError("boom")
                calls.append(name)
                clock.now += cost
                return cost

            return step

        return name, build

    rows = run_variants(
        [make("a", 1.0), make("b", 3.0), make("c", 2.0, fail_at=4)],
        steps=3,
        warmup=1,
        barrier=False,
        clock=clock,
        interleave=True,
    )
    # warm-ups first (one per variant), then round-robin; c fails on its 4th call (3rd timed) and stops
    assert calls == ["a", "b", "c", "a", "b", "c", "a", "b", "c", "a", "b"]
    assert [r.name for r in rows] == ["a", "b", "c"]
    assert rows[0].timing is not None and rows[0].timing.samples == (1.0, 1.0, 1.0)
    assert rows[1].timing is not None and rows[1].median_s == 3.0 and rows[1].extra["first"] == 3.0
    assert rows[2].timing is None and "boom" in (rows[2].error or "")
