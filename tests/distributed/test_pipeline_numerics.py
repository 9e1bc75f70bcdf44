"""Pipelined training on real gloo ranks equals the single-device run: loss, every gradient, parameters after
AdamW steps. Stages come from ``torch.distributed.pipelining`` (GPipe, 1F1B, interleaved 1F1B), each stage
runs its own sharded program on its sub-mesh."""

from __future__ import annotations

import pytest
import torch
from harness import Reference, assert_close_to_reference, single_device_reference
from numerics_utils import LR, PARAM_ATOL, _full
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.models import hf
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.models.llama import Llama, LlamaConfig, llama_example_inputs
from autoshard.testing.launch import launch

PP_CFG = GPTConfig(n_layer=4, d_model=32, n_head=4, vocab=64, seq_len=16, bias=False)
BATCH = 8


def make_pp_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(PP_CFG)


def _inputs() -> tuple[torch.Tensor, ...]:
    return gpt_example_inputs(PP_CFG, BATCH)


LLAMA_CFG = LlamaConfig(n_layer=4, d_model=32, n_head=4, n_kv_head=2, ffn=64, vocab=64, seq_len=16)


def make_pp_llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LLAMA_CFG)


def _hf(name: str, layers: int) -> tuple:
    """A stock transformers model (default config, default attention, use_cache on) and its padded batch of
    keyword arguments (labels -100 on the padding: micro-batches count different numbers of targets)."""
    return (
        lambda: hf.build(name, batch=BATCH, dropout=False, layers=layers)[0],
        lambda: hf.build(name, batch=BATCH, dropout=False, layers=layers)[1],
    )


# name -> (make model, make global inputs); Llama's rotary tables cross stage boundaries as gradient-free outputs
MODELS = {
    "gpt": (make_pp_gpt, _inputs),
    "llama": (make_pp_llama, lambda: llama_example_inputs(LLAMA_CFG, BATCH)),
    "hf-gpt2": _hf("gpt2", 2),
    "hf-llama": _hf("llama", 4),
    "hf-t5": _hf("t5", 2),
    "hf-vit": _hf("vit", 2),
}


