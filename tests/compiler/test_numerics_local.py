"""Layer 4a: numerics against the single-device run, all ranks simulated in one process (LocalTensorMode).

Loss, every gradient and the parameters after 3 AdamW steps, fp32, tight tolerance."""

from __future__ import annotations

import pytest
import torch
from harness import assert_close_to_reference, case_result, local_ranks, run_two_at_a_time, single_device_reference
from numerics_utils import LR, MODELS, PARAM_ATOL, train_sharded
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import autoshard
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs

pytestmark = pytest.mark.slow  # trainings on simulated ranks: the full suite's, not the fast tier's

# long enough (1024 tokens, d 512) that an H100 plan splits attention heads over tp and moves the attention output
# onto the sequence by an all-to-all (DeepSpeed-Ulysses' move): the rest of the layer runs sequence-sharded
SEQ_CFG = GPTConfig(n_layer=1, d_model=512, n_head=32, vocab=512, seq_len=1024, bias=False)


def _make_seq_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(SEQ_CFG)


ALL_MODELS = {**MODELS, "gpt-seq": (_make_seq_gpt, lambda: gpt_example_inputs(SEQ_CFG, 1))}

DP = {"inputs": {"dp": Shard(0)}}
# case -> (model, mesh shape, axis names, compile options); the tests using it
CASES = {
    "mlp-2x4": ("mlp", (2, 4), ("dp", "tp"), {"constraints": DP}),
    "gpt-2x4": ("gpt", (2, 4), ("dp", "tp"), {"constraints": DP}),
    "gpt-2x2-zero2": ("gpt", (2, 2), ("dp", "tp"), {"recipe": "zero2"}),
    "gpt-8-budget": ("gpt", (8,), ("dp",), {"constraints": DP, "memory_budget": "600KiB"}),  # forces sharding
    "gpt-seq-4": ("gpt-seq", (4,), ("tp",), {"cluster": "h100-sxm", "constraints": {"inputs": "[R]", "params": "[R]"}}),
    "moe-ep-4": ("moe", (4,), ("dp",), {"recipe": "ep"}),
    "llama-cp-4": ("llama-long", (4,), ("cp",), {"cluster": "h100-sxm", "constraints": {"inputs": "[S(1)]"}}),
    "gpt-vocab-4": ("gpt-vocab", (2, 2), ("dp", "tp"), {"cluster": "h100-sxm", "constraints": {"inputs": "[S(0), R]"}}),
    "groupnorm-4-zero1": ("groupnorm", (4,), ("dp",), {"recipe": "zero1"}),
    "groupnorm-4-zero2": ("groupnorm", (4,), ("dp",), {"recipe": "zero2"}),
}
USES = {
    "test_mesh_2x4_batch_on_dp": ("mlp-2x4", "gpt-2x4"),
    "test_mesh_2x2_zero2_state_sharded_over_both_axes": ("gpt-2x2-zero2",),
    "test_mesh_8_gpt_fsdp_like_budget": ("gpt-8-budget",),
    "test_sequence_sharded_residual_trains_like_one_device": ("gpt-seq-4",),
    "test_expert_parallel_moe_trains_like_one_device": ("moe-ep-4",),
    "test_context_parallel_causal_attention_trains_like_one_device": ("llama-cp-4",),
    "test_vocabulary_parallel_loss_trains_like_one_device": ("gpt-vocab-4",),
    "test_groupnorm_with_zero_state_trains_like_one_device": ("groupnorm-4-zero1", "groupnorm-4-zero2"),
}


def _train(case: str) -> tuple:
    name, shape, names, kw = CASES[case]
    make, inputs_fn = ALL_MODELS[name]
    inputs = inputs_fn()
    ref = single_device_reference(make, inputs, steps=3, lr=LR)
    n = 1
    for s in shape:
        n *= s
    with local_ranks(n):
        got = train_sharded(make, inputs, shape, names, lr=LR, **kw)
    return ref, got


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> dict:
    """The selected tests' cases, two at a time in forked processes (LocalTensorMode is single-threaded work)."""
    wanted = [
        c for item in request.session.items if item.module is request.module for c in USES.get(item.originalname, ())
    ]
    return run_two_at_a_time(
        _train, wanted, cost={"gpt-2x4": 4, "gpt-2x2-zero2": 3, "gpt-8-budget": 3, "llama-cp-4": 7, "gpt-vocab-4": 3}
    )


def _check(runs: dict, case: str) -> dict:
    ref, got = case_result(runs, case)
    assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
    return got


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_mesh_2x4_batch_on_dp(name, runs):
    _check(runs, f"{name}-2x4")


def test_mesh_2x2_zero2_state_sharded_over_both_axes(runs):
    got = _check(runs, "gpt-2x2-zero2")
    from autoshard.plans.plan import Plan

    tensors = [t for t in Plan.from_json(got["plan"]).stages[0].tensors if t.role == "parameter"]
    assert {t.state_placements for t in tensors if t.zero} == {("S(0)", "S(0)")}
    assert {t.zero for t in tensors} == {"zero2"}


def test_mesh_8_gpt_fsdp_like_budget(runs):
    # a budget that forces sharded parameters on 8 simulated ranks
    got = _check(runs, "gpt-8-budget")
    from autoshard.plans.plan import Plan

    placements = Plan.from_json(got["plan"]).parameter_placements()
    assert any(p != ("R",) for p in placements.values())


