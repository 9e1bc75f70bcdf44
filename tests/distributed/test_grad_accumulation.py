"""Gradient accumulation without pipeline stages (issue 13 part 4): ``compile(..., microbatches=k)`` plans one
micro-batch and ``step`` runs the global batch as ``k`` of them, and the planner picks ``k`` itself when the
whole batch's activations do not fit the memory budget.

Numerics against the single-device whole-batch run (loss, every gradient, the parameters after 3 AdamW steps,
fp32), all ranks simulated in one process (LocalTensorMode)."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from harness import (
    assert_close_to_reference,
    case_result,
    local_ranks,
    refused_at_floor,
    run_two_at_a_time,
    single_device_reference,
)
from numerics_utils import LR, MODELS, PARAM_ATOL, train_sharded
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import autoshard
from autoshard.errors import InfeasibleBudget
from autoshard.plans.plan import Plan
from autoshard.plans.report import report

DP = {"inputs": {"dp": Shard(0)}}


def _padded_gpt_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The GPT batch (8 sequences) with ignored targets spread unevenly, so micro-batches count different
    numbers of targets (a plain mean of their losses would be wrong)."""
    tokens, targets = MODELS["gpt"][1]()
    targets = targets.clone()
    targets[0, :10] = -100
    targets[1, :] = -100
    targets[5, 3:] = -100
    return tokens, targets


def _train(make, inputs, k: int | None, world: int = 2, **kw) -> tuple[dict, Plan]:
    ref = single_device_reference(make, inputs, steps=3, lr=LR)
    with local_ranks(world):
        got = train_sharded(make, inputs, (world,), ("dp",), lr=LR, microbatches=k, backend="eager", **kw)
    assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
    return got, Plan.from_json(got["plan"])


def _hf_gpt2():
    from autoshard.models.hf import build

    return build("gpt2", dropout=False, layers=1)[0]


def _case(case: str) -> tuple[dict, Plan]:
    """One LocalTensorMode training (run in a forked child; the comparison with one device is made there too)."""
    if case == "hf-gpt2":
        from autoshard.models.hf import build

        return _train(_hf_gpt2, build("gpt2", dropout=False, layers=1)[1], 2)
    k, kw = {"2-ddp": (2, {"constraints": DP}), "4-zero2": (4, {"recipe": "zero2"})}[case]
    return _train(MODELS["mlp"][0], MODELS["mlp"][1](), k, **kw)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> dict:
    """The selected cases, two at a time in forked processes (LocalTensorMode is single-threaded work)."""
    wanted = [
        f"{item.callspec.params['k']}-{'ddp' if item.callspec.params['k'] == 2 else 'zero2'}"
        for item in request.session.items
        if item.module is request.module and item.originalname == "test_mlp_microbatches_equal_the_whole_batch"
    ]
    if (
        any(
            item.module is request.module and item.originalname == "test_hf_gpt2_padded_labels_called_with_keywords"
            for item in request.session.items
        )
        and importlib.util.find_spec("transformers") is not None
    ):
        wanted.append("hf-gpt2")
    return run_two_at_a_time(_case, wanted, cost={"hf-gpt2": 10})


@pytest.mark.parametrize("k,kw", [(2, {"constraints": DP}), (4, {"recipe": "zero2"})], ids=["2-ddp", "4-zero2"])
def test_mlp_microbatches_equal_the_whole_batch(k: int, kw: dict, runs: dict) -> None:
    """Also under ZeRO-2, whose gradients accumulate into masters sharded further than the parameters."""
    _, plan = case_result(runs, f"{k}-{'ddp' if k == 2 else 'zero2'}")
    assert plan.microbatches == k
    assert plan.step_time_s == pytest.approx(k * plan.stages[0].microbatch_time_s, rel=0.5)
    x = next(t for t in plan.stages[0].tensors if t.name == "input[0]")
    assert x.shape[0] == 16 // k  # planned on one micro-batch
    assert f"gradient accumulation over {k} micro-batches" in report(plan)


