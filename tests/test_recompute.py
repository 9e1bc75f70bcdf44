"""Activation recomputation of chosen modules (``compile(..., recompute=[...])``, passes/recompute.py): the
plan counts the recomputed layers' activations as not saved and their forward twice; the rank's program saves
fewer tensors and replays the layers' forward in the backward; numerics equal to one device on gloo."""

from __future__ import annotations

import autoshard
from autoshard.launch import launch
from harness import assert_close_to_reference, single_device_reference
from numerics_utils import LR, MODELS, PARAM_ATOL, train_sharded


def _program_counts(sharded) -> dict:
    program = sharded._program
    return {"saved": program.n_saved,  # tensors the forward keeps for the backward
            "backward_mm": sum(1 for n in program.bw_gm.graph.nodes if "mm" in str(n.target))}


def _worker(rank: int, world: int, recompute: tuple[str, ...]) -> dict:
    make, inputs_fn = MODELS["gpt"]
    return train_sharded(make, inputs_fn(), (world,), ("dp",), lr=LR, recompute=recompute, backend="eager",
                         probe=_program_counts)


def test_recomputed_layers_save_less_and_train_like_one_device():
    make, inputs_fn = MODELS["gpt"]
    ref = single_device_reference(make, inputs_fn(), steps=3, lr=LR)
    plain, redo = (launch(2, _worker, rc)[0] for rc in ((), ("layers",)))
    for got in (plain, redo):
        assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
    assert redo["saved"] < plain["saved"], (redo["saved"], plain["saved"])
    assert redo["backward_mm"] > plain["backward_mm"]  # the layers' forward matmuls run again in the backward
    p, r = (autoshard.Plan.from_json(g["plan"]) for g in (plain, redo))
    assert r.peak_memory.activations < p.peak_memory.activations / 2
    assert r.step_time_s > p.step_time_s


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
    assert "activation recomputation" in plan.report()
    assert not autoshard.Plan.from_json(free["plan"]).recompute  # a budget that does not bind: no recomputation
