"""Stock Hugging Face models, built and called as their users do, through ``autoshard.compile``.

Every architecture of ``autoshard.models.hf.TINY`` (default config class, default attention, ``use_cache``
left on, tied embeddings as configured) trains 3 AdamW steps on 4 simulated ranks (LocalTensorMode, mesh
dp=2 x tp=2) with a left-padded attention mask, and its loss, every gradient and every parameter after the
steps equal the single-device run. The front door's errors are checked here too."""

from __future__ import annotations

import pytest
import torch
from harness import (
    assert_close_to_reference,
    case_result,
    local_ranks,
    run_two_at_a_time,
    selected_cases,
    single_device_reference,
)
from numerics_utils import LR, PARAM_ATOL, train_sharded
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autoshard

pytest.importorskip("transformers")

from autoshard.models.hf import TINY, build  # noqa: E402


def _make(name: str):
    return lambda: build(name, dropout=False)[0]


# The LocalTensorMode runs below take one core each (the planner and the simulated ranks are single-threaded
# Python); on the suite's 2-core machine they run two at a time in forked processes (harness.run_two_at_a_time:
# no process group, each child simulates its 4 ranks with LocalTensorMode), and each test checks its own case.
SOLVED_LLAMA = "solved-llama"
MIXTRAL_EP = "mixtral-ep"
COST = {
    MIXTRAL_EP: 4.0,
    "t5": 12,
    "gemma": 7.6,
    "bert": 7.2,
    "mixtral": 6.5,
    "mistral": 5.9,
    "qwen2": 5.5,
    "llama": 5.0,
    "phi3": 4.4,
    "vit": 4.4,
    SOLVED_LLAMA: 4.0,
    "gpt2": 3.9,
}  # seconds on the idle 2-core machine, one thread


def _run_case(case: str) -> tuple:
    """One case: the single-device reference, the 4 simulated ranks' run, and whether the batch is padded."""
    if case == MIXTRAL_EP:  # the ep recipe: experts sharded over 4 ranks, the dense part data-parallel
        _, batch = build("mixtral", dropout=False)
        ref = single_device_reference(_make("mixtral"), batch, steps=2, lr=LR)
        with local_ranks(4):
            got = train_sharded(_make("mixtral"), batch, (4,), ("dp",), steps=2, lr=LR, recipe="ep")
    elif case == SOLVED_LLAMA:  # the solver's own plan (no recipe, no constraints), padded batch, 2 steps
        _, batch = build("llama", dropout=False, batch=8)
        ref = single_device_reference(_make("llama"), batch, steps=2, lr=LR)
        with local_ranks(4):
            got = train_sharded(_make("llama"), batch, (2, 2), ("dp", "tp"), steps=2, lr=LR)
    else:  # parameters sharded on both axes (the fsdp+tp recipe: FSDP over dp, Megatron TP over tp)
        _, batch = build(case, dropout=False)
        ref = single_device_reference(_make(case), batch, steps=3, lr=LR)
        with local_ranks(4):
            got = train_sharded(_make(case), batch, (2, 2), ("dp", "tp"), lr=LR, recipe="fsdp+tp")
    return ref, got, "attention_mask" not in batch or bool((batch["attention_mask"] == 0).any())


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> dict[str, dict]:
    """Every case this session selected (``-k`` aware), two at a time."""
    cases = selected_cases(request, "test_stock_model_trains_like_one_device", "name")
    if any(
        item.module is request.module and item.originalname == "test_solved_plan_on_a_padded_llama_batch"
        for item in request.session.items
    ):
        cases.append(SOLVED_LLAMA)
    if any(
        item.module is request.module and item.originalname == "test_stock_mixtral_with_experts_sharded"
        for item in request.session.items
    ):
        cases.append(MIXTRAL_EP)
    return run_two_at_a_time(_run_case, cases, cost=COST)


def _result(runs: dict[str, dict], case: str) -> tuple:
    return case_result(runs, case)