def test_hf_gpt2_padded_labels_called_with_keywords(runs: dict) -> None:
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from autoshard.models.hf import build

    _, batch = build("gpt2", dropout=False, layers=1)
    assert (batch["labels"] == -100).any()
    halves = [(batch["labels"][i * 2 : (i + 1) * 2] != -100).sum().item() for i in range(2)]
    assert halves[0] != halves[1]  # the micro-batches count different numbers of targets
    got, plan = case_result(runs, "hf-gpt2")
    assert plan.microbatches == 2


def _gloo_worker(rank: int, world: int, k: int) -> dict:
    make, inputs_fn = MODELS["gpt"]
    return train_sharded(
        make, _padded_gpt_inputs(), (world,), ("dp",), lr=LR, microbatches=k, backend="eager", constraints=DP
    )


def test_gloo_gpt_padded_targets_weighted_by_count() -> None:
    """Real gloo processes, the GPT of ``MODELS`` with -100 targets spread unevenly: each micro-batch's mean
    cross-entropy is weighted by the targets it counts, alike on every rank (from the global batch)."""
    from autoshard.testing.launch import launch

    results = launch(2, _gloo_worker, 2)
    inputs = _padded_gpt_inputs()
    ref = single_device_reference(MODELS["gpt"][0], inputs, steps=3, lr=LR)
    for got in results:
        assert Plan.from_json(got["plan"]).microbatches == 2
        assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
    # a plain average of the two micro-batches' losses is not the whole batch's: the weighting mattered
    model = MODELS["gpt"][0]()
    with torch.no_grad():
        halves = [model(inputs[0][i * 4 : (i + 1) * 4], inputs[1][i * 4 : (i + 1) * 4]).item() for i in range(2)]
    assert abs(sum(halves) / 2 - ref.losses[0]) > 1e-3


def test_direct_call_runs_one_micro_batch() -> None:
    """``sharded(*pieces)`` with one micro-batch's pieces is that micro-batch's loss, as before."""
    make, inputs_fn = MODELS["mlp"]
    x, y = inputs_fn()
    want = make()(x[:8], y[:8]).item()
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        sharded = autoshard.compile(make(), mesh, (x, y), microbatches=2, backend="eager", constraints=DP)
        loss = sharded(*sharded.shard_inputs(x[:8], y[:8]))
        got = {float(v) for v in loss._local_tensors.values()}
        with pytest.raises(ValueError, match=r"expected this rank's local piece f32\[4, 32\]"):
            # the whole batch is for step; a direct call runs one micro-batch (on gloo ranks another batch size
            # is planned as a new shape; LocalTensorMode keeps the planned one)
            sharded(*sharded.shard_inputs(x, y))
    assert len(got) == 1 and abs(got.pop() - want) < 1e-5


def test_microbatches_must_divide_the_batch() -> None:
    make, inputs_fn = MODELS["mlp"]
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(ValueError, match=r"microbatches=3: argument args\[0\] has batch size 16.*divides 16"):
            autoshard.compile(make(), mesh, inputs_fn(), microbatches=3, backend="eager")
        with pytest.raises(ValueError, match=r"microbatches=2 without pipeline stages.*example_inputs"):
            autoshard.compile(make(), mesh, microbatches=2)  # planned from each rank's shard: not accumulation


def _make_mlp() -> torch.nn.Module:
    from autoshard.models.mlp import MLP

    torch.manual_seed(0)
    return MLP(32, 64, 32)


def _big_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    from autoshard.models.mlp import mlp_example_inputs

    return mlp_example_inputs(n, 32, 32)


def _tight_budget(mesh) -> int:
    """3/4 of the least memory any plan of the whole batch needs (the solver's lower bound)."""
    e = refused_at_floor(  # (microbatches=1: the whole batch only, no accumulation search)
        lambda b: autoshard.plan(_make_mlp(), mesh, _big_batch(2048), memory_budget=b, constraints=DP, microbatches=1)
    )
    return e.least_bytes * 3 // 4


