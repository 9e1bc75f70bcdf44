"""Mixed precision: ``compile(..., mixed_precision="bf16")`` runs the step in bf16 on casts of the fp32 master
weights; the gradients and optimizer state stay fp32, and gradients are reduced in fp32 (or bf16 with
``reduce_dtype="bf16"``). Two policies: ``precision_policy="params"`` (the default; FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16)``: every parameter cast, the whole step in bf16) and ``"autocast"``
(``torch.autocast``: bf16 matmuls, the other ops in fp32).

Numerics are compared with the single-device run under the same policy (``torch.autocast("cpu", torch.bfloat16)``,
or a bf16 copy of the model whose fp32 gradients step the fp32 masters), at bf16 tolerance; and the losses must sit
closer to that run than to the fp32 one, so a step that silently ran in fp32 (or in the other policy) fails."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from harness import assert_close_to_reference, single_device_reference
from numerics_utils import LR, MODELS, train_sharded
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.cluster.meshes import fake_world
from autoshard.cluster.presets import get_cluster
from autoshard.compiler.lower import trace_rank_program
from autoshard.config import PlanConfig
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.plans.plan import Plan
from autoshard.plans.report import report
from autoshard.search.recompute import plan_graph
from autoshard.testing.launch import launch

BF16_RTOL, BF16_ATOL = 2e-2, 5e-4  # a few bf16 ulps (2^-8 relative) on gradients of magnitude ~1e-2
# bf16 parameters: the backward itself runs in bf16, so a bias gradient (a sum over the batch's tokens) is rounded
# at 2^-8 of partial sums that reach ~0.3 here, and the two ranks' summation order differs from one device's
PARAMS_ATOL = 2e-3


def _collective_dtypes(gm: torch.fx.GraphModule) -> dict[str, set[torch.dtype]]:
    out: dict[str, set[torch.dtype]] = {}
    for n in gm.graph.nodes:
        name = str(n.target)
        if n.op == "call_function" and "_c10d_functional" in name and "wait_tensor" not in name:
            out.setdefault(name.split(".")[-2], set()).add(n.args[0].meta["val"].dtype)
    return out


def _saved_bytes(gm: torch.fx.GraphModule) -> dict[torch.dtype, int]:
    """Bytes per dtype of the forward's floating tensors that the backward reads."""
    out: dict[torch.dtype, int] = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if (
            n.op == "call_function"
            and n.meta.get("autoshard_phase") == "forward"
            and isinstance(v, torch.Tensor)
            and v.is_floating_point()
            and any(u.meta.get("autoshard_phase") == "backward" for u in n.users)
        ):
            out[v.dtype] = out.get(v.dtype, 0) + v.numel() * v.element_size()
    return out


def test_fsdp_gathers_bf16_weights_and_reduces_fp32_gradients() -> None:
    """The bf16 cast of a sharded weight runs on its shard, so FSDP gathers half the bytes; the gradients are
    reduce-scattered in fp32 unless ``reduce_dtype`` says bf16; costs and the plan record it."""
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, seq_len=16, bias=False)
    got = {}
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        for mp, red in ((None, "float32"), ("bf16", "float32"), ("bf16", "bf16")):
            torch.manual_seed(0)
            config = PlanConfig(recipe="fsdp", mixed_precision=mp, reduce_dtype=red, precision_policy="autocast")
            planned = plan_graph(GPT(cfg), gpt_example_inputs(cfg, 8), mesh, get_cluster("cpu"), config)
            plan, gm, ctx = planned.plan, planned.graph, planned.ctx
            got[(mp, red)] = (plan, _collective_dtypes(trace_rank_program(gm, ctx)))
    fp32, (mixed, dtypes), (low, low_dtypes) = got[(None, "float32")], got[("bf16", "float32")], got[("bf16", "bf16")]
    assert fp32[1]["all_gather_into_tensor"] == {torch.float32}
    assert torch.bfloat16 in dtypes["all_gather_into_tensor"]  # the weights (norm weights are not cast: fp32)
    assert dtypes["reduce_scatter_tensor"] == {torch.float32}
    assert torch.bfloat16 in low_dtypes["reduce_scatter_tensor"]
    # half the bytes gathered and saved: cheaper and smaller than the fp32 plan; bf16 reduction cheaper still
    assert mixed.peak_memory.activations < fp32[0].peak_memory.activations
    assert mixed.peak_memory.parameters == fp32[0].peak_memory.parameters  # fp32 masters
    assert low.step_time_s < mixed.step_time_s
    assert (mixed.mixed_precision, mixed.reduce_dtype, low.reduce_dtype) == ("bfloat16", "float32", "bfloat16")
    assert Plan.from_json(mixed.to_json()) == mixed
    assert "mixed precision: autocast to bfloat16" in report(mixed) and "reduced in float32" in report(mixed)
    assert "mixed precision" not in report(fp32[0])