def _train(rank: int, world: int, arg: tuple) -> dict:
    shape, names, kw = arg
    make, inputs_fn = MODELS[kw.pop("model", "gpt")]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    inputs = inputs_fn()
    sharded = autoshard.compile(make(), mesh, inputs, **kw)
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(3):  # one loop for ShardedModule and PipelinedModule: step takes the call as the model does
        loss = sharded.step(**inputs) if isinstance(inputs, dict) else sharded.step(*inputs)
        if step == 0:
            grads = {n: _full(p.grad) for n, p in sharded.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    params = {n: _full(p.data) for n, p in sharded.named_parameters()}
    state = sharded.state_dict()  # the model's keys: a tied parameter under the name its stage uses
    sharded.load_state_dict(state)
    seen: dict[int, str] = {}
    first = {n: seen.setdefault(id(p), n) for n, p in make().named_parameters(remove_duplicate=False)}
    return {
        "losses": losses,
        "grads": grads,
        "params": params,
        "plan": sharded.plan.to_json(),
        "state_keys": sorted({first.get(n, n) for n in state} & set(params)),
        "kind": type(sharded).__name__,
        "split": _split_backwards(sharded),
    }


def _split_backwards(sharded) -> list[dict]:
    """Per stage on this rank whose backward runs in two parts: W actions run, and the ops of each part."""
    out = []
    for m in getattr(sharded, "stage_modules", {}).values():
        if m._deferred is None:
            continue
        parts = m.program._split
        ops = [[str(n.target) for n in g.graph.nodes if n.op == "call_function"] for g in (parts.inputs, parts.weights)]
        out.append(
            {
                "weight_runs": m._deferred.weight_runs,
                "input_ops": ops[0],
                "weight_ops": ops[1],
                "input_grads": parts.n_input_grads,
            }
        )
    return out


def _only(ref: Reference, names: set[str]) -> Reference:
    return Reference(
        ref.losses,
        {n: g for n, g in ref.grads.items() if n in names},
        {n: p for n, p in ref.params.items() if n in names},
    )


def _run(shape: tuple[int, ...], names: tuple[str, ...], **kw) -> list[dict]:
    world = 1
    for s in shape:
        world *= s
    results = launch(world, _train, (shape, names, dict(kw, backend=kw.get("backend", "eager"))))
    make, inputs_fn = MODELS[kw.get("model", "gpt")]
    ref = single_device_reference(make, inputs_fn(), steps=3, lr=LR)
    held: set[str] = set()
    for r, got in enumerate(results):
        held |= set(got["params"])
        assert_close_to_reference(
            _only(ref, set(got["params"])), got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL
        )
        assert got["plan"] == results[0]["plan"], f"rank {r} runs a different plan from rank 0"
        assert got["state_keys"] == sorted(got["params"]), "state_dict names differ from the parameters' names"
    assert held == set(ref.params), f"parameters held by no stage: {sorted(set(ref.params) - held)}"
    return results


@pytest.mark.parametrize(
    "shape,names,kw",
    [
        ((2, 2), ("pp", "dp"), {"schedule": "1F1B", "microbatches": 2}),
        (
            (2, 2),
            ("pp", "tp"),
            {"schedule": "GPipe", "microbatches": 4, "cluster": "h100-sxm", "constraints": {"params": {"tp": "S(0)"}}},
        ),
        ((4,), ("pp",), {"schedule": "1F1B", "microbatches": 4}),
        ((2,), ("pp",), {"schedule": "Interleaved1F1B", "microbatches": 2}),
        ((2,), ("pp",), {"schedule": "1F1B", "microbatches": 2, "model": "llama"}),
        (
            (2, 2),
            ("pp", "dp"),
            {
                "schedule": "InterleavedZeroBubble",
                "microbatches": 4,
                "cluster": "h100-sxm",
                "constraints": {"inputs": {"dp": "S(0)"}},
            },
        ),
    ],
    ids=["2x2-1f1b", "2x2-tp-gpipe", "4-stages-1f1b", "2x2chunks-interleaved", "llama-2-stages", "2x2-zero-bubble"],
)
def test_pipeline_matches_single_device(shape, names, kw):
    results = _run(shape, names, **kw)
    plan = autoshard.Plan.from_json(results[0]["plan"])
    assert plan.schedule == kw["schedule"] and plan.microbatches == kw["microbatches"]
    assert len(plan.stages) == (4 if kw["schedule"].startswith("Interleaved") else shape[0])
    if kw["schedule"] == "InterleavedZeroBubble":  # B and W ran apart: every stage, every micro-batch, 3 steps
        for got in results:
            assert len(got["split"]) == 2 and all(s["weight_runs"] == 3 * kw["microbatches"] for s in got["split"])
            reduces = [
                [op for op in s[part] if "all_reduce" in op or "reduce_scatter" in op]
                for s in got["split"]
                for part in ("input_ops", "weight_ops")
            ]
            assert not any(reduces[0::2]) and any(reduces[1::2]), reduces  # gradient reductions run in W only
            assert all(any(op.startswith("aten.mm") for op in s["weight_ops"]) for s in got["split"])
            # the stages after the first send their input gradients: matmuls in B too
            assert any(
                s["input_grads"] and any(op.startswith("aten.mm") for op in s["input_ops"]) for s in got["split"]
            )


def test_pipeline_inductor_2x2():
    """The compiled path: each stage's forward and backward are Inductor C++ kernels."""
    results = _run(
        (2, 2),
        ("pp", "tp"),
        schedule="1F1B",
        microbatches=2,
        backend="inductor",
        cluster="h100-sxm",
        constraints={"params": {"tp": "S(0)"}},
    )
    plan = autoshard.Plan.from_json(results[0]["plan"])
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3)]
    for stage in plan.stages:  # each stage really is 2-way sharded inside
        assert all(t.placements == ("S(0)",) for t in stage.tensors if t.role == "parameter" and len(t.shape) == 2)


def _auto(rank: int, world: int, arg: None) -> dict:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    inputs = _inputs()
    sharded = autoshard.compile(
        make_pp_gpt(),
        mesh,
        inputs,
        cluster="h100-sxm:1x4",
        pipeline="auto",
        microbatches=4,
        schedule="1F1B",
        backend="eager",
    )
    return {"kind": type(sharded).__name__, "plan": sharded.plan.to_json(), "loss": float(sharded.step(*inputs))}