def test_plan_searches_micro_batches_too() -> None:
    """``autoshard.plan`` (no compile) answers a budget the whole batch cannot meet with micro-batches that fit,
    and says so in the report; ``microbatches=k`` plans k of them; a budget nothing meets names the tries."""
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        budget = _tight_budget(mesh)
        plan = autoshard.plan(_make_mlp(), mesh, _big_batch(2048), memory_budget=budget, constraints=DP)
        four = autoshard.plan(_make_mlp(), mesh, _big_batch(2048), constraints=DP, microbatches=4)
        whole = autoshard.plan(_make_mlp(), mesh, _big_batch(2048), constraints=DP)
        e = refused_at_floor(
            lambda b: autoshard.plan(_make_mlp(), mesh, _big_batch(2048), memory_budget=b, constraints=DP)
        )
    assert re.search(r"micro-batches tried: 2: .*; 4: ", str(e)), str(e)
    assert plan.microbatches > 1 and plan.peak_memory.total <= budget
    assert f"gradient accumulation over {plan.microbatches} micro-batches" in report(plan)
    assert four.microbatches == 4 and whole.microbatches == 1
    # a quarter of the batch at a time: a quarter of the activations, the same state
    assert four.peak_memory.activations == pytest.approx(whole.peak_memory.activations / 4, rel=0.05)
    assert four.peak_memory.parameters == whole.peak_memory.parameters
    assert "micro-batches tried" in e.accumulation


def test_planner_accumulates_when_the_whole_batch_does_not_fit(caplog: pytest.LogCaptureFixture) -> None:
    """A budget the whole batch cannot meet but a micro-batch can: compile picks micro-batches, says why, the
    plan's predicted peak is within the budget, and training still equals the whole-batch run."""
    inputs = _big_batch(2048)
    with local_ranks(2):
        budget = _tight_budget(init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
    ref = single_device_reference(_make_mlp, inputs, steps=3, lr=LR)
    with local_ranks(2), caplog.at_level("INFO", logger="autoshard.search.accumulate"):
        got = train_sharded(
            _make_mlp, inputs, (2,), ("dp",), lr=LR, backend="eager", memory_budget=budget, constraints=DP
        )
    plan = Plan.from_json(got["plan"])
    assert plan.microbatches > 1
    assert plan.peak_memory.total <= budget
    assert f"gradient accumulation over {plan.microbatches} micro-batches fits" in caplog.text
    assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)


def _gloo_budget_worker(rank: int, world: int, arg: None) -> dict:
    budget = _tight_budget(init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
    got = train_sharded(
        _make_mlp,
        _big_batch(2048),
        (world,),
        ("dp",),
        steps=1,
        lr=LR,
        backend="eager",
        memory_budget=budget,
        constraints=DP,
    )
    return {**got, "budget": budget}


def test_gloo_ranks_agree_on_the_micro_batches() -> None:
    """On a real group rank 0 solves each try; every rank follows its verdict to the same micro-batch count."""
    from autoshard.testing.launch import launch

    results = launch(2, _gloo_budget_worker, None)
    ref = single_device_reference(_make_mlp, _big_batch(2048), steps=1, lr=LR)
    for got in results:
        plan = Plan.from_json(got["plan"])
        assert plan.microbatches > 1 and plan.peak_memory.total <= got["budget"]
        assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)


def test_no_micro_batch_fits_names_the_smallest_budget() -> None:
    make, inputs_fn = MODELS["mlp"]
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        e = refused_at_floor(
            lambda b: autoshard.compile(make(), mesh, inputs_fn(), memory_budget=b, constraints=DP, backend="eager")
        )
    assert re.search(r"micro-batches tried: 2: .*; 4: .*smallest budget any plan needs", str(e)), str(e)
    assert e.least_bytes and e.least_bytes > 1


