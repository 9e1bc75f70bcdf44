"""Measured autotuning (issue 14 part 2): ``compile(..., autotune=k)`` times the solver's k best distinct plans and
the recipes that fit on the real mesh, keeps the fastest, records every candidate's predicted and measured step in
the plan and its report, and caches the choice on disk so that the next run does not time again."""

from __future__ import annotations

import os

import autoshard.search.autotune as at
from autoshard.testing.launch import launch
from autoshard.plans.plan import Plan
from autoshard.plans.report import report

from numerics_utils import MODELS


def _worker(rank: int, world: int, cache: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard

    os.environ[at.CACHE_ENV] = cache
    make, inputs_fn = MODELS["mlp"]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    first = autoshard.compile(make(), mesh, inputs_fn(), backend="eager", autotune=2)
    files = os.listdir(os.path.join(cache, "autotune"))

    def no_timing(*a, **k):
        raise AssertionError("the cached choice was timed again")

    at.time_plan = no_timing
    again = autoshard.compile(make(), mesh, inputs_fn(), backend="eager", autotune=2)
    return {"first": first.plan.to_json(), "again": again.plan.to_json(), "files": files,
            "report": report(first.plan), "loss": float(again.step(*inputs_fn()))}


def test_autotune_keeps_the_fastest_measured_candidate_and_caches_it(tmp_path) -> None:
    results = launch(2, _worker, str(tmp_path))
    first, again = Plan.from_json(results[0]["first"]), Plan.from_json(results[0]["again"])
    assert Plan.from_json(results[1]["first"]) == first  # every rank runs the same choice
    # the candidates the chosen one beat; the chosen one is the solver's plan or, when it measured fastest, a recipe
    names = [r.name for r in first.recipes]
    assert {"ddp", "fsdp"} - set(names) <= {first.recipe} and len(names) == len(set(names))
    assert first.measured_s > 0 and all(r.measured_s > 0 for r in first.recipes)
    assert first.measured_peak_bytes == 0  # peaks are measured on CUDA only (time_plan)
    assert all(first.measured_s <= r.measured_s for r in first.recipes)  # the fastest, as measured
    assert len(results[0]["files"]) == 1
    assert again.stages == first.stages and again.measured_s == first.measured_s  # from the cache, not re-timed
    assert "measured" in results[0]["report"] and "autotune: the fastest of" in results[0]["report"]
    assert results[0]["loss"] > 0
