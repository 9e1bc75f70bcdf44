"""Layer 4b: numerics against the single-device run with real gloo processes (fork start).

Each rank traces its own per-rank program (local shapes, _c10d_functional collectives), partitions it into
forward and backward, and runs it as FX graphs (backend="eager") or Inductor C++ kernels."""

from __future__ import annotations

import pytest
import torch
from harness import assert_close_to_reference, local_ranks, single_device_reference
from numerics_utils import LR, MODELS, PARAM_ATOL, make_mlp, train_sharded
from torch.distributed.tensor import Shard

from autoshard.models.mlp import mlp_example_inputs
from autoshard.testing.launch import launch


def _hf(name: str) -> tuple:
    """A stock ``transformers`` model of ``autoshard.models.hf.TINY`` as (make model, make batch)."""
    from autoshard.models.hf import build

    return (lambda: build(name, dropout=False)[0]), (lambda: build(name, dropout=False)[1])


def _models(name: str) -> tuple:
    return _hf(name.removeprefix("hf-")) if name.startswith("hf-") else MODELS[name]


def _worker(rank: int, world: int, arg: tuple) -> dict:
    name, shape, names, kw = arg
    make, inputs_fn = _models(name)
    return train_sharded(make, inputs_fn(), shape, names, lr=LR, **kw)


def _run(name: str, shape: tuple[int, ...], names: tuple[str, ...], **kw) -> list[dict]:
    world = 1
    for s in shape:
        world *= s
    arg = (name, shape, names, kw)
    results = launch(world, _worker, arg)
    make, inputs_fn = _models(name)
    ref = single_device_reference(make, inputs_fn(), steps=3, lr=LR)
    for r, got in enumerate(results):
        assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
        assert got["plan"] == results[0]["plan"], f"rank {r} runs a different plan from rank 0"
    return results


BATCH = {"inputs": {"dp": Shard(0)}}


@pytest.mark.parametrize(
    "name,shape,names,kw",
    [
        ("mlp", (2,), ("dp",), {"constraints": BATCH, "backend": "eager"}),
        ("gpt", (4,), ("dp",), {"constraints": BATCH, "backend": "eager", "memory_budget": "900KiB"}),
        (
            "gpt",
            (2, 2),
            ("dp", "tp"),
            {"constraints": {"inputs": "[S(0), R]"}, "cluster": "h100-sxm", "backend": "eager"},
        ),
        ("gpt", (2, 2), ("dp", "tp"), {"recipe": "fsdp", "backend": "eager"}),  # [S(0), S(0)] gathered in groups
        ("gpt", (2,), ("dp",), {"recipe": "zero1", "backend": "eager"}),  # all-reduce, step a shard, gather back
        ("moe", (2,), ("dp",), {"recipe": "ep", "backend": "eager"}),  # experts sharded, tokens all-to-all'd
        # one sequence split over 2 ranks: causal ring attention, the chunks sent point to point
        ("llama-long", (2,), ("cp",), {"constraints": {"inputs": "[S(1)]"}, "cluster": "h100-sxm", "backend": "eager"}),
        # a large vocabulary, tokens whole on tp: the cross-entropy on vocabulary slices, row statistics all-reduced
        ("gpt-vocab", (2,), ("tp",), {"constraints": {"inputs": "[R]"}, "cluster": "h100-sxm", "backend": "eager"}),
        # the stock transformers Mixtral under the ep recipe: its stacked expert weights sharded over the ranks
        ("hf-mixtral", (2,), ("dp",), {"recipe": "ep", "backend": "eager"}),
        # a GroupNorm weight gathered in its layer's group from one element a rank: contiguous for native_group_norm
        ("groupnorm", (4,), ("dp",), {"recipe": "fsdp", "backend": "eager"}),
    ],
    ids=[
        "mlp-dp2-eager",
        "gpt-dp4-fsdp-eager",
        "gpt-2x2-tp-eager",
        "gpt-2x2-fsdp-eager",
        "gpt-dp2-zero1-eager",
        "moe-dp2-ep-eager",
        "llama-cp2-eager",
        "gpt-vocab-tp2-eager",
        "hf-mixtral-dp2-ep-eager",
        "groupnorm-dp4-fsdp-eager",
    ],
)
def test_gloo_eager(name, shape, names, kw):
    results = _run(name, shape, names, **kw)
    from autoshard.plans.plan import Plan

    plan = Plan.from_json(results[0]["plan"])
    if name == "llama-long":  # context parallelism: ring attention, chunks passed point to point
        fwd = [d for d in plan.stages[0].ops if d.op.startswith("aten._scaled_dot_product") and d.phase == "forward"]
        assert fwd and all(d.inputs == (("S(2)",),) * 3 for d in fwd), fwd
    if name == "gpt-vocab":  # vocabulary-parallel loss: the log-probabilities split over the vocabulary
        soft = [d for d in plan.stages[0].ops if d.op == "aten._log_softmax.default"]
        assert soft and all(d.inputs == (("S(1)",),) for d in soft), soft
    if name == "hf-mixtral":  # experts.gate_up_proj / down_proj: [experts, in, out], one expert per rank
        experts = {k: v for k, v in plan.parameter_placements().items() if ".experts." in k}
        assert experts and set(experts.values()) == {("S(0)",)}, experts
    if name == "moe":  # expert parallelism: the experts stay sharded, tokens move (gloo: gathered and chunked)
        assert {v for k, v in plan.parameter_placements().items() if ".moe.w" in k} == {("S(0)",)}


