"""Mixed precision (issue 13 part 3): ``compile(..., mixed_precision="bf16")`` traces the step under
``torch.autocast`` so matmuls run on bf16 copies of the fp32 master weights, the gradients and optimizer state stay
fp32, and gradients are reduced in fp32 (or bf16 with ``reduce_dtype="bf16"``).

Numerics are compared with the single-device run under ``torch.autocast("cpu", torch.bfloat16)`` (the reference
mixed-precision users have), at bf16 tolerance; and the losses must sit closer to that run than to the fp32 one,
so a step that silently ran in fp32 fails."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.cluster.presets import get_cluster
from autoshard.config import PlanConfig
from autoshard.testing.launch import launch
from autoshard.cluster.meshes import fake_world
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.compiler.lower import trace_rank_program
from autoshard.plans.plan import Plan
from autoshard.search.recompute import plan_graph
from autoshard.plans.report import report

from harness import assert_close_to_reference, single_device_reference
from numerics_utils import LR, MODELS, train_sharded

BF16_RTOL, BF16_ATOL = 2e-2, 5e-4  # a few bf16 ulps (2^-8 relative) on gradients of magnitude ~1e-2


def _collective_dtypes(gm: torch.fx.GraphModule) -> dict[str, set[torch.dtype]]:
    out: dict[str, set[torch.dtype]] = {}
    for n in gm.graph.nodes:
        name = str(n.target)
        if n.op == "call_function" and "_c10d_functional" in name and "wait_tensor" not in name:
            out.setdefault(name.split(".")[-2], set()).add(n.args[0].meta["val"].dtype)
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
            config = PlanConfig(recipe="fsdp", mixed_precision=mp, reduce_dtype=red)
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


def test_bf16_matmuls_are_costed_at_the_bf16_rate() -> None:
    """On an H100 profile (bf16 peak ~15x fp32's) a compute-bound model's predicted step drops under mixed
    precision; on the same model in fp32 nothing changes but the flag."""
    cfg = GPTConfig(n_layer=2, d_model=1024, n_head=8, vocab=512, seq_len=256, bias=False)
    with torch.device("meta"):
        model = GPT(cfg)
    with fake_world(8):
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
        fp32 = autoshard.plan(model, mesh, gpt_example_inputs(cfg, 32), cluster="h100-sxm", recipe="ddp")
        mixed = autoshard.plan(model, mesh, gpt_example_inputs(cfg, 32), cluster="h100-sxm", recipe="ddp",
                               mixed_precision="bf16")
    assert mixed.stages[0].compute_s < 0.5 * fp32.stages[0].compute_s


def _assert_params_close(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    """Parameters after the AdamW steps: AdamW turns a last-bit difference in a near-zero gradient element into
    an lr-sized step, so a few elements per tensor may be up to 2 lr apart; all but 1% must be within lr / 10."""
    for name, want in ref.items():
        diff = (got[name] - want).abs()
        assert diff.max() <= 2.5 * LR, f"{name}: max abs diff {diff.max():.3e} > 2.5 lr"
        off = (diff > LR / 10).float().mean().item()
        assert off <= max(0.01, 2 / want.numel()), f"{name}: {off:.1%} of elements more than lr / 10 from the reference"


def _worker(rank: int, world: int, arg: None) -> list[dict]:
    from autoshard.models.hf import build

    make, inputs_fn = MODELS["gpt"]
    out = [train_sharded(make, inputs_fn(), (world,), ("dp",), lr=LR, backend="eager", recipe="fsdp",
                         mixed_precision="bf16")]
    _, batch = build("gpt2", dropout=False, layers=1)
    # a stock transformers model, the solved plan, gradients all-reduced in bf16
    out.append(train_sharded(lambda: build("gpt2", dropout=False, layers=1)[0], batch, (world,), ("dp",), lr=LR,
                             mixed_precision="bf16", reduce_dtype="bf16", backend="eager"))
    return out


def test_gloo_bf16_matches_single_device_autocast() -> None:
    pytest.importorskip("transformers")
    from autoshard.models.hf import build

    results = launch(2, _worker, None)
    make, inputs_fn = MODELS["gpt"]
    ref = single_device_reference(make, inputs_fn(), steps=3, lr=LR, autocast=torch.bfloat16)
    ref32 = single_device_reference(make, inputs_fn(), steps=3, lr=LR)
    _, batch = build("gpt2", dropout=False, layers=1)
    hf = single_device_reference(lambda: build("gpt2", dropout=False, layers=1)[0], batch, steps=3, lr=LR,
                                 autocast=torch.bfloat16)
    for got in results[0][:1]:
        assert_close_to_reference(replace(ref, params={}), got["losses"], got["grads"], {}, rtol=BF16_RTOL,
                                  atol=BF16_ATOL)
        _assert_params_close(ref.params, got["params"])
        # the step ran in bf16: its first loss is the autocast run's, not the fp32 run's
        assert abs(got["losses"][0] - ref.losses[0]) < abs(ref32.losses[0] - ref.losses[0]) / 4
        assert all(g.dtype == torch.float32 for g in got["grads"].values())
    got = results[0][1]
    assert_close_to_reference(replace(hf, params={}), got["losses"], got["grads"], {}, rtol=BF16_RTOL, atol=BF16_ATOL)
    _assert_params_close(hf.params, got["params"])
    assert Plan.from_json(got["plan"]).mixed_precision == "bfloat16"