def test_bf16_parameters_run_the_whole_step_in_bf16() -> None:
    """Under the default policy every weight (norms' too) is cast on its shard and gathered in bf16, the
    activations the backward keeps are bf16 (fewer bytes than autocast's fp32 residual stream), gradients are
    still reduce-scattered in fp32, each cast sits in its layer next to its first reader, and the plan says so."""
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, seq_len=16, bias=False)
    got = {}
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        for policy in ("autocast", "params"):
            config = PlanConfig(recipe="fsdp", mixed_precision="bf16", precision_policy=policy)
            planned = plan_graph(GPT(cfg), gpt_example_inputs(cfg, 8), mesh, get_cluster("cpu"), config)
            got[policy] = planned
        dtypes = _collective_dtypes(trace_rank_program(got["params"].graph, got["params"].ctx))
    params, auto = got["params"], got["autocast"]
    assert dtypes["all_gather_into_tensor"] == {torch.bfloat16}  # every gathered weight, norms' included
    assert dtypes["reduce_scatter_tensor"] == {torch.float32}
    assert params.plan.peak_memory.activations < auto.plan.peak_memory.activations
    low, high = _saved_bytes(params.graph), _saved_bytes(auto.graph)
    assert low.get(torch.float32, 0) < 0.02 * sum(low.values())  # bf16 activations (fp32 only norms' statistics)
    assert high.get(torch.float32, 0) > 0.2 * sum(high.values())  # autocast's fp32 residual stream and softmax
    assert params.plan.peak_memory.parameters == auto.plan.peak_memory.parameters  # fp32 masters either way
    gm = params.graph
    casts = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.meta.get("autoshard_phase") == "forward"
        and n.args
        and isinstance(n.args[0], torch.fx.Node)
        and n.args[0].op == "placeholder"
        and n.args[0].meta["autoshard_role"].kind == "parameter"
        and getattr(n.meta.get("val"), "dtype", None) == torch.bfloat16
    ]
    assert len(casts) == sum(
        1 for n in gm.graph.find_nodes(op="placeholder") if n.meta["autoshard_role"].kind == "parameter"
    )
    for c in casts:  # next to its first reader, in its module
        first = next(iter(c.users)) if len(c.users) == 1 else None
        assert c.next in c.users and c.meta["autoshard_module"] == c.next.meta["autoshard_module"]
        if first is not None and c.args[0].meta["autoshard_role"].name.startswith("blocks."):
            assert c.meta["autoshard_module"].startswith("blocks.")
    plan = params.plan
    assert (plan.mixed_precision, plan.precision_policy) == ("bfloat16", "params")
    assert Plan.from_json(plan.to_json()) == plan
    assert "mixed precision: bfloat16 parameters" in report(plan)
    assert auto.plan.precision_policy == "autocast"
    with pytest.raises(autoshard.InputError, match="precision_policy='fp8'.*'params'.*'autocast'"):
        PlanConfig(mixed_precision="bf16", precision_policy="fp8")


