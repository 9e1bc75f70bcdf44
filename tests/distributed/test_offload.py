"""Offload (issue 13 part 5): optimizer state and masters in host memory, as a planner choice and at run time.

Planner decisions on a fake process group with a GPU profile (offloading on a CPU cluster frees nothing, so the
solver is never offered it there): no offload without a budget or under one that the device-only plans meet;
offload where only it fits. The runtime's mechanism and numerics on 2 gloo ranks (the compute device is the CPU
here, so "host" and "device" are one memory, but the master is still a distinct tensor that the optimizer steps).
"""

from __future__ import annotations

import pytest
import torch
from harness import assert_close_to_reference, single_device_reference
from numerics_utils import LR, MODELS, PARAM_ATOL
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import autoshard
from autoshard.cluster.meshes import fake_world
from autoshard.cluster.presets import get_cluster
from autoshard.compiler.parameter_forms import offloaded_params
from autoshard.config import PlanConfig
from autoshard.cost.offload import host_memory_rate, offload_cost
from autoshard.errors import InfeasibleBudget
from autoshard.models.mlp import MLP, mlp_example_inputs
from autoshard.search.recompute import plan_graph
from autoshard.testing.launch import launch

BATCH = {"inputs": {"dp": Shard(0)}}


def test_offload_cost_is_two_host_copies_and_a_host_step():
    a100 = get_cluster("a100-80gb")
    shard = 1 << 30
    c = offload_cost(shard, shard, 2, a100)
    link = a100.host_link.bandwidth
    assert c.to_host_s == pytest.approx(shard / link + a100.host_link.latency)
    assert c.to_device_s == pytest.approx(shard / link + a100.host_link.latency)
    # AdamW: reads master, gradient, two moments; writes master and moments
    assert c.host_step_s == pytest.approx(7 * shard / host_memory_rate(a100))
    assert host_memory_rate(get_cluster("cpu")) < get_cluster("cpu").device.memory_bandwidth


def _plan(budget=None, recipes=False, **kw):
    with torch.device("meta"):
        model = MLP(1024, 4096, 1024)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    config = PlanConfig(constraints=BATCH, memory_budget=budget, solve_recipes=recipes, **kw)
    # 4 A100s in 4 nodes: every collective crosses InfiniBand; the fastest plan shards both weights (moving a
    # shard of fc2's weight by all-to-all costs less than DDP's gradient all-reduce), the smallest on the device
    planned = plan_graph(model, mlp_example_inputs(512, 1024, 1024), mesh, get_cluster("a100-80gb:4x1"), config)
    plan, gm, ctx = planned.plan, planned.graph, planned.ctx
    return plan, offloaded_params(gm, ctx), ctx


def test_planner_offloads_when_and_only_when_the_budget_asks():
    with fake_world(4):
        free, off, _ = _plan()
        assert not off  # no budget: the fastest plan keeps everything on the device
        ddp, _, _ = _plan(recipe="ddp")
        sharded, off, _ = _plan(int(ddp.peak_memory.total * 0.6))
        assert not off  # a budget that sharding meets: sharded, not offloaded
        assert sharded.peak_memory.total <= sharded.memory_budget_bytes
        assert any(p != ("R",) for p in sharded.parameter_placements().values())
        budget = int(free.peak_memory.total * 0.9)
        with pytest.raises(InfeasibleBudget):  # below every device-only plan ...
            _plan(budget, offload="none")
        tight, off, ctx = _plan(budget)  # ... offloaded, and within the budget
        assert off and set(off.values()) == {"optimizer"}
        assert tight.peak_memory.total <= budget
        assert tight.step_time_s > sharded.step_time_s >= free.step_time_s
        # the offloaded state is off the device: the device's optimizer bytes are the others'
        chosen = [ctx.strategies[g.id][ctx.solution.choice[g.id]] for g in ctx.groups if g.kind == "parameter"]
        assert tight.peak_memory.optimizer == sum(s.optimizer_bytes for s in chosen if not s.offload)
        assert all(s.optimizer_bytes == 0 and s.host_bytes > 0 and s.offload_s > 0 for s in chosen if s.offload)


