"""Frozen parameters (issue 44 item 3): a PEFT LoRA model's base weights (``requires_grad=False``) are planned as
frozen: no gradient, no optimizer state (no ZeRO shard of it, no host offload of it), no gradient reduction; the
report and the plan's JSON say which; the runtime keeps no gradient for them and trains the adapters like one device.

Planning runs on a fake 4-rank process group; the numerics run all 4 ranks in one process (LocalTensorMode), two
cases at a time in forked processes, against one device running the same model in the same dtypes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from harness import assert_close_to_reference, case_result, local_ranks, run_two_at_a_time, single_device_reference
from numerics_utils import LR, PARAM_ATOL
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import autoshard
from autoshard.cluster.meshes import fake_world
from autoshard.config import OPTIMIZER_STATE_FACTOR
from autoshard.plans.plan import Plan

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MESH = ((2, 2), ("dp", "tp"))
DP = {"inputs": {"dp": Shard(0)}}
BF16_RTOL, BF16_ATOL = 2e-2, 5e-4  # a few bf16 ulps (2^-8 relative) on gradients of magnitude ~1e-2


def make_lora(base_dtype: torch.dtype = torch.float32, train_all: bool = False, layers: int = 2) -> torch.nn.Module:
    """A stock ``LlamaForCausalLM`` (no download: built from its config) wrapped by ``peft.get_peft_model`` with LoRA
    on q_proj and v_proj; its base weights in ``base_dtype`` and frozen, the adapters fp32 (PEFT's
    ``autocast_adapter_dtype``). ``lora_B`` starts non-zero, so the adapters change the loss from the first step.
    ``train_all``: every parameter trainable, for comparison."""
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).to(base_dtype)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    if train_all:
        model.requires_grad_(True)
    return model


def lora_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(2))
    return {"input_ids": ids, "labels": ids}


def _nbytes(model: torch.nn.Module, frozen: bool) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad != frozen)


def _plan(model: torch.nn.Module, **kw) -> Plan:
    with fake_world(4):
        mesh = init_device_mesh("cpu", *MESH[:1], mesh_dim_names=MESH[1])
        return autoshard.plan(model, mesh, lora_inputs(), constraints=DP, **kw)


def test_lora_plan_prices_frozen_weights_without_gradients_or_optimizer_state(tmp_path) -> None:
    """Under DDP (every tensor whole on every rank) the LoRA plan holds exactly the frozen weights' gradient and
    AdamW state less than the same model trained in full, and at least that much less at its peak (the full
    model's gradient buckets and the activations its weight gradients read are gone too); the only gradient
    reductions are the adapters'; the report, the HTML page and the JSON name the frozen weights."""
    lora, full = make_lora(), make_lora(train_all=True)
    frozen, adapters = _nbytes(lora, frozen=True), _nbytes(lora, frozen=False)
    assert frozen > 50 * adapters
    factor = OPTIMIZER_STATE_FACTOR["adamw"]
    p_lora, p_full = _plan(lora, recipe="ddp"), _plan(full, recipe="ddp")
    m, f = p_lora.peak_memory, p_full.peak_memory
    assert m.parameters == f.parameters
    assert f.gradients - m.gradients == frozen and m.gradients == adapters
    assert f.optimizer - m.optimizer == factor * frozen and m.optimizer == factor * adapters
    assert f.total - m.total >= (1 + factor) * frozen
    reduced = [c for c in p_lora.stages[0].collectives if c.phase == "backward" and c.nbytes]
    trained = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert reduced and {c.consumer for c in reduced} <= trained
    assert sum(c.nbytes for c in reduced) == adapters  # each adapter's gradient all-reduced once, nothing else

    count = sum(1 for p in lora.parameters() if not p.requires_grad)
    assert p_lora.frozen_parameters() == (count, frozen) and p_full.frozen_parameters() == (0, 0)
    tensors = {t.name: t for t in p_lora.stages[0].tensors if t.role == "parameter"}
    assert {n for n, t in tensors.items() if not t.frozen} == trained
    text = autoshard.report(p_lora)
    assert f"frozen: {count} of {len(tensors)} parameters" in text and " frozen " in text
    assert "frozen" not in autoshard.report(p_full)
    autoshard.write_html(p_lora, tmp_path / "plan.html")
    assert "frozen: no gradient, no optimizer state" in (tmp_path / "plan.html").read_text()
    assert Plan.from_json(p_lora.to_json()) == p_lora
    assert "frozen" not in json.loads(p_full.to_json())["stages"][0]["tensors"][0]  # trainable plans read as before


def test_frozen_weights_take_no_zero_shard_or_offload() -> None:
    """ZeRO-2 and forced optimizer offload shard or move the adapters' state only: a frozen weight has none, so no
    recipe note says it kept its state whole; the solved plan's gradients and state are the adapters' at most."""
    lora = make_lora()
    adapters = _nbytes(lora, frozen=False)
    for kw in ({"recipe": "zero2"}, {"offload": "optimizer"}):
        plan = _plan(lora, **kw)
        params = [t for t in plan.stages[0].tensors if t.role == "parameter"]
        assert all(not t.zero and not t.offload for t in params if t.frozen), kw
        assert all(t.zero == "zero2" or t.offload for t in params if not t.frozen), kw
        assert not any("whole optimizer state" in r.note for r in plan.recipes), kw
        assert plan.peak_memory.gradients <= adapters and plan.peak_memory.optimizer <= 2 * adapters
    free = _plan(lora)
    assert free.peak_memory.gradients + free.peak_memory.optimizer <= 3 * adapters


def test_a_frozen_layer_is_not_shared_with_trained_ones() -> None:
    """Layers 1 and 2 of three are trained in full, layer 0 is frozen: the trained layers share their decisions
    with each other, not with the frozen one, so the plan holds gradients for exactly the trained weights."""
    model = make_lora(layers=3, train_all=True)
    model.base_model.model.model.layers[0].requires_grad_(False)
    plan = _plan(model, recipe="ddp")
    assert plan.peak_memory.gradients == _nbytes(model, frozen=False)
    assert plan.solver.shared_layers == 1


# ---------------------------------------------------------------------------------------------- numerics


def _one_device(base_dtype: torch.dtype) -> dict:
    """One device, the same model in the same dtypes (a bf16 base stays bf16), 3 AdamW steps."""
    model = make_lora(base_dtype)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, grads = [], {}
    for step in range(3):
        loss = model(**lora_inputs()).loss
        loss.backward()
        losses.append(float(loss))
        if step == 0:
            grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "losses": losses,
        "grads": grads,
        "params": {n: p.detach().float().clone() for n, p in model.named_parameters()},
    }


