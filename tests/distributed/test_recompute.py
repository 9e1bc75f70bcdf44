"""Activation recomputation of chosen modules (``compile(..., recompute=[...])``,
autoshard/compiler/capture_recompute.py): the plan counts the recomputed layers' activations as not saved and their
forward twice; the rank's program saves fewer tensors and replays the layers' forward in the backward (a selective layer
all but its matmuls); numerics equal to one device on gloo. Under a budget the planner recomputes only as many layers,
in the cheapest mode, as the budget asks."""

from __future__ import annotations

import json

import torch
from harness import assert_close_to_reference, single_device_reference
from numerics_utils import LR, MODELS, PARAM_ATOL, train_sharded
from torch.distributed.tensor import Shard

import autoshard
from autoshard.compiler.capture_recompute import LayerReplay, layer_modes, mix_specs, sampled_specs
from autoshard.plans.report import report
from autoshard.search.recompute import best_mix
from autoshard.testing.launch import launch


def _program_counts(sharded) -> dict:
    program = sharded._program
    return {
        "saved": program.n_saved,  # tensors the forward keeps for the backward
        "backward_mm": sum(
            1
            for n in program.bw_gm.graph.nodes  # matmuls run (saved ones come in by name)
            if n.op == "call_function" and "mm" in str(n.target)
        ),
        # attention forwards run again in the backward (a kernel tagged as random for its dropout_p, at 0)
        "backward_attention": sum(
            1
            for n in program.bw_gm.graph.nodes
            if n.op == "call_function" and "scaled_dot_product" in str(n.target) and "backward" not in str(n.target)
        ),
    }


def _worker(rank: int, world: int, recompute: tuple[str, ...]) -> dict:
    make, inputs_fn = MODELS["gpt"]
    return train_sharded(
        make, inputs_fn(), (world,), ("dp",), lr=LR, recompute=recompute, backend="eager", probe=_program_counts
    )


def test_recomputed_layers_save_less_and_train_like_one_device():
    """Every layer in full; and one layer of two selectively (partial and selective at once): it replays no
    matmul, saves less than saving everything and more than full recomputation."""
    make, inputs_fn = MODELS["gpt"]
    ref = single_device_reference(make, inputs_fn(), steps=3, lr=LR)
    plain, redo, some = (launch(2, _worker, rc)[0] for rc in ((), ("layers",), ("layers.0:selective",)))
    for got in (plain, redo, some):
        assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
    assert redo["saved"] < plain["saved"], (redo["saved"], plain["saved"])
    assert redo["backward_mm"] > plain["backward_mm"]  # the layers' forward matmuls run again in the backward
    assert some["backward_mm"] == plain["backward_mm"]  # selective: the matmuls are saved, not replayed
    # full: attention replays too, so a layer keeps only its input, not its queries, keys and values
    assert redo["backward_attention"] > plain["backward_attention"] == some["backward_attention"] == 0
    p, r, s = (autoshard.Plan.from_json(g["plan"]) for g in (plain, redo, some))
    assert r.peak_memory.activations < s.peak_memory.activations < p.peak_memory.activations
    assert r.peak_memory.activations < p.peak_memory.activations / 2
    assert r.step_time_s > s.step_time_s > p.step_time_s
    assert 0 < s.recompute_s < r.recompute_s and s.recompute_layers == ("layers.0:selective",)
    assert "layers.0 selective" in report(s) and r.recompute_layers == ("layers",)


