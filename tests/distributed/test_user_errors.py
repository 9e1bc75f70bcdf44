"""What users get wrong gets an error that names it and says the fix; an op with no sharding rule runs
replicated with one warning and the right result."""

from __future__ import annotations

import logging

import pytest
import torch
from harness import local_ranks
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import autoshard
from autoshard.cluster.meshes import fake_world
from autoshard.models.mlp import MLP, mlp_example_inputs


def _mlp_plan(constraints: dict) -> autoshard.Plan:
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return autoshard.plan(
            MLP(16, 30, 16), mesh, mlp_example_inputs(8, 16, 16), constraints=constraints, solve_recipes=False
        )


@pytest.mark.parametrize(
    ("constraints", "message"),
    [
        ({"layers.*.weight": "[R, R]"}, r"'layers\.\*\.weight' matches no parameter.*such as fc"),
        ({"input[5]": {"dp": Shard(0)}}, r"'input\[5\]'.*2 tensor inputs.*input\[0\] \.\. input\[1\]"),
        ({"fc1.weight": {"pp": Shard(0)}}, r"'fc1\.weight' names mesh axis 'pp'.*\('dp', 'tp'\)"),
        ({"fc1.weight": {"tp": Shard(1)}, "fc1.bias": "[S(0), S(0)]"}, r"fc1\.bias \(30,\).*does not divide"),
    ],
)
def test_bad_constraints_are_refused(constraints: dict, message: str) -> None:
    with pytest.raises(autoshard.InputError, match=message):
        _mlp_plan(constraints)


def test_constraints_by_argument_name_and_glob() -> None:
    p = _mlp_plan({"args[1]": "[S(0), R]", "fc*.weight": {"tp": Shard(0)}})
    layouts = {t.name: t.placements for t in p.stages[0].tensors}
    assert layouts["input[1]"] == ("S(0)", "R")
    assert layouts["fc1.weight"][1] == "S(0)" and layouts["fc2.weight"][1] == "S(0)"


def test_a_meta_model_without_values_is_refused_at_its_first_step() -> None:
    with torch.device("meta"):
        model = MLP(16, 32, 16)
    inputs = mlp_example_inputs(8, 16, 16)
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        sharded = autoshard.compile(model, mesh, inputs, recipe="fsdp")  # each rank allocates its shards only
        with pytest.raises(
            RuntimeError,
            match=r"built on the meta device and still have no values \(fc1\.weight.*"
            r"init_weights\(seed=0\).*load_pretrained",
        ):
            sharded.step(*inputs)


# ------------------------------------------------------------------ an op DTensor has no rule for


@torch.library.custom_op("autoshard_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: Tensor, scale: float) -> Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x: Tensor, scale: float) -> Tensor:
    return torch.empty_like(x)


def _setup(ctx: object, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(inputs[0])  # type: ignore[attr-defined]
    ctx.scale = inputs[1]  # type: ignore[attr-defined]


def _backward(ctx: object, grad: Tensor) -> tuple:
    (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
    return grad * ctx.scale * (1 - torch.tanh(x) ** 2), None  # type: ignore[attr-defined]


scaled_tanh.register_autograd(_backward, setup_context=_setup)


class _TwoCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = scaled_tanh(self.fc1(x), 0.5)
        out = scaled_tanh(self.fc2(h), 2.0)
        return (out - y).square().mean()


def test_op_without_a_rule_runs_replicated_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), torch.randn(8, 4)
    torch.manual_seed(0)
    ref = _TwoCustom()
    loss_ref = ref(x, y)
    loss_ref.backward()
    torch.manual_seed(0)
    model = _TwoCustom()
    with caplog.at_level(logging.WARNING, logger="autoshard"), local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        sharded = autoshard.compile(model, mesh, (x, y), constraints={"inputs": {"dp": Shard(0)}})
        loss = sharded.step(x, y)
        grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
    warned = [r.getMessage() for r in caplog.records if "no sharding strategy" in r.getMessage()]
    assert len(warned) == 1 and "autoshard_test.scaled_tanh" in warned[0], warned
    assert torch.allclose(loss._local_tensors[0], loss_ref.detach(), atol=1e-6)
    for n, p in ref.named_parameters():
        assert torch.allclose(grads[n]._local_tensors[0], p.grad, atol=1e-6), n


def _warnings_of_one_rank(rank: int, world: int, arg: None) -> list[str]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("autoshard").addHandler(handler)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    autoshard.compile(_TwoCustom(), mesh, (x, y), constraints={"inputs": {"dp": Shard(0)}}, backend="eager")
    return [r.getMessage() for r in records]


def test_a_warning_about_the_plan_is_said_by_rank_0_only() -> None:
    """Every rank plans the same program: the warning about an op without a sharding rule comes once, from rank
    0, not once per rank."""
    from autoshard.testing.launch import launch

    first, second = launch(2, _warnings_of_one_rank)
    assert sum("no sharding strategy" in m for m in first) == 1, first
    assert second == [], second


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        x.mul_(2.0)  # in place into the caller's tensor: not a buffer
        return self.fc(x).pow(2).mean()


def test_a_forward_writing_into_its_input_is_refused_naming_what_to_do() -> None:
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(autoshard.InputError, match=r"writes in place into .*Return the new value instead"):
            autoshard.compile(_WritesItsInput(), mesh, example_inputs=(torch.randn(4, 8),), backend="eager")


def test_labels_passed_positionally_to_a_stock_hf_model_get_an_error_naming_the_binding() -> None:
    """``(ids, labels)`` to ``GPT2LMHeadModel``: the second positional parameter is its KV cache, and the model's own
    code fails (a raw AttributeError from deep inside transformers). The error names the model's line, how the
    example inputs bound to its parameters and the fix (keywords)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    ids = torch.randint(0, 128, (4, 16))
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with pytest.raises(
            autoshard.CallError,
            match=r"GPT2LMHeadModel\.forward raised AttributeError: .*"
            r"modeling_gpt2\.py:\d+.*bound as input_ids=int64\[4, 16\], \w+=int64\[4, 16\].*"
            r"pass it by keyword",
        ):
            autoshard.plan(transformers.GPT2LMHeadModel(cfg), mesh, (ids, ids), solve_recipes=False)
        plan = autoshard.plan(
            transformers.GPT2LMHeadModel(cfg), mesh, {"input_ids": ids, "labels": ids}, solve_recipes=False
        )  # the fix the message names works
    assert plan.step_time_s > 0


class _BranchesOnRank(nn.Module):
    """A forward that computes something else on rank 1: each rank traces its own program."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc(x)
        if torch.distributed.get_rank() == 1:
            y = y * 2
        return y.square().mean()


def _branching_worker(rank: int, world: int, _: object) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    try:
        autoshard.compile(_BranchesOnRank(), mesh, example_inputs=(torch.randn(4, 8),), backend="eager")
    except autoshard.InputError as e:
        return str(e)
    return "compiled"


def test_ranks_that_trace_different_programs_are_refused_on_every_rank_naming_the_first_difference() -> None:
    """Rank 0 solves and the others apply its choices to their own trace: a rank that traced another program would
    run a plan made for a different one. Every rank refuses, naming the rank and the first op that differs."""
    from autoshard.testing.launch import launch

    messages = launch(2, _branching_worker, None, timeout=240)
    assert messages[0] == messages[1], messages
    assert "rank(s) [1] differ from rank 0" in messages[0]
    assert "aten.mul.Tensor" in messages[0] and "the first op that differs" in messages[0]
