"""Layer 1: each pass on small graphs, no process group beyond a fake one."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autoshard.cluster.meshes import fake_world
from autoshard.cluster.presets import get_cluster
from autoshard.compiler.capture import capture
from autoshard.compiler.coarsen import coarsen
from autoshard.compiler.context import PassContext
from autoshard.compiler.share_layers import share_layers
from autoshard.compiler.solve import solve
from autoshard.compiler.strategies import strategies
from autoshard.config import PlanConfig
from autoshard.errors import InfeasibleBudget


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, h)
        self.proj = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(x)))


class Stack(nn.Module):
    def __init__(self, widths: list[int], d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(d, h) for h in widths])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return nn.functional.mse_loss(x, y)


@pytest.fixture()
def ctx():
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        yield PassContext(mesh=mesh, cluster=get_cluster("cpu"), config=PlanConfig())


def _inputs(b: int = 4, d: int = 8):
    return torch.randn(b, d), torch.randn(b, d)


def test_capture_roles_phases_modules(ctx):
    gm = capture(Stack([16, 16]), _inputs(), ctx)
    roles = [n.meta["autoshard_role"] for n in gm.graph.find_nodes(op="placeholder")]
    assert [r.kind for r in roles].count("parameter") == 8
    assert [r.kind for r in roles].count("input") == 2
    assert roles[-1].kind == "tangent"
    assert roles[0].name == "layers.0.fc.weight"
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    phases = {n.meta["autoshard_phase"] for n in calls}
    assert phases == {"forward", "backward"}
    mm_modules = {n.meta["autoshard_module"] for n in calls if n.target == torch.ops.aten.mm.default}
    assert "layers.1.proj" in mm_modules and "layers.0.fc" in mm_modules  # backward matmuls keep their module
    assert [r.kind for r in ctx.output_roles].count("grad") == 8 and ctx.output_roles[0].kind == "loss"


def test_capture_meta_model_keeps_backward(ctx):
    with torch.device("meta"):
        model = Stack([16])
    gm = capture(model, _inputs(), ctx)
    assert any(n.meta.get("autoshard_phase") == "backward" for n in gm.graph.nodes if n.op == "call_function")
    assert [r.kind for r in ctx.output_roles].count("grad") == 4


def test_capture_rejects_non_scalar_output(ctx):
    class NoLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, y):
            return self.fc(x)

    with pytest.raises(ValueError, match="scalar loss"):
        capture(NoLoss(), _inputs(), ctx)


def test_coarsen_followers_join_producers(ctx):
    gm = coarsen(capture(Stack([16]), _inputs(), ctx), ctx)
    nodes = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function")]
    assert len(ctx.groups) < 0.6 * len(nodes)  # 7 placeholders are groups of their own
    by_name = {n.name: n for n in nodes}
    for g in ctx.groups:
        anchor = by_name[g.anchor]
        assert anchor.op == "placeholder" or anchor.target not in (torch.ops.aten.relu.default, operator.getitem)
        for m in g.members[1:]:
            assert by_name[m].meta["autoshard_group"] == g.id
    relu = next(n for n in nodes if n.target == torch.ops.aten.relu.default)
    producer_group = next(g for g in ctx.groups if relu.name in g.members)
    assert by_name[producer_group.anchor].target == torch.ops.aten.addmm.default


def test_share_layers_identical_and_different(ctx):
    share_layers(coarsen(capture(Stack([16, 16, 16, 16]), _inputs(), ctx), ctx), ctx)
    # layer 0 differs (its input needs no gradient), the last one too (its output gradient comes from the
    # loss, not a residual sum): layers 1 and 2 share
    assert ctx.stats["shared_layers"] == 1
    canon = ctx.layer_of_group
    assert sum(1 for g, c in canon.items() if g != c) > 0
    ctx2 = PassContext(mesh=ctx.mesh, cluster=ctx.cluster, config=PlanConfig())
    share_layers(coarsen(capture(Stack([16, 32]), _inputs(), ctx2), ctx2), ctx2)
    assert ctx2.stats["shared_layers"] == 0


def test_strategies_placeholders_and_ops(ctx):
    gm = strategies(share_layers(coarsen(capture(Stack([16]), _inputs(), ctx), ctx), ctx), ctx)
    nodes = {n.name: n for n in gm.graph.nodes}
    for g in ctx.groups:
        assert ctx.strategies[g.id], g
    w = next(
        g
        for g in ctx.groups
        if g.kind == "parameter" and nodes[g.anchor].meta["autoshard_role"].name == "layers.0.fc.weight"
    )
    layouts = {s.outputs[0][0] for s in ctx.strategies[w.id]}
    assert layouts == {(Replicate(),), (Shard(0),), (Shard(1),)}  # [16, 8] on dp=2: every even layout
    tangent = next(g for g in ctx.groups if g.kind == "tangent")
    assert [s.outputs[0][0] for s in ctx.strategies[tangent.id]] == [(Replicate(),)]
    mm = next(g for g in ctx.groups if nodes[g.anchor].target == torch.ops.aten.addmm.default)
    assert len(ctx.strategies[mm.id]) >= 3
    # on a matmul big enough to leave the kernel-overhead floor, sharding cuts the per-device compute
    c = PassContext(mesh=ctx.mesh, cluster=ctx.cluster, config=PlanConfig())
    gm = strategies(
        share_layers(coarsen(capture(Stack([1024], d=512), (torch.randn(512, 512), torch.randn(512, 512)), c), c), c), c
    )
    nodes = {n.name: n for n in gm.graph.nodes}
    big = next(g for g in c.groups if nodes[g.anchor].target == torch.ops.aten.addmm.default)
    times = sorted(s.compute_s for s in c.strategies[big.id])
    assert times[0] < 0.75 * times[-1]


def test_constraints_pin_inputs(ctx):
    cfg = PlanConfig(constraints={"inputs": {"dp": Shard(0)}})
    c = PassContext(mesh=ctx.mesh, cluster=ctx.cluster, config=cfg)
    gm = solve(strategies(share_layers(coarsen(capture(Stack([16]), _inputs(), c), c), c), c), c)
    for n in gm.graph.find_nodes(op="placeholder"):
        if n.meta["autoshard_role"].kind == "input":
            assert n.meta["autoshard"].outputs[0] == (Shard(0),)


def test_solve_is_deterministic_and_annotates(ctx):
    gm = solve(strategies(share_layers(coarsen(capture(Stack([16, 16]), _inputs(), ctx), ctx), ctx), ctx), ctx)
    first = dict(ctx.solution.choice)
    assert ctx.solution.status == "OPTIMAL"
    assert all("autoshard" in n.meta for n in gm.graph.nodes if n.op in ("placeholder", "call_function"))
    c2 = PassContext(mesh=ctx.mesh, cluster=ctx.cluster, config=PlanConfig())
    solve(strategies(share_layers(coarsen(capture(Stack([16, 16]), _inputs(), c2), c2), c2), c2), c2)
    assert c2.solution.choice == first


def test_budget_below_minimum_names_the_minimum(ctx):
    c = PassContext(mesh=ctx.mesh, cluster=ctx.cluster, config=PlanConfig(memory_budget="1KiB"))
    gm = strategies(share_layers(coarsen(capture(Stack([16]), _inputs(), c), c), c), c)
    with pytest.raises(InfeasibleBudget, match="smallest is"):
        solve(gm, c)


def test_a_time_out_is_not_an_out_of_memory_verdict(ctx):
    """A solve stopped by its time limit before any plan is a SolverTimeout (raise time_limit_s), never an
    InfeasibleBudget (which says no plan fits)."""
    from autoshard.errors import SolverTimeout

    c = PassContext(mesh=ctx.mesh, cluster=ctx.cluster, config=PlanConfig(time_limit_s=1e-9, solve_recipes=False))
    gm = strategies(share_layers(coarsen(capture(Stack([16, 16, 16]), _inputs(), c), c), c), c)
    with pytest.raises(SolverTimeout, match="time_limit_s") as e:
        solve(gm, c)
    assert not isinstance(e.value, InfeasibleBudget)


def test_the_runner_owns_one_ordered_list_and_checks_disable_passes() -> None:
    from autoshard.compiler.runner import PASS_NAMES, run_passes

    assert PASS_NAMES == (
        "capture",
        "coarsen",
        "share_layers",
        "strategies",
        "solve",
        "lower",
        "partition",
        "overlap",
        "compile",
    )
    model = Stack([16, 16, 16, 16])
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))

        def run(*disabled: str, last: str = "compile") -> PassContext:
            c = PassContext(
                mesh=mesh,
                cluster=get_cluster("cpu"),
                config=PlanConfig(disable_passes=disabled),
                example_inputs=_inputs(),
                backend="eager",
            )
            run_passes(model, c, "capture", last)
            return c

        with pytest.raises(ValueError, match="'fuse' is not a pass.*coarsen"):
            run("fuse")
        with pytest.raises(ValueError, match="the solve pass cannot be disabled"):
            run("solve")
        full = run()
        # every pass ran, timed, in order, and left its product
        assert list(full.timings) == list(PASS_NAMES)
        assert full.program is not None and full.forward_graph is not None
        assert "overlap_raised" in full.stats and "saved_for_backward" in full.stats
        alone = run("coarsen", "share_layers", "overlap")
        assert len(alone.groups) > len(full.groups)  # every node decides alone
        assert set(alone.layer_of_group.items()) == {(g.id, g.id) for g in alone.groups}  # nothing shared
        assert full.stats["shared_layers"] >= 1 and "overlap_raised" not in alone.stats


def test_split_backward_makes_every_gradient_once() -> None:
    """A backward cut for zero-bubble schedules (``compiler/split_backward.py``): the input part makes the input
    gradient and what the weight part reads of its values (a node both need runs once, in the input part); the
    weight part, from the saved values it reads and that carry, makes the weight gradient; both equal the
    whole graph's."""
    import torch.fx as fx

    from autoshard.compiler.split_backward import split_backward

    def backward(x, w, g):
        s = g * 2.0  # both gradients read it
        return torch.mm(s, w), torch.mm(s.t(), x) + w.sum()

    gm = fx.symbolic_trace(backward)
    # the traced outputs in the backward's order: the weight gradient first, then the input gradient
    out = gm.graph.find_nodes(op="output")[0]
    out.args = ((out.args[0][1], out.args[0][0]),)
    gm.recompile()
    x, w, g = torch.randn(4, 3), torch.randn(5, 3), torch.randn(4, 5)
    want_dw, want_dx = gm(x, w, g)
    parts = split_backward(gm, [False, True])
    dx, *carry = parts.inputs(x, w, g)
    assert parts.n_input_grads == 1 and torch.equal(dx, want_dx)
    assert parts.arg_slots == (0, 1)  # x and w: the weight part reads them itself, g only through s
    assert [n.name for n in parts.inputs.graph.nodes if n.op == "call_function"].count("mul") == 1
    assert not [n for n in parts.weights.graph.nodes if n.op == "call_function" and n.target is operator.mul]
    (dw,) = parts.weights(*[(x, w, g)[i] for i in parts.arg_slots], *carry)
    assert torch.equal(dw, want_dw)