def test_sequence_sharded_residual_trains_like_one_device(runs):
    """The sequence sharded through the layer on tp, executed: with the weights held whole, attention runs as ring
    attention on the sequence chunks (its cost beat moving the heads to the sequence by all-to-all,
    DeepSpeed-Ulysses, which this case ran before ring attention existed; free, the plan shards q, k and v's
    weights by heads, 1% faster), no all-reduce in the forward, the norm after it on the sequence shard."""
    got = _check(runs, "gpt-seq-4")
    from autoshard.plans.plan import Plan

    stage = Plan.from_json(got["plan"]).stages[0]
    fwd = [c for c in stage.collectives if c.phase == "forward"]
    attn = [d for d in stage.ops if d.op == "aten._scaled_dot_product_flash_attention_for_cpu.default"]
    assert attn and all(d.inputs == (("S(2)",),) * 3 for d in attn), attn
    assert not any(c.kind == "all_reduce" for c in fwd), fwd
    [ln2] = [d for d in stage.ops if d.module.endswith("ln2") and d.op.startswith("aten.native_layer_norm.")]
    assert ln2.output == ("S(1)",), ln2


def test_expert_parallel_moe_trains_like_one_device(runs):
    """Expert parallelism executed (the ep recipe, 4 experts on 4 simulated ranks, one each): the tokens reach
    their expert's rank and come back by all-to-all (DTensor's all-to-all op), capacity drops included; loss,
    every gradient and the parameters after 3 AdamW steps equal the single-device run."""
    got = _check(runs, "moe-ep-4")
    from autoshard.plans.plan import Plan

    plan = Plan.from_json(got["plan"])
    experts = {k: v for k, v in plan.parameter_placements().items() if ".moe.w" in k}
    assert len(experts) == 6 and set(experts.values()) == {("S(0)",)}
    fwd = [c for c in plan.stages[0].collectives if c.phase == "forward" and c.kind == "all_to_all"]
    assert (
        sum(c.consumer.startswith("bmm") for c in fwd) >= 2
        and sum(c.consumer.startswith("_unsafe_view") for c in fwd) == 2
    ), fwd


def test_context_parallel_causal_attention_trains_like_one_device(runs):
    """Context parallelism executed: one 2048-token sequence split over 4 simulated ranks, causal ring attention
    (each rank's balanced query half-chunks against the key/value chunks passed around the ring, their
    gradients passed home), forward and backward; equal to the single-device run. (The gathered-K/V kernel is
    checked against the whole kernel in ``test_attention_kernels.py``.)"""
    got = _check(runs, "llama-cp-4")
    from autoshard.plans.plan import Plan

    stage = Plan.from_json(got["plan"]).stages[0]
    attn = [d for d in stage.ops if d.op.startswith("aten._scaled_dot_product_flash_attention_for_cpu")]
    fwd = [d for d in attn if d.phase == "forward"]
    bwd = [d for d in attn if d.phase == "backward"]
    assert len(fwd) == len(bwd) == 2
    assert all(d.output == ("S(2)",) and d.inputs == (("S(2)",),) * 3 for d in fwd), fwd
    assert all(d.inputs[1:4] == (("S(2)",),) * 3 for d in bwd), bwd


def test_vocabulary_parallel_loss_trains_like_one_device(runs):
    """A 32768-word vocabulary on dp=2 x tp=2, the tokens whole on tp: the logits stay split over the vocabulary
    on tp and the cross-entropy runs on the slices (row max and sum all-reduced, each rank picking the targets
    in its slice), forward and backward; equal to the single-device run."""
    got = _check(runs, "gpt-vocab-4")
    from autoshard.plans.plan import Plan

    ops = [
        d
        for d in Plan.from_json(got["plan"]).stages[0].ops
        if d.op
        in (
            "aten._log_softmax.default",
            "aten.nll_loss_forward.default",
            "aten.nll_loss_backward.default",
            "aten._log_softmax_backward_data.default",
        )
    ]
    assert len(ops) == 4, ops
    for d in ops:  # the log-probabilities (nll_loss_backward's second input) split over the vocabulary on tp
        assert d.inputs[1 if d.op == "aten.nll_loss_backward.default" else 0] == ("S(0)", "S(1)"), d


@pytest.mark.parametrize("recipe", ["zero1", "zero2"])
def test_groupnorm_with_zero_state_trains_like_one_device(recipe, runs):
    """Fuzzer seed 2 case 105: the compute copy of a GroupNorm weight gathered from its ZeRO master (one element a
    rank) was a strided view of the all-gather buffer, which ATen's CPU ``native_group_norm`` reads as contiguous."""
    got = _check(runs, f"groupnorm-4-{recipe}")
    from autoshard.plans.plan import Plan

    tensors = [t for t in Plan.from_json(got["plan"]).stages[0].tensors if t.role == "parameter"]
    assert {t.name: t.state_placements for t in tensors if t.zero == recipe}.get("norm.weight") == ("S(0)",)


def test_inputs_drawn_inside_local_tensor_mode_are_refused():
    """Random inputs made inside LocalTensorMode differ per simulated rank: shard_inputs says so, naming the input."""
    make, inputs_fn = MODELS["mlp"]
    with local_ranks(2):
        x, y = inputs_fn()  # inside the mode every rank draws its own batch
        sharded = autoshard.compile(
            make(), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), (x, y), backend="eager"
        )
        with pytest.raises(ValueError, match=r"input\[0\].*simulated ranks \[1\].*before entering LocalTensorMode"):
            sharded.shard_inputs(x, y)