def test_auto_weighs_stages_and_keeps_none_for_a_small_model():
    """pipeline="auto" plans 2 and 4 stages, and a tiny model on one fast node is faster without them (the
    pipeline's bubble and sends cost more than the work they spread); the plain program still trains right."""
    results = launch(4, _auto, None)
    ref = single_device_reference(make_pp_gpt, _inputs(), steps=1, lr=LR)
    assert results[0]["kind"] == "ShardedModule"
    assert len(autoshard.Plan.from_json(results[0]["plan"]).stages) == 1
    for got in results:
        assert abs(got["loss"] - ref.losses[0]) < 1e-5


def _no_layers(rank: int, world: int, arg: None) -> str:
    from autoshard.models.mlp import MLP, mlp_example_inputs

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    try:
        autoshard.compile(MLP(32, 64, 32), mesh, mlp_example_inputs(16, 32, 32), backend="eager")
    except ValueError as e:
        return str(e)
    return "no error"


def test_pp_axis_on_a_model_without_repeated_layers_is_a_clear_error():
    msg = launch(2, _no_layers, None)[0]
    assert "MLP has none; its containers: layers (nn.ModuleList of 0" in msg and "'pp' axis" in msg, msg


@pytest.mark.parametrize(
    "model,shape,names,kw",
    [
        ("hf-gpt2", (2, 2), ("pp", "tp"), {"schedule": "1F1B", "microbatches": 4}),
        ("hf-llama", (2,), ("pp",), {"schedule": "Interleaved1F1B", "microbatches": 4}),
        ("hf-t5", (2,), ("pp",), {"schedule": "GPipe", "microbatches": 2}),
        ("hf-vit", (2,), ("pp",), {"schedule": "1F1B", "microbatches": 2}),
        ("hf-gpt2", (2,), ("dp",), {}),
    ],
    ids=["gpt2-tied-pp2xtp2", "llama-4-stages-relayed", "t5-encoder-decoder", "vit", "gpt2-same-loop-no-pp"],
)
def test_stock_hf_models_in_pipeline_stages(model, shape, names, kw):
    """Stock transformers models as their users call them (keyword arguments, padded attention mask, labels
    with -100, a ModelOutput): GPT-2's embedding tied to its LM head across stages and tensor-parallel inside
    them; Llama cut into 4 stages on 2 ranks, its rotary tables and causal mask made in stage 0 and relayed to
    stages 2 and 3; T5 cut in its encoder (blocks of one class, not identical: the first holds the relative
    position table, whose gradient comes back from stage 1 next to a gradient-free mask), the decoder and the
    shared embedding in the last stage; ViT, whose stage sends a non-contiguous activation; and the same
    training loop over a plan without stages."""
    results = _run(shape, names, model=model, **kw)
    plan = autoshard.Plan.from_json(results[0]["plan"])
    if kw:
        assert results[0]["kind"] == "PipelinedModule" and plan.microbatches == kw["microbatches"]
        assert len(plan.stages) == (4 if kw["schedule"] == "Interleaved1F1B" else 2)
    else:
        assert results[0]["kind"] == "ShardedModule"


def _misuse(rank: int, world: int, arg: None) -> list[str]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    model, batch = hf.build("gpt2", batch=BATCH, dropout=False)
    sharded = autoshard.compile(model, mesh, batch, backend="eager", microbatches=2, schedule="GPipe")
    out = []
    for call in (
        lambda: sharded(**batch),
        lambda: sharded.shard_inputs(**batch),
        lambda: sharded.step(input_ids=batch["input_ids"]),
    ):
        try:
            call()
            out.append("no error")
        except (TypeError, ValueError) as e:
            out.append(str(e))
    return out


def test_pipelined_module_says_what_to_call_instead():
    msgs = launch(2, _misuse, None)[0]
    assert "sharded.step(" in msgs[0] and "global batch" in msgs[0]
    assert "sharded.step(" in msgs[1] and "not its shards" in msgs[1]
    assert "not shaped like the traced call" in msgs[2]