def test_gloo_inductor_gpt_2x2():
    """The compiled path: Inductor C++ kernels with the collectives inside the generated wrapper."""
    _run("gpt", (2, 2), ("dp", "tp"), constraints=BATCH, backend="inductor")


def test_gloo_gpt_zero2():
    """ZeRO-2: gradients reduce-scattered inside the rank's program, AdamW on each rank's shard of the master
    parameters, the compute copies gathered at the next forward."""
    results = _run("gpt", (2,), ("dp",), recipe="zero2", backend="eager")
    from autoshard.plans.plan import Plan

    layouts = [t for t in Plan.from_json(results[0]["plan"]).stages[0].tensors if t.role == "parameter"]
    assert {t.zero for t in layouts if t.shape[0] % 2 == 0} == {"zero2"}


def test_wrong_local_input_names_expected_shape():
    results = launch(2, _bad_input_worker, None)
    assert "expected this rank's local piece f32[8, 32]" in results[0]
    assert "[S(0)]" in results[0]


def _bad_input_worker(rank: int, world: int, arg: None) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard

    x, y = mlp_example_inputs(16, 32, 32)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    sharded = autoshard.compile(make_mlp(), mesh, (x, y), constraints=BATCH, backend="eager")
    try:
        sharded(x[0], y[0])  # a sample instead of this rank's pieces (another batch size is a new shape, planned)
    except ValueError as e:
        return str(e)
    return "no error"


def test_state_dict_is_dtensor_and_saves_with_dcp(tmp_path):
    results = launch(2, _dcp_worker, str(tmp_path / "ckpt"))
    assert results[0] == results[1] == "ok"


def _dcp_worker(rank: int, world: int, path: str) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import autoshard

    x, y = mlp_example_inputs(16, 32, 32)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    sharded = autoshard.compile(make_mlp(), mesh, (x, y), constraints=BATCH, memory_budget="48KiB", backend="eager")
    sd = sharded.state_dict()
    assert set(sd) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert all(isinstance(v, DTensor) for v in sd.values())
    assert any(v.placements != (torch.distributed.tensor.Replicate(),) for v in sd.values())
    dcp.save(sd, checkpoint_id=path)
    saved = {k: v.full_tensor().clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in sharded.parameters():
            p.zero_()
    target = sharded.state_dict()
    dcp.load(target, checkpoint_id=path)
    for k, v in target.items():
        assert torch.equal(v.full_tensor(), saved[k]), k
    return "ok"


def test_gloo_after_local_tensor_mode_in_the_parent():
    """Forked ranks inherit the parent's DTensor caches; after the parent simulated a (2, 2) world, the real
    (2, 2) world must not reuse its meshes (stale process group names, rank 0's chunk on every rank)."""
    make, inputs_fn = MODELS["gpt"]
    inputs = inputs_fn()
    with local_ranks(4):
        train_sharded(make, inputs, (2, 2), ("dp", "tp"), steps=1, lr=LR, recipe="fsdp+tp")
    _run("gpt", (2, 2), ("dp", "tp"), constraints={"inputs": "[S(0), R]"}, backend="eager")


def _one_device_attention(rank: int, world: int, arg: object) -> tuple:
    import logging

    from torch.distributed.device_mesh import init_device_mesh

    import autoshard
    from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs

    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("autoshard").addHandler(Said())
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, seq_len=512, bias=False)
    ids, tgt = gpt_example_inputs(cfg, 2)
    torch.manual_seed(0)
    ref = GPT(cfg)
    ref_loss = ref(ids, tgt)
    ref_loss.backward()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    sharded = autoshard.compile(GPT(cfg), mesh, (ids, tgt), cluster="h100-sxm", backend="eager")
    on_seq = [d.node for d in sharded.plan.stages[0].ops if "attention" in d.op and "S(2)" in str(d.inputs[0])]
    loss = sharded(*sharded.shard_inputs(ids, tgt))
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
    worst = max(
        float((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)) for n, p in ref.named_parameters()
    )
    return on_seq, [m for m in said if "unbalanced" in m], float(loss), float(ref_loss), worst


def test_one_device_mesh_runs_attention_planned_on_its_sequence_whole():
    """On a 1-device mesh the plan may put attention's queries "on the sequence" of its one rank (every layout costs
    alike there); nothing is split, so the kernel runs whole: no causal load balance (the CUDA kernels refused it:
    ``benchmarks/gpu_single.py`` on an H200, 2026-11-27) and no unbalanced fallback, and the step equals one
    device's."""
    ((on_seq, unbalanced, loss, ref_loss, worst),) = launch(1, _one_device_attention)
    assert on_seq  # the case: attention's queries planned on the sequence of the mesh's size-1 axis
    assert not unbalanced, unbalanced
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert worst <= 1e-4
