"""Layer 4a: numerics against the single-device run, all ranks simulated in one process (LocalTensorMode).

Loss, every gradient and the parameters after 3 AdamW steps, fp32, tight tolerance."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import autoshard

from harness import assert_close_to_reference, local_ranks, single_device_reference
from numerics_utils import LR, MODELS, PARAM_ATOL, train_sharded

def _check(name: str, shape: tuple[int, ...], names: tuple[str, ...], **kw) -> dict:
    make, inputs_fn = MODELS[name]
    inputs = inputs_fn()
    ref = single_device_reference(make, inputs, steps=3, lr=LR)
    n = 1
    for s in shape:
        n *= s
    with local_ranks(n):
        got = train_sharded(make, inputs, shape, names, lr=LR, **kw)
    assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
    return got


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_mesh_2x4_batch_on_dp(name):
    _check(name, (2, 4), ("dp", "tp"), constraints={"inputs": {"dp": Shard(0)}})


def test_mesh_2x2_zero2_state_sharded_over_both_axes():
    got = _check("gpt", (2, 2), ("dp", "tp"), recipe="zero2")
    from autoshard.plan import Plan

    tensors = [t for t in Plan.from_json(got["plan"]).stages[0].tensors if t.role == "parameter"]
    assert {t.state_placements for t in tensors if t.zero} == {("S(0)", "S(0)")}
    assert {t.zero for t in tensors} == {"zero2"}


def test_mesh_8_gpt_fsdp_like_budget():
    # a budget that forces sharded parameters on 8 simulated ranks
    got = _check("gpt", (8,), ("dp",), constraints={"inputs": {"dp": Shard(0)}}, memory_budget="600KiB")
    from autoshard.plan import Plan

    placements = Plan.from_json(got["plan"]).parameter_placements()
    assert any(p != ("R",) for p in placements.values())


def test_inputs_drawn_inside_local_tensor_mode_are_refused():
    """Random inputs made inside LocalTensorMode differ per simulated rank: shard_inputs says so, naming the input."""
    make, inputs_fn = MODELS["mlp"]
    with local_ranks(2):
        x, y = inputs_fn()  # inside the mode every rank draws its own batch
        sharded = autoshard.compile(make(), init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), (x, y), backend="eager")
        with pytest.raises(ValueError, match=r"input\[0\].*simulated ranks \[1\].*before entering LocalTensorMode"):
            sharded.shard_inputs(x, y)