def test_bf16_matmuls_are_costed_at_the_bf16_rate() -> None:
    """On an H100 profile (bf16 peak ~15x fp32's) a compute-bound model's predicted step drops under mixed
    precision; on the same model in fp32 nothing changes but the flag."""
    cfg = GPTConfig(n_layer=2, d_model=1024, n_head=8, vocab=512, seq_len=256, bias=False)
    with torch.device("meta"):
        model = GPT(cfg)
    with fake_world(8):
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
        fp32 = autoshard.plan(model, mesh, gpt_example_inputs(cfg, 32), cluster="h100-sxm", recipe="ddp")
        mixed = autoshard.plan(
            model, mesh, gpt_example_inputs(cfg, 32), cluster="h100-sxm", recipe="ddp", mixed_precision="bf16"
        )
    assert mixed.stages[0].compute_s < 0.5 * fp32.stages[0].compute_s


def _assert_params_close(
    ref: dict[str, torch.Tensor],
    got: dict[str, torch.Tensor],
    most: float = 2.5,
    share: float = 0.01,
    grads: dict[str, torch.Tensor] | None = None,
) -> None:
    """Parameters after the AdamW steps: AdamW turns a last-bit difference in a near-zero gradient element into
    an lr-sized step, so a few elements per tensor may be up to ``most`` lr apart; all but ``share`` of them must be
    within lr / 10. With ``grads`` (the reference's first-step gradients), elements whose gradient is below bf16's
    rounding of its tensor's largest (2^-8 of it: a sign that is rounding, such as GPT-2's key biases, whose gradient
    is zero but for rounding since softmax ignores them) are left out."""
    for name, want in ref.items():
        diff = (got[name] - want).abs()
        if grads is not None and name in grads:
            g = grads[name].abs()
            diff = diff[g > g.max() * 2**-8]
        assert diff.max() <= most * LR, f"{name}: max abs diff {diff.max():.3e} > {most} lr"
        off = (diff > LR / 10).float().mean().item()
        assert off <= max(share, 2 / want.numel()), (
            f"{name}: {off:.1%} of elements more than lr / 10 from the reference"
        )


def _worker(rank: int, world: int, arg: None) -> list[dict]:
    from autoshard.models.hf import build

    make, inputs_fn = MODELS["gpt"]
    out = [
        train_sharded(
            make,
            inputs_fn(),
            (world,),
            ("dp",),
            lr=LR,
            backend="eager",
            recipe="fsdp",
            mixed_precision="bf16",
            precision_policy="autocast",
        )
    ]
    _, batch = build("gpt2", dropout=False, layers=1)
    # a stock transformers model, the solved plan, gradients all-reduced in bf16
    out.append(
        train_sharded(
            lambda: build("gpt2", dropout=False, layers=1)[0],
            batch,
            (world,),
            ("dp",),
            lr=LR,
            mixed_precision="bf16",
            reduce_dtype="bf16",
            backend="eager",
            precision_policy="autocast",
        )
    )
    # the default policy (bf16 parameters): the zoo GPT under fsdp, and stock GPT-2 solved, under Inductor
    out.append(
        train_sharded(
            make, inputs_fn(), (world,), ("dp",), lr=LR, backend="eager", recipe="fsdp", mixed_precision="bf16"
        )
    )
    out.append(
        train_sharded(
            lambda: build("gpt2", dropout=False, layers=1)[0], batch, (world,), ("dp",), lr=LR, mixed_precision="bf16"
        )
    )
    return out