def _whole(t: torch.Tensor) -> torch.Tensor:
    from numerics_utils import _full

    return _full(t).float()


def _train(case: str) -> dict:
    """``case`` "fp32" or "bf16" (the base weights' dtype): 3 AdamW steps of the LoRA model compiled on a simulated
    2 x 2 mesh, its one-device run, and what the sharded parameters held."""
    base_dtype = torch.float32 if case == "fp32" else torch.bfloat16
    ref = _one_device(base_dtype)
    inputs = lora_inputs()  # (made outside the simulated ranks: inside, each rank would draw its own)
    with local_ranks(4):
        mesh = init_device_mesh("cpu", MESH[0], mesh_dim_names=MESH[1])
        model = make_lora(base_dtype)
        sharded = autoshard.compile(model, mesh, inputs, constraints=DP)
        opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
        losses, grads = [], {}
        for step in range(3):
            loss = sharded.step(**inputs)
            if step == 0:
                grads = {n: _whole(p.grad) for n, p in sharded.named_parameters() if p.grad is not None}
                no_grad = sorted(n for n, p in sharded.named_parameters() if p.grad is None)
            opt.step()
            opt.zero_grad()
            losses.append(float(_whole(loss)))
        params = {n: _whole(p.data) for n, p in sharded.named_parameters()}
        dtypes = {n: str(p.dtype) for n, p in sharded.named_parameters()}
        state = sorted(n for n, p in sharded.named_parameters() if p in opt.state and opt.state[p])
    frozen = sorted(n for n, p in make_lora(base_dtype).named_parameters() if not p.requires_grad)
    return {
        "ref": ref,
        "losses": losses,
        "grads": grads,
        "params": params,
        "no_grad": no_grad,
        "frozen": frozen,
        "dtypes": dtypes,
        "state": state,
        "plan": sharded.plan.to_json(),
    }


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_two_at_a_time(_train, ["fp32", "bf16"])


def _check_frozen(got: dict) -> None:
    init = got["ref"]["params"]  # (a frozen weight is its initial value after the steps, on one device too)
    assert got["no_grad"] == got["frozen"]  # no gradient on a frozen weight, one on every adapter
    assert not set(got["state"]) & set(got["frozen"])  # nor optimizer state
    for name in got["frozen"]:
        assert torch.equal(got["params"][name], init[name]), name
    assert Plan.from_json(got["plan"]).frozen_parameters()[0] == len(got["frozen"])


def test_lora_adapters_train_like_one_device(runs) -> None:
    got = case_result(runs, "fp32")
    ref = got["ref"]
    reference = single_device_reference(make_lora, lora_inputs(), steps=3, lr=LR)  # (the harness's own run agrees)
    assert reference.losses == pytest.approx(ref["losses"], rel=1e-6)
    assert_close_to_reference(reference, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
    _check_frozen(got)


def test_bf16_base_with_fp32_adapters_plans_and_trains_like_one_device(runs) -> None:
    """The usual fine-tuning setup: base weights bf16 and frozen, adapters and their AdamW state fp32; equal to one
    device running the same dtypes, at bf16 tolerance."""
    got = case_result(runs, "bf16")
    ref = got["ref"]
    assert {got["dtypes"][n] for n in got["frozen"]} == {"torch.bfloat16"}
    assert {d for n, d in got["dtypes"].items() if n not in got["frozen"]} == {"torch.float32"}
    for a, b in zip(got["losses"], ref["losses"]):
        assert math.isclose(a, b, rel_tol=BF16_RTOL, abs_tol=BF16_ATOL), (got["losses"], ref["losses"])
    assert set(got["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=BF16_RTOL, atol=BF16_ATOL, msg=name)
    # AdamW turns bf16-sized gradient differences of near-zero elements into lr-sized steps: each adapter's update
    # over the 3 steps is compared as a whole (within 15% of one device's; measured 0.5-6.5%)
    init = {n: p.detach().float() for n, p in make_lora(torch.bfloat16).named_parameters()}
    for name in ref["grads"]:
        want, have = ref["params"][name] - init[name], got["params"][name] - init[name]
        assert (have - want).norm() <= 0.15 * want.norm(), name
    _check_frozen(got)
    plan = Plan.from_json(got["plan"])
    frozen = [t for t in plan.stages[0].tensors if t.frozen]
    assert {t.dtype for t in frozen} == {"bfloat16"}
    assert plan.frozen_parameters()[1] == sum(2 * math.prod(t.shape) for t in frozen)