def test_compile_recomputes_where_only_recomputation_fits():
    """A budget the plan cannot meet by sharding alone (1.6 MB: the least without recomputation is about 1.9 MB)
    is met by recomputing the layers, chosen by compile, numerics equal; without a budget nothing recomputes."""
    from harness import local_ranks

    make, inputs_fn = MODELS["gpt"]
    inputs = inputs_fn()
    ref = single_device_reference(make, inputs, steps=3, lr=LR)
    with local_ranks(2):
        got = train_sharded(make, inputs, (2,), ("dp",), lr=LR, backend="eager", memory_budget=1_600_000)
        free = train_sharded(make, inputs, (2,), ("dp",), lr=LR, backend="eager", memory_budget=3_500_000)
    assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
    plan = autoshard.Plan.from_json(got["plan"])
    assert plan.recompute and plan.microbatches == 1 and plan.peak_memory.total <= 1_600_000
    assert "activation recomputation" in report(plan)
    assert not autoshard.Plan.from_json(free["plan"]).recompute  # a budget that does not bind: no recomputation


class _Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class _Stack(torch.nn.Module):
    """4 residual MLP blocks: a small graph (quick to capture) whose activations dominate its memory."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(d) for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.mse_loss(x, y)


def test_planner_recomputes_some_layers_selectively_only_when_the_budget_asks():
    """4 residual MLP blocks on 2 fake ranks, batch on dp (activations dominate its memory): with 95% of what saving
    every activation needs, 3 of the 4 layers recompute selectively (cheaper than full recomputation of fewer layers,
    and than every layer); with 102% nothing recomputes. The plan's JSON keeps which layers, and old JSON still
    loads."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.cluster.meshes import fake_world

    with torch.device("meta"):
        model = _Stack()
    inputs = (torch.randn(2048, 64), torch.randn(2048, 64))
    kw = dict(constraints={"inputs": {"dp": Shard(0)}}, solve_recipes=False, shard_state=False)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        need = autoshard.plan(model, mesh, inputs, **kw).peak_memory.total
        tight = autoshard.plan(model, mesh, inputs, memory_budget=int(0.95 * need), **kw)
        loose = autoshard.plan(model, mesh, inputs, memory_budget=int(1.02 * need), **kw)
    modes = layer_modes(tight.recompute_layers, "layers", 4)
    assert modes.count(None) == 1 and modes.count("selective") == 3, modes
    assert tight.peak_memory.total <= 0.95 * need and tight.recompute_s > 0
    assert not loose.recompute and loose.recompute_layers == ()
    assert autoshard.Plan.from_json(tight.to_json()) == tight
    old = json.loads(tight.to_json())
    del old["recompute_layers"], old["recompute_s"]  # written before the planner chose per layer
    assert autoshard.Plan.from_json(json.dumps(old)).recompute


def test_best_mix_and_sampled_layers():
    """The mix of saved / selective / full layers that fits fastest (at most two modes), and the modes the
    captured layers take when 3 of 10 stand for all."""
    rep = LayerReplay(full_bytes=100, cheap_bytes=60, full_s=1.0, cheap_s=0.1)
    full = (0, 0, 10)  # estimated from a plan recomputing all 10 layers in full: 20 s, 500 bytes

    def mix(budget: float, **kw) -> tuple | None:
        found = best_mix(10, rep, full, 20.0, 500, budget, **kw)
        return found[0] if found is not None else None

    assert mix(1500) == (10, 0, 0)  # everything saved fits
    assert mix(900) == (0, 10, 0)  # every layer selective: 400 more than all-full
    assert mix(1000) == (1, 9, 0)  # one layer saved
    assert mix(600) == (0, 2, 8)  # selective frees too little: most layers in full
    assert mix(600, allow_full=False) is None and mix(499) is None
    counts, step = best_mix(10, rep, (0, 10, 0), 11.0, 900, 1000, allow_full=False)  # from all-selective
    assert counts == (1, 9, 0) and abs(step - 10.9) < 1e-9
    specs = mix_specs("layers", (5, 3, 2))
    assert specs[:2] == ("layers.0", "layers.1") and specs[2:] == tuple(f"layers.{i}:selective" for i in (2, 3, 4))
    captured, counts = sampled_specs(specs, "layers", 3, 10)
    assert layer_modes(captured, "layers", 3) == ["full", None, "selective"]  # every mode of layers 1..9 captured
    assert counts == {None: 5, "selective": 3, "full": 2}