@pytest.mark.parametrize("name", sorted(TINY))
def test_stock_model_trains_like_one_device(name: str, runs: dict[str, dict]) -> None:
    """Parameters sharded on both axes (the fsdp+tp recipe: FSDP over dp, Megatron TP over tp, batch on dp)."""
    ref, got, padded = _result(runs, name)
    assert padded  # real padding
    placements = autoshard.Plan.from_json(got["plan"]).parameter_placements()
    assert any("S(" in str(p) for p in placements.values()), "the recipe left every parameter whole"
    assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], atol=2e-5, param_atol=PARAM_ATOL)


def test_solved_plan_on_a_padded_llama_batch(runs: dict[str, dict]) -> None:
    """The solver's own plan (no recipe, no constraints), keyword call, padded batch: equal to one device."""
    ref, got, _ = _result(runs, SOLVED_LLAMA)
    assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], atol=2e-5, param_atol=PARAM_ATOL)


def test_call_must_match_the_traced_call() -> None:
    model, batch = build("gpt2", dropout=False)
    with local_ranks(2):
        sharded = autoshard.compile(model, init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), batch)
        pieces = sharded.shard_inputs(**batch)
        assert isinstance(pieces, dict) and set(pieces) == set(batch)
        with pytest.raises(TypeError, match=r"not shaped like the traced call.*input_ids"):
            sharded(pieces["input_ids"], pieces["attention_mask"], pieces["labels"])
        with pytest.raises(ValueError, match=r"labels \(input\[2\]\): expected this rank's local piece"):
            sharded(**sharded.shard_inputs(**{**batch, "labels": batch["labels"][:, :4]}))


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:  # a Python branch on a tensor's value
            h = h * 2
        return h.square().mean()


def test_data_dependent_branch_names_the_op_and_the_line() -> None:
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(RuntimeError, match=r"_local_scalar_dense.*test_hf_models\.py:\d+ `if h\.sum\(\) > 0:"):
            autoshard.plan(_Branchy(), mesh, (torch.randn(4, 8),))


def test_model_output_without_a_loss_says_what_to_pass() -> None:
    model, batch = build("gpt2", dropout=False)
    del batch["labels"]
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(
            ValueError, match=r"CausalLMOutputWithCrossAttentions whose loss is None.*labels=.*loss_fn="
        ):
            autoshard.plan(model, mesh, batch)


class _DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"pred": self.fc(x), "err": (self.fc(x) - y).square().mean()}


def test_loss_fn_picks_the_loss_from_a_dict() -> None:
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    torch.manual_seed(0)
    model = _DictOut()
    want = model(x, y)["err"]
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(TypeError, match=r"loss_fn= must pick it"):
            autoshard.plan(_DictOut(), mesh, (x, y))
        sharded = autoshard.compile(model, mesh, (x, y), loss_fn=lambda out: out["err"])
        loss = sharded.step(x, y)
    assert torch.allclose(loss._local_tensors[0] if hasattr(loss, "_local_tensors") else loss, want.detach(), atol=1e-6)


def test_stock_mixtral_with_experts_sharded(runs: dict[str, dict]) -> None:
    """The ep recipe on the stock Mixtral: its stacked expert weights (``experts.gate_up_proj``, ``down_proj``)
    and their optimizer state sharded on the expert dim over 4 ranks, the rest data-parallel; equal to one
    device. Its experts run as transformers' grouped matmul (``autoshard/rules/expert_mm.py``): the gate/up
    matmul of every layer runs expert-parallel, each rank its own expert's rows of the whole sorted batch, the
    output summed back (Megatron's all-gather dispatcher, not the zoo Mixtral's all-to-all); the down matmul
    gathers its weight (its input is the reduced activation either way, and the weights are small here)."""
    ref, got, _ = _result(runs, MIXTRAL_EP)
    plan = autoshard.Plan.from_json(got["plan"])
    grouped = [d for d in plan.stages[0].ops if d.op == "transformers.grouped_mm_fallback.default"]
    assert sum(d.inputs[1] == ("S(0)",) and d.output == ("P",) for d in grouped) == 2, grouped  # one per layer
    placements = plan.parameter_placements()
    experts = {k: v for k, v in placements.items() if ".experts." in k}
    assert len(experts) == 4 and set(experts.values()) == {("S(0)",)}
    assert {v for k, v in placements.items() if k not in experts} == {("R",)}
    assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], atol=2e-5, param_atol=PARAM_ATOL)