def test_gloo_bf16_matches_single_device_autocast() -> None:
    pytest.importorskip("transformers")
    from autoshard.models.hf import build

    results = launch(2, _worker, None)
    make, inputs_fn = MODELS["gpt"]
    ref = single_device_reference(make, inputs_fn(), steps=3, lr=LR, autocast=torch.bfloat16)
    ref32 = single_device_reference(make, inputs_fn(), steps=3, lr=LR)
    _, batch = build("gpt2", dropout=False, layers=1)
    hf = single_device_reference(
        lambda: build("gpt2", dropout=False, layers=1)[0], batch, steps=3, lr=LR, autocast=torch.bfloat16
    )
    for got in results[0][:1]:
        assert_close_to_reference(
            replace(ref, params={}), got["losses"], got["grads"], {}, rtol=BF16_RTOL, atol=BF16_ATOL
        )
        _assert_params_close(ref.params, got["params"])
        # the step ran in bf16: its first loss is the autocast run's, not the fp32 run's
        assert abs(got["losses"][0] - ref.losses[0]) < abs(ref32.losses[0] - ref.losses[0]) / 4
        assert all(g.dtype == torch.float32 for g in got["grads"].values())
    got = results[0][1]
    assert_close_to_reference(replace(hf, params={}), got["losses"], got["grads"], {}, rtol=BF16_RTOL, atol=BF16_ATOL)
    _assert_params_close(hf.params, got["params"])
    assert Plan.from_json(got["plan"]).mixed_precision == "bfloat16"
    # bf16 parameters: against one device running the same policy
    low = single_device_reference(make, inputs_fn(), steps=3, lr=LR, param_dtype=torch.bfloat16)
    hf_low = single_device_reference(
        lambda: build("gpt2", dropout=False, layers=1)[0], batch, steps=3, lr=LR, param_dtype=torch.bfloat16
    )
    for got, want in ((results[0][2], low), (results[0][3], hf_low)):
        assert_close_to_reference(
            replace(want, params={}), got["losses"], got["grads"], {}, rtol=BF16_RTOL, atol=PARAMS_ATOL
        )
        # gradients computed in bf16 have more near-zero elements whose sign is rounding: AdamW moves each of
        # them by up to lr per step either way (3 steps: at most 6 lr apart)
        _assert_params_close(want.params, got["params"], most=6.0, share=0.02, grads=want.grads)
        # (the two policies' first losses differ by ~1e-4 on these one-layer models, too little to tell them apart
        # here: test_bf16_parameters_run_the_whole_step_in_bf16 checks the program's dtypes)
        assert all(g.dtype == torch.float32 for g in got["grads"].values())
        assert Plan.from_json(got["plan"]).precision_policy == "params"


def _pipelined_worker(rank: int, world: int, arg: None) -> dict:
    from autoshard.models.hf import build

    return train_sharded(
        lambda: build("llama", dropout=False, layers=4, batch=4)[0],
        build("llama", dropout=False, layers=4, batch=4)[1],
        (world,),
        ("pp",),
        lr=LR,
        backend="eager",
        mixed_precision="bf16",
        schedule="1F1B",
        microbatches=2,
    )


def test_pipeline_stages_run_bf16_parameters() -> None:
    """Pipeline stages under the default policy: the stages are split from a trace on bf16 parameters (so the
    model's dtype decisions are bf16's) and each stage's program casts its fp32 masters; a stock HF Llama in 2
    stages trains within bf16 tolerance of one device running a bf16 copy of the model."""
    pytest.importorskip("transformers")
    from autoshard.models.hf import build

    results = launch(2, _pipelined_worker, None)
    ref = single_device_reference(
        lambda: build("llama", dropout=False, layers=4, batch=4)[0],
        build("llama", dropout=False, layers=4, batch=4)[1],
        steps=3,
        lr=LR,
        param_dtype=torch.bfloat16,
    )
    held = set()
    for got in results:
        names = set(got["grads"])
        held |= names
        want = replace(ref, grads={n: g for n, g in ref.grads.items() if n in names}, params={})
        # (micro-batches sum their losses in another order than the whole batch: a few bf16 ulps of the loss)
        assert_close_to_reference(want, got["losses"], got["grads"], {}, rtol=BF16_RTOL, atol=PARAMS_ATOL)
        assert all(g.dtype == torch.float32 for g in got["grads"].values())
        plan = Plan.from_json(got["plan"])
        assert (plan.mixed_precision, plan.precision_policy, len(plan.stages)) == ("bfloat16", "params", 2)
    assert held == set(ref.grads)
