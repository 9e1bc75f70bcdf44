"""Planning a user's own module on a DeviceMesh samples its repeated layers (``autoshard.plan``), without
changing the plan: three of a stock Hugging Face Llama's six identical decoder layers are captured and stand
for all six, and the predicted step time, the memory and each layer's placements are those of capturing
every layer. ``compile`` runs the program, so it captures every layer."""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autoshard
import autoshard.api
import autoshard.search.accumulate
from autoshard.cluster.meshes import fake_world
from autoshard.ir import repeated_layers
from autoshard.testing.launch import launch

pytest.importorskip("transformers")

from autoshard.models import hf  # noqa: E402
from autoshard.plans.report import report

LAYERS = 6
# small sizes and the planner's fast settings: this file times in seconds, not minutes
FAST = dict(solve_recipes=False, time_limit_s=20.0)


def _tiny_llama(device: str = "meta"):
    import transformers

    cfg = transformers.LlamaConfig(**{**hf._DECODER, "num_hidden_layers": LAYERS})
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(3, hf.VOCAB, (4, 16))
    return model, dict(input_ids=ids, labels=ids)


def _per_layer(plan: autoshard.Plan) -> dict[int, tuple]:
    """Each decoder layer's decisions (op, phase, shape, placements), in order, by layer index."""
    out: dict[int, list] = {}
    for o in plan.stages[0].ops:
        m = re.match(r"model\.layers\.(\d+)(\.|$)", o.module)
        if m:
            rel = o.module[m.end(1) :]
            out.setdefault(int(m.group(1)), []).append((rel, o.op, o.phase, o.shape, o.output, o.inputs))
    return {i: _up_to_axis_swap(tuple(v)) for i, v in out.items()}


def _up_to_axis_swap(decisions: tuple) -> tuple:
    """One layer's decisions with the two axes of the (2, 2) mesh possibly swapped, in one canonical order: both
    axes are alike on this cluster, so a layer that splits on one or on the other costs the same to the
    nanosecond, and which of the two the solver returns is not a property of sampling."""

    def swap(x):
        if isinstance(x, tuple) and len(x) == 2 and all(isinstance(p, str) for p in x):
            return (x[1], x[0])
        return tuple(swap(y) for y in x) if isinstance(x, tuple) else x

    return min(decisions, tuple(swap(d) for d in decisions))


def _plan_both(rank: int, world: int, arg: tuple) -> dict:
    """Rank 0: the sampled plan (``plan``'s default); rank 1: every layer captured (``sample_layers=None``)."""
    torch.set_num_threads(1)
    model, batch = arg
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = (
            autoshard.plan(model, mesh, batch, **FAST)
            if rank == 0
            else autoshard.plan(model, mesh, batch, sample_layers=None, **FAST)
        )
    return {"plan": plan.to_json(), "layers": len(model.model.layers), "configured": model.config.num_hidden_layers}


def test_plan_samples_stock_llama_layers_and_matches_full_capture() -> None:
    model, batch = _tiny_llama()
    assert repeated_layers(model) == ("model.layers", LAYERS)
    # the two plans are independent single-threaded work: one in each of two forked processes (2 cores)
    results = launch(2, _plan_both, (model, batch), gloo=False)
    sampled, full = (autoshard.Plan.from_json(r["plan"]) for r in results)
    results_layers = [(r["layers"], r["configured"]) for r in results]
    assert sampled.sampled_layers.startswith(f"model.layers: 3 of {LAYERS} identical layers captured")
    assert "repeated layers: model.layers: 3 of 6" in report(sampled)
    assert full.sampled_layers == ""
    assert sampled.solver.status == full.solver.status == "OPTIMAL"
    assert sampled.step_time_s == pytest.approx(full.step_time_s, rel=0.01)
    assert sampled.peak_memory.total == pytest.approx(full.peak_memory.total, rel=0.01)
    for part in ("parameters", "gradients", "optimizer", "activations"):
        assert getattr(sampled.peak_memory, part) == pytest.approx(getattr(full.peak_memory, part), rel=0.01)
    # the sampled plan decides for layers 0..2 only; every layer of the full plan decides like one of them
    got, want = _per_layer(sampled), _per_layer(full)
    assert sorted(got) == [0, 1, 2] and sorted(want) == list(range(LAYERS))
    assert all(want[i] == got[i] for i in range(3))
    assert {want[i] for i in range(LAYERS)} <= set(got.values())
    # the shallow copy planned is not the user's model: every layer is still there (after planning, in each process)
    for layers, configured in results_layers:
        assert layers == LAYERS and configured == LAYERS
    assert len(model.model.layers) == LAYERS and model.config.num_hidden_layers == LAYERS


def test_compile_captures_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``plan`` hands the planner ``sample_layers=3``; ``compile`` (same model, same mesh) hands it None."""
    seen: dict[str, object] = {}

    class Stop(Exception):
        pass

    def spy(model, inputs, mesh, cluster, config, *args, **kwargs):
        seen["sample_layers"] = config.sample_layers
        raise Stop

    model, batch = _tiny_llama(device="cpu")
    # plan's and compile's call, both through the dispatcher's flat plan and its micro-batch search
    monkeypatch.setattr(autoshard.search.accumulate, "plan_graph", spy)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(Stop):
            autoshard.plan(model, mesh, batch)
        assert seen.pop("sample_layers") == 3
        with pytest.raises(Stop):
            autoshard.compile(model, mesh, batch, backend="eager")
        assert seen.pop("sample_layers") is None


def test_constraint_on_some_layers_only_keeps_every_layer() -> None:
    """A constraint that pins layers 1 and 10-19 but not the others: sampled layers could not stand for them."""
    from autoshard.compiler.capture_layers import constraints_uneven
    from autoshard.config import PlanConfig

    model, _ = _tiny_llama()
    some = PlanConfig(constraints={"model.layers.1*.mlp.*": "[R, R]", "inputs": "[S(0), R]"})
    every = PlanConfig(constraints={"model.layers.*.mlp.*": "[R, R]", "params": "[R, R]"})
    assert constraints_uneven(model, "model.layers", LAYERS, some) == "model.layers.1*.mlp.*"
    assert constraints_uneven(model, "model.layers", LAYERS, every) is None