def test_forced_offload_modes():
    with fake_world(4):
        plan, off, ctx = _plan(offload="optimizer", recipes=True)
        assert len(off) == 4 and set(off.values()) == {"optimizer"}
        assert plan.peak_memory.optimizer == 0  # every optimizer state on the host
        # the recipes are pinned with their layouts' offloaded forms (their batch layouts as usual); tp keeps the
        # batch where the constraint placed it (split on "dp") and gathers it at its first op
        assert {r.name for r in ctx.recipes if r.solution is not None} == {"ddp", "zero1", "zero2", "fsdp", "tp"}
        params, off, ctx = _plan(offload="params")
        assert set(off.values()) == {"params"} and len(off) == 4
        # the device holds a shard of each parameter (ZeRO-3 layouts), the master and state on the host
        assert all(p[0].startswith("S(") for p in params.parameter_placements().values())
        assert params.peak_memory.parameters <= plan.peak_memory.parameters


# ------------------------------------------------------------------------------------------ runtime, 2 gloo ranks


def _train_offloaded(rank: int, world: int, arg: tuple) -> dict:
    from numerics_utils import _full, _scalar

    name, mode, fused = arg
    make, inputs_fn = MODELS[name]
    inputs = inputs_fn()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sharded = autoshard.compile(make(), mesh, inputs, offload=mode, solve_recipes=False, backend="eager")
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR, fused=fused)
    states = sharded._states
    names = states.names
    masters = dict(sharded.named_parameters())
    facts = {"offloaded": sorted(states.offloaded())}
    losses, grads = [], {}
    for step in range(3):
        before = [c.clone() for c in states.local_inputs([masters[n] for n in names])]
        loss = sharded.step(*inputs)
        copies = states.local_inputs([masters[n] for n in names])
        if step == 0:
            grads = {n: _full(p.grad) for n, p in sharded.named_parameters()}
            facts["grad_on_master_device"] = all(p.grad.device == p.device for p in masters.values())
            facts["distinct"] = all(
                c.data_ptr() != m.to_local().data_ptr() for c, m in zip(copies, (masters[n] for n in names))
            )
        opt.step()
        opt.zero_grad()
        after = states.local_inputs([masters[n] for n in names])
        # the compute copy follows the master after each step (gathered from it), not before
        facts.setdefault("refreshed", []).append(
            all(
                torch.equal(c, m.redistribute(mesh, lay).to_local()) and not torch.equal(c, b)
                for c, b, m, lay in zip(after, before, (masters[n] for n in names), states.compute)
            )
        )
        losses.append(_scalar(loss))
    facts["state_with_master"] = all(
        isinstance(t, DTensor) and t.placements == p.placements and t.to_local().device == p.to_local().device
        for p in masters.values()
        for t in opt.state[p].values()
        if torch.is_tensor(t) and t.ndim
    )
    params = {n: _full(p.data) for n, p in sharded.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "plan": sharded.plan.to_json(), **facts}


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_offloaded_training_equals_one_device_on_gloo(fused):
    """Every GPT parameter offloaded (forced): masters sharded over the 2 ranks and stepped by AdamW apart from
    the compute copies, which are gathered from them after each step; loss, gradients and parameters after 3
    steps equal the single-device run. ``fused=True`` writes the masters through a kernel that moves no version
    counter: the copies must still follow (they stayed stale before, and the model never trained)."""
    results = launch(2, _train_offloaded, ("gpt", "optimizer", fused))
    make, inputs_fn = MODELS["gpt"]
    ref = single_device_reference(make, inputs_fn(), steps=3, lr=LR)
    for got in results:
        assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
        assert got["offloaded"] and len(got["offloaded"]) == len(ref.grads)
        assert got["distinct"] and got["grad_on_master_device"] and got["state_with_master"]
        assert all(got["refreshed"])


def test_cli_offload_flag_and_progress_line(capsys):
    """``autoshard plan --offload optimizer``: every optimizer state on the host, said on the progress line, none
    on the device; the report's step includes the offload's seconds."""
    from autoshard.cli import main

    assert (
        main(
            [
                "plan",
                "--model",
                "gpt2-124m",
                "--cluster",
                "a100-80gb:1x8",
                "--global-batch",
                "8",
                "--no-recipes",
                "--offload",
                "optimizer",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    line = next(x for x in err.splitlines() if "offload    done" in x)
    assert "optimizer state of 196 of 196 parameters in host memory" in line and "pcie-gen4-x16" in line
    assert "optimizer 0.00" in out
