"""The plan's predicted peak memory per device against the peak measured on 2 gloo ranks (memory_probe).

Eager backend (the Inductor rows are in benchmarks/memory_truth.py); a small GPT trained with AdamW, the plan
solved freely and under ZeRO-2: predicted / measured within ±10% on every rank; under a budget: the measured
peak within the budget (the prediction of such a mixed plan may be high by up to a quarter, low by at most 10%)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.testing.launch import launch
from autoshard.testing.memory_probe import measure_peak

# benchmarks/memory_truth.py's GPT: big enough that the step's tensors, not allocator slack, make its peak
CFG = GPTConfig(n_layer=2, d_model=256, n_head=4, vocab=2048, seq_len=128, mlp_ratio=4, bias=False)


def _worker(rank: int, world: int, kw: dict) -> tuple[int, int, int, str]:
    torch.manual_seed(0)
    inputs = gpt_example_inputs(CFG, 8)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sharded = autoshard.compile(GPT(CFG), mesh, inputs, backend="eager", **kw)
    pieces = sharded.shard_inputs(*inputs)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3, foreach=True)

    def step() -> None:
        sharded(*pieces).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    held = sum(getattr(t, "_local_tensor", t).nbytes for t in sharded.parameters()) + sum(  # (DTensor or plain)
        getattr(v, "_local_tensor", v).nbytes
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    peak = measure_peak(step, attempts=1, baseline=lambda: held + sum(p.nbytes for p in pieces))
    return sharded.plan.peak_memory.total, peak.peak_bytes, sharded.plan.memory_budget_bytes, peak.method


@pytest.mark.parametrize(
    "kw",
    [{}, {"recipe": "zero2"}, {"recompute": ("layers",)}, {"memory_budget": "budget"}],
    ids=["solved", "zero2", "recompute", "budget"],
)
def test_predicted_peak_within_10_percent_of_measured(kw):
    if kw.get("memory_budget") == "budget":  # about 90% of the free plan's predicted peak (64.5 MiB)
        kw = {"memory_budget": "58MiB"}
    results = launch(2, _worker, kw)
    if any(r[3] != "timeline" for r in results):
        # the profiler's memory pass sometimes fails on a foreach op ("duplicate outputs"; memory_probe falls back
        # to the allocator's events, a coarser count): measure again, on every rank alike
        results = launch(2, _worker, kw)
    for predicted, measured, budget, _ in results:
        if budget:  # the budget is honoured when measured; a mixed plan's prediction is high (1.19 seen) or close
            assert measured <= budget and 0.9 <= predicted / measured <= 1.25, (predicted, measured, budget)
        else:
            assert 0.9 <= predicted / measured <= 1.1, (predicted, measured)


def test_inductor_concatenates_by_copy():
    """Inductor compiles a ``cat`` as a copy, as the traced graph and the memory model have it (issue 45 item 7):
    by default its producers write into the concatenated buffer in place, and in the backward, where the gradient
    buckets concatenate every layer's bias gradient, that held each layer's activation gradients to the end of the
    backward (a stock 4-layer GPT-2, dp=2: its own buffers peaked at 37.9 MiB against 26.6 MiB)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard import _torch_compat as tc

    def two_layers(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = torch.tanh(x) * 2.0
        t1 = torch.tanh(t0 @ w0) * 2.0
        return torch.cat([t0.sum(0), t1.sum(0)]), t1 @ w1  # (the bias gradients' bucket, the next layer's)

    args = [torch.randn(64, 32), torch.randn(32, 32), torch.randn(32, 32)]
    run = tc.inductor_compile(make_fx(two_layers)(*args), args)
    assert "# alias" not in run.source_code  # no producer writes into a slice of the cat's buffer
    for got, want in zip(run(list(args)), two_layers(*args)):
        torch.testing.assert_close(got, want)