def _batch_norm_mlp() -> torch.nn.Module:
    """A stock model whose training step mixes its samples: BatchNorm normalizes by the batch's statistics."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 32), _MSE()
    )


class _MSE(torch.nn.Module):
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return (y * y).mean()


def test_accumulation_of_a_model_that_mixes_its_samples(caplog: pytest.LogCaptureFixture) -> None:
    """Micro-batches change what BatchNorm computes (each normalizes by its own samples): the planner never picks
    them by itself (a budget only they would meet is refused, naming the op), and ``microbatches=k`` given by the
    user plans them with a warning naming it; a model whose samples stay apart (the MLP) gets no warning."""
    x = torch.randn(2048, 32, generator=torch.Generator().manual_seed(0))
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        least = refused_at_floor(
            lambda b: autoshard.plan(_batch_norm_mlp(), mesh, (x,), memory_budget=b, constraints=DP, microbatches=1)
        ).least_bytes
        mixes = r"mixes the samples of its batch before the loss: aten\.sum\S* \(sum\w* in 1, .* sums over the batch"
        with pytest.raises(InfeasibleBudget, match=mixes):
            autoshard.plan(_batch_norm_mlp(), mesh, (x,), memory_budget=least * 3 // 4, constraints=DP)
        with caplog.at_level("WARNING", logger="autoshard.search.accumulate"):
            two = autoshard.plan(_batch_norm_mlp(), mesh, (x,), constraints=DP, microbatches=2)
            mlp = autoshard.plan(_make_mlp(), mesh, _big_batch(64), constraints=DP, microbatches=2)
    assert two.microbatches == 2 and mlp.microbatches == 2
    warned = [r.getMessage() for r in caplog.records if "mixes the samples" in r.getMessage()]
    assert len(warned) == 1 and "microbatches=2" in warned[0] and " in 1, " in warned[0], warned  # (module "1")


def _least(model: torch.nn.Module, mesh, inputs, k: int) -> int:
    """The smallest per-device memory any plan of ``k`` micro-batches needs (the solver's lower bound)."""
    return refused_at_floor(
        lambda b: autoshard.plan(model, mesh, inputs, memory_budget=b, microbatches=k, solve_recipes=False)
    ).least_bytes


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
@pytest.mark.parametrize("name", ["llama", "mixtral", "gpt2"])
def test_stock_attention_models_accumulate_under_a_budget(name: str, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 43 part 4: a stock transformer under a budget only micro-batches meet gets gradient accumulation.
    The batch is followed through the attention kernel by autoshard's attention rule (DTensor has none for it)
    and through transformers' padding mask (indexed by ``arange(batch)``) as each sample's own row; Mixtral's
    expert dispatch (a sort of the tokens by expert) is reported as not followed, without refusing."""
    from autoshard.models.hf import build

    model, batch = build(name, dropout=False, layers=1, batch=8, seq=64)
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        budget = _least(model, mesh, batch, 1) * 17 // 20  # (two micro-batches need about 2/3 of it)
        with caplog.at_level("WARNING", logger="autoshard.search.accumulate"):
            plan = autoshard.plan(model, mesh, batch, memory_budget=budget, solve_recipes=False)
    assert plan.microbatches > 1 and plan.peak_memory.total <= budget
    unknown = [r.getMessage() for r in caplog.records if "could not be followed" in r.getMessage()]
    if name == "mixtral":
        assert len(unknown) == 1 and "aten.sort" in unknown[0] and "mlp.experts" in unknown[0], unknown
    else:
        assert unknown == [], unknown  # attention and the mask followed: nothing left unknown


class _SumsAfterAttention(torch.nn.Module):
    """Self-attention (the CPU flash kernel: autoshard's rule follows the batch through it), then a step that
    mixes the samples: ``y / y.sum(0)`` (``how="sum"``), or a contrastive score of every sample against every
    other (``how="pairs"``, ``y @ y.T`` as CLIP's loss has)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.qkv, self.how = torch.nn.Linear(16, 48), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).mean((1, 2))
        mixed = y / y.sum(0) if self.how == "sum" else y @ y.t()
        return (mixed * mixed).mean()


@pytest.mark.parametrize("how,op", [("sum", r"aten\.sum\S*"), ("pairs", r"aten\.mm\S*")])
def test_attention_model_that_mixes_its_samples_is_still_refused(how: str, op: str) -> None:
    """Following the batch through attention does not let a later batch coupling through: accumulation that would
    fit is refused naming the op (the sum over the batch, the matmul of the batch against itself)."""
    torch.manual_seed(0)
    model, x = _SumsAfterAttention(how), torch.randn(32, 128, 16)
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        whole, two = _least(model, mesh, (x,), 1), _least(model, mesh, (x,), 2)
        with pytest.raises(InfeasibleBudget, match=rf"mixes the samples of its batch before the loss: {op} ") as e:
            autoshard.plan(model, mesh, (x,), memory_budget=(whole + two) // 2, solve_recipes=False)
    assert "would fit" in e.value.accumulation and "mixes the samples" in e.value.accumulation
