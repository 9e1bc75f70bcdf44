"""Measured autotuning (issue 14 part 2): ``compile(..., autotune=k)`` times the solver's k best distinct plans and
the recipes that fit on the real mesh, keeps the fastest, records every candidate's predicted and measured step in
the plan and its report, and caches the choice on disk so that the next run does not time again."""

from __future__ import annotations

import os

from numerics_utils import MODELS

import autoshard.search.autotune as at
from autoshard.cluster.machine import CACHE_ENV
from autoshard.plans.plan import Plan
from autoshard.plans.report import report
from autoshard.testing.launch import launch


def _worker(rank: int, world: int, cache: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard

    os.environ[CACHE_ENV] = cache
    make, inputs_fn = MODELS["mlp"]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    first = autoshard.compile(make(), mesh, inputs_fn(), backend="eager", autotune=2)
    files = os.listdir(os.path.join(cache, "autotune"))

    def no_timing(*a, **k):
        raise AssertionError("the cached choice was timed again")

    at.time_plan = no_timing
    again = autoshard.compile(make(), mesh, inputs_fn(), backend="eager", autotune=2)
    return {
        "first": first.plan.to_json(),
        "again": again.plan.to_json(),
        "files": files,
        "report": report(first.plan),
        "loss": float(again.step(*inputs_fn())),
    }


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


def _stock_gpt2_candidates(k: int) -> tuple[list, object]:
    """The issue-32 case: a stock HF GPT-2 (4 layers, d 256) planned for 2 ranks (fake process group) and its
    autotune candidates (the solver's k best distinct plans and the recipes that fit), each built as a Plan."""
    import torch
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.cluster.meshes import fake_world
    from autoshard.cluster.presets import get_cluster
    from autoshard.config import PlanConfig
    from autoshard.search.recompute import plan_graph

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4))
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        planned = plan_graph(model, {"input_ids": ids, "labels": ids}, mesh, get_cluster("cpu"), PlanConfig())
        return at.candidates(planned.graph, planned.ctx, planned.plan, k), planned


def test_autotune_candidates_of_a_stock_gpt2_all_build() -> None:
    """Issue 32 part 4: ``autotune=3`` on a stock GPT-2 on 2 ranks died building a next-best plan ("cannot
    redistribute [S(0)] -> [P]"). Every candidate of the 4 best now builds, and they are distinct plans."""
    found, planned = _stock_gpt2_candidates(4)
    names = [n for n, _ in found]
    assert names[:4] == ["autoshard", "autoshard #2", "autoshard #3", "autoshard #4"], names
    assert {"ddp", "fsdp"} <= set(names) and len(names) == len(set(names))
    faces = {tuple(sorted(p.parameter_placements().items())) for _, p in found}
    assert len(faces) >= 2  # the next-best plans differ in their parameters' layouts
    assert all(p.step_time_s > 0 for _, p in found)
    assert found[0][1].step_time_s == planned.plan.step_time_s


def test_autotune_drops_a_candidate_whose_plan_cannot_be_made(monkeypatch, caplog) -> None:
    """A candidate whose plan cannot be built is dropped with a warning naming it; the others are still timed."""
    from autoshard.errors import InputError

    real = at.build_plan

    def broken(gm, ctx, sol, recipe=""):
        if recipe == "fsdp":
            raise InputError("cannot redistribute [S(0)] -> [P] on mesh 2: (made up for this test)")
        return real(gm, ctx, sol, recipe=recipe)

    monkeypatch.setattr(at, "build_plan", broken)
    with caplog.at_level("WARNING", logger="autoshard.search.autotune"):
        found, _ = _stock_gpt2_candidates(2)
    names = [n for n, _ in found]
    assert "fsdp" not in names and {"autoshard", "autoshard #2", "ddp"} <= set(names)
    assert any("candidate fsdp dropped" in r.getMessage() and "[S(0)] -> [P]" in r.getMessage() for r in caplog.records)
