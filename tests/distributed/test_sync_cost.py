"""Issue 14's prediction model: a collective that compute waits on pays the link's measured ``sync``; bundles
(gradient buckets, per-layer gather groups) pay one latency and one sync each; and fsdp+tp's column-parallel
weights (sharded on dim 1 over dp) are gathered and reduce-scattered per layer like FSDP's dim-0 shards."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

import autoshard
from autoshard.buckets import gather_axes, scatter_axes
from autoshard.cluster.meshes import fake_world
from autoshard.cluster.presets import get_cluster
from autoshard.cluster.profile import ClusterProfile, Link
from autoshard.compiler.lower import _gather_groups, collective_counts, trace_rank_program
from autoshard.config import PlanConfig
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.search.recompute import plan_graph

CFG = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, seq_len=16)


def _with_sync(sync: float) -> ClusterProfile:
    c = get_cluster("cpu")
    return dataclasses.replace(
        c,
        name=f"cpu-sync-{sync}",
        intra_node=dataclasses.replace(c.intra_node, sync=sync),
        inter_node=dataclasses.replace(c.inter_node, sync=sync),
    )


def test_link_sync_round_trips_through_json_and_must_not_be_negative() -> None:
    c = _with_sync(7e-4)
    assert ClusterProfile.from_dict(c.to_dict()) == c and c.intra_node.sync == 7e-4
    assert get_cluster("h100-sxm").intra_node.sync == 0.0  # published profiles: no sync
    with pytest.raises(ValueError, match="sync"):
        Link("x", 1e9, 1e-6, "test", sync=-1.0)


def _plan(recipe: str, cluster: ClusterProfile, shape: tuple[int, ...] = (2,)) -> autoshard.Plan:
    names = ("dp",) if len(shape) == 1 else ("dp", "tp")
    torch.manual_seed(0)
    with fake_world(int(torch.tensor(shape).prod())):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        return autoshard.plan(
            GPT(CFG), mesh, gpt_example_inputs(CFG, 4), recipe=recipe, cluster=cluster, solve_recipes=False
        )


def test_a_ddp_step_waits_three_times_the_two_loss_all_reduces_and_its_bucket() -> None:
    sync = 1e-3
    base, slow = _plan("ddp", _with_sync(0.0)), _plan("ddp", _with_sync(sync))
    assert [(c.kind, c.tensor, c.consumer) for c in slow.stages[0].collectives] == [
        (c.kind, c.tensor, c.consumer) for c in base.stages[0].collectives
    ]
    paid = [s.time_s - b.time_s for s, b in zip(slow.stages[0].collectives, base.stages[0].collectives)]
    waited = [c for c, d in zip(slow.stages[0].collectives, paid) if d > 0]
    assert all(d == pytest.approx(sync) for d in paid if d > 0)
    assert sorted((c.phase, c.tensor.startswith("bucket of")) for c in waited) == [
        ("backward", True),
        ("forward", False),
        ("forward", False),
    ]
    # the solver's objective and the plan's step see it alike (here: nothing hidden changes)
    assert slow.step_time_s - base.step_time_s == pytest.approx(3 * sync, rel=0.35)


def test_a_large_sync_steers_the_solver_away_from_activation_collectives() -> None:
    """On gloo with shared cores each tensor-parallel all-reduce costs a sync; the solver must see that."""

    def activation_waits(plan: autoshard.Plan) -> int:
        params = {t.name for t in plan.stages[0].tensors if t.role == "parameter"}
        return sum(
            1
            for c in plan.stages[0].collectives
            if c.phase == "forward"
            and c.consumer != "output"
            and c.consumer not in params
            and not c.tensor.startswith(("bucket", "group"))
        )

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        free = autoshard.plan(GPT(CFG), mesh, gpt_example_inputs(CFG, 8), cluster=_with_sync(0.0), solve_recipes=False)
        costly = autoshard.plan(
            GPT(CFG), mesh, gpt_example_inputs(CFG, 8), cluster=_with_sync(5e-3), solve_recipes=False
        )
    assert activation_waits(costly) < activation_waits(free) or activation_waits(costly) == 0
    assert activation_waits(costly) <= 2


def test_fsdp_plan_prices_one_latency_per_gather_group_and_bucket_as_the_program_runs_them() -> None:
    torch.manual_seed(0)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        planned = plan_graph(GPT(CFG), gpt_example_inputs(CFG, 8), mesh, get_cluster("cpu"), PlanConfig(recipe="fsdp"))
        plan, gm, ctx = planned.plan, planned.graph, planned.ctx
        counts = collective_counts(trace_rank_program(gm, ctx))
    stats = plan.stages[0].collectives
    groups = [c for c in stats if c.tensor.startswith("group of")]
    buckets = [c for c in stats if c.tensor.startswith("bucket of") and c.kind == "reduce_scatter"]
    assert len(groups) == counts["all_gather_into_tensor"]  # 6: (2 blocks + the root) x (forward, backward)
    assert len(buckets) == counts["reduce_scatter_tensor"]
    assert sum(int(c.tensor.split()[2]) for c in groups) == sum(
        1 for c in stats if c.kind == "all_gather" and not c.tensor.startswith("group of")
    )


def test_dim1_shards_count_as_gathers_and_scatters_of_one_dim() -> None:
    assert gather_axes((Shard(1), Shard(0)), (Replicate(), Shard(0)), (64, 64), (2, 2)) == (0,)
    assert gather_axes((Shard(1), Shard(1)), (Replicate(), Shard(1)), (64, 64), (2, 2)) is None  # nested
    assert gather_axes((Shard(1), Shard(0)), (Replicate(), Replicate()), (64, 64), (2, 2)) is None  # two dims
    assert scatter_axes((Partial(), Shard(0)), (Shard(1), Shard(0)), (64, 64), (2, 2)) == (0,)
    assert scatter_axes((Partial(), Shard(0)), (Shard(1), Shard(0)), (64, 63), (2, 2)) is None  # uneven


def test_fsdp_tp_gathers_each_layers_weights_together_whatever_dim_fsdp_shards() -> None:
    torch.manual_seed(0)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        planned = plan_graph(
            GPT(CFG), gpt_example_inputs(CFG, 8), mesh, get_cluster("cpu"), PlanConfig(recipe="fsdp+tp")
        )
        plan, gm, ctx = planned.plan, planned.graph, planned.ctx
        groups, uses = _gather_groups(list(gm.graph.nodes), (2, 2))
        grouped = collective_counts(trace_rank_program(gm, ctx))
        apart = collective_counts(trace_rank_program(gm, ctx, group_gathers=False))
    role = {n.name: n.meta["autoshard_role"].name for n in gm.graph.find_nodes(op="placeholder")}
    dim1 = {t.name for t in plan.stages[0].tensors if t.role == "parameter" and t.placements[:1] == ("S(1)",)}
    assert len(dim1) >= 4 and dim1 <= {role[m[0]] for ms in groups.values() for m in ms}  # column-parallel: grouped
    assert sorted({(g[0], g[1]) for g in groups if g[1] != ("", -1)}) == sorted(
        (ph, ("layers", i)) for ph in ("forward", "backward") for i in range(2)
    )
    assert apart["all_gather_into_tensor"] - grouped["all_gather_into_tensor"] == len(uses) - len(groups)


def _flat_worker(rank: int, world: int, _: object) -> dict:
    from torch.distributed.tensor import DTensor, distribute_tensor

    from autoshard import _torch_compat as tc
    from autoshard.buckets import gather_all
    from autoshard.compiler.lower_buckets import scatter_together

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = torch.randn(8, 12)
    out = {}
    for name, have in (("rows", (Shard(0), Shard(0))), ("cols", (Shard(1), Shard(1)))):
        d = distribute_tensor(full, mesh, have)
        out[name] = tc.waited(tc.redistribute(d, mesh, (Replicate(), Replicate())).to_local())
    # fsdp+tp's column-parallel weight (dim 1 over dp, dim 0 over tp) gathered over dp with a dim-0 member
    w, v = (
        distribute_tensor(full, mesh, (Shard(1), Shard(0))),
        distribute_tensor(full[:, :4], mesh, (Shard(0), Replicate())),
    )
    a, b = gather_all(mesh, (0,), [w, v])
    out["gather_dim1"] = (a.placements, tc.waited(a.full_tensor()), b.placements, tc.waited(b.full_tensor()))
    # its gradient reduce-scattered over dp along dim 1: rank-dependent Partial pieces summed, then cut
    g = torch.full((4, 12), float(rank)) + full[:4]
    part = DTensor.from_local(g, mesh, (Partial(), Shard(0)), run_check=False)
    mine = tc.waited(scatter_together(mesh, (0,), [part], dim=1)[0])
    ref = part.redistribute(mesh, (Shard(1), Shard(0))).to_local()
    out["scatter_dim1"] = (mine, ref)
    # DDP's bucket over dp of gradients that stay dim-1 sharded on tp (row-parallel weights): one flat all-reduce
    from autoshard.compiler.lower_buckets import reduce_together

    grads = [
        DTensor.from_local(
            torch.full((4, 3), float(rank)) + full[:4, :3] * k, mesh, (Partial(), Shard(1)), run_check=False
        )
        for k in (1, 2)
    ]
    got = [tc.waited(t) for t in reduce_together(mesh, grads, (Partial(), Shard(1)), (Replicate(), Shard(1)))]
    out["bucket_dim1"] = (got, [g.redistribute(mesh, (Replicate(), Shard(1))).to_local() for g in grads])
    return out


def test_flattened_and_dim1_bundled_collectives_give_dtensors_values() -> None:
    from autoshard.testing.launch import launch

    torch.manual_seed(0)
    full = torch.randn(8, 12)
    for r in launch(4, _flat_worker):
        assert torch.equal(r["rows"], full) and torch.equal(r["cols"], full)
        pa, a, pb, b = r["gather_dim1"]
        assert tuple(pa) == (Replicate(), Shard(0)) and torch.equal(a, full)
        assert tuple(pb) == (Replicate(), Replicate()) and torch.equal(b, full[:, :4])
        mine, ref = r["scatter_dim1"]
        assert mine.shape == ref.shape and torch.allclose(mine, ref)
        got, want = r["bucket_dim1"]
        assert all(a.shape == b.shape and torch.allclose(a, b) for a, b in zip(got, want))
