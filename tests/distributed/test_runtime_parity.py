"""Issue 14's runtime parity: the lowered program of a DDP plan runs what DistributedDataParallel runs (the
gradient buckets, nothing else in the backward), its parameters are plain tensors, and the plan prices a bucketed
gradient's latency once per bucket."""

from __future__ import annotations

import pytest
import torch
from harness import assert_close_to_reference, single_device_reference
from numerics_utils import LR, MODELS, PARAM_ATOL, train_sharded
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.buckets import bucket_starts
from autoshard.cluster.meshes import fake_world
from autoshard.cluster.presets import get_cluster
from autoshard.compiler.lower import collective_counts
from autoshard.cost.comm import collective_time
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.testing.launch import launch

CFG = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, seq_len=16)


def test_bucket_starts_fill_the_small_first_bucket_then_the_large_ones() -> None:
    assert bucket_starts([6, 6, 6, 6, 6], first=10, limit=12) == [0, 1, 3]
    assert bucket_starts([30, 1], first=10, limit=20) == [0, 1]  # too big for a bucket: one of its own
    assert bucket_starts([]) == []


def test_bundled_links_have_no_latency_and_the_same_bandwidth() -> None:
    c = get_cluster("a100-80gb:2x8")
    b = c.bundled()
    assert b.intra_node.latency == b.inter_node.latency == 0.0
    assert (b.intra_node.bandwidth, b.inter_node.bandwidth) == (c.intra_node.bandwidth, c.inter_node.bandwidth)


def test_a_ddp_plan_pays_one_latency_per_bucket_not_per_gradient() -> None:
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        plan = autoshard.plan(
            GPT(CFG), mesh, gpt_example_inputs(CFG, 4), recipe="ddp", cluster="cpu", solve_recipes=False
        )
    params = {t.name for t in plan.stages[0].tensors if t.role == "parameter"}
    grads = [c for c in plan.stages[0].collectives if c.consumer in params and c.kind == "all_reduce"]
    buckets = [c for c in grads if c.tensor.startswith("bucket of")]
    members = [c for c in grads if not c.tensor.startswith("bucket of")]
    assert len(buckets) == 1 and buckets[0].nbytes == 0 and buckets[0].time_s > 0  # the whole model: one bucket
    assert len(members) == len(params)  # every gradient, priced at its bytes
    link = get_cluster("cpu").intra_node
    for c in members:  # bytes only
        assert c.time_s == pytest.approx(
            collective_time("all_reduce", c.nbytes, 2, get_cluster("cpu").bundled().intra_node)
        )
    assert buckets[0].time_s == pytest.approx(collective_time("all_reduce", 0, 2, link))  # the latency, once
    assert buckets[0].tensor == f"bucket of {len(members)} gradients"


def _ddp_worker(rank: int, world: int, parameters: str) -> dict:
    make, inputs_fn = MODELS["gpt"]
    probe = lambda s: {  # noqa: E731
        "fw": collective_counts(s._program.fw_gm),
        "bw": collective_counts(s._program.bw_gm),
        "plain": all(type(p) is torch.nn.Parameter and not hasattr(p, "_local_tensor") for p in s.parameters()),
    }
    return train_sharded(
        make, inputs_fn(), (2,), ("dp",), lr=LR, recipe="ddp", backend="eager", parameters=parameters, probe=probe
    )


@pytest.mark.parametrize("parameters", ["auto", "dtensor"])
def test_ddp_backward_runs_only_the_gradient_buckets_and_trains_like_one_device(parameters: str) -> None:
    """The loss's token count is all-reduced once, in the forward (it was again, twice, in the backward); the
    backward runs DDP's bucket all-reduces and nothing else. ``parameters="auto"`` keeps plain tensors for this
    all-replicated plan; both forms train like one device."""
    results = launch(2, _ddp_worker, parameters)
    make, inputs_fn = MODELS["gpt"]
    ref = single_device_reference(make, inputs_fn(), steps=3, lr=LR)
    for got in results:
        assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
        assert got["fw"] == {"all_reduce": 2}  # the token count, then the loss
        assert set(got["bw"]) == {"all_reduce"} and got["bw"]["all_reduce"] <= 2  # the buckets (first 1 MiB)
        assert got["plain"] == (parameters == "auto")
