"""A training loop whose batches change shape: padded to each batch's longest sequence (lengths 32, 24, 17) and
a short last batch. Each new shape is planned at its first call (the first plan's layouts replayed, parameters
never moved) and kept; losses and parameters equal one device's, through ``autoshard.compile`` on dp2 x tp2 and
through the ``torch.compile`` backend. A batch the data-parallel ranks cannot split evenly is an error that says
how to avoid it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from numerics_utils import LR
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.testing.launch import launch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

SHAPES = ((4, 32), (4, 24), (4, 17), (2, 32), (4, 24))  # the last: a shape met before (no new plan)


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, shape, generator=g) for shape in SHAPES]


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _full(p: torch.Tensor) -> torch.Tensor:
    if hasattr(p, "full_tensor"):
        return p.full_tensor().detach().clone()
    if hasattr(p, "_autoshard_layout"):
        return autoshard.as_dtensor(p).full_tensor().detach().clone()
    return p.detach().clone()


def _compiled(rank: int, world: int, arg: None) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batches = _batches()
    sharded = autoshard.compile(
        _llama(), mesh, example_inputs=dict(input_ids=batches[0], labels=batches[0]), backend="eager", recipe="fsdp+tp"
    )
    placements = {n: str(p.placements) for n, p in sharded.named_parameters()}
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
    losses = []
    for ids in batches:
        loss = sharded(**sharded.shard_inputs(input_ids=ids, labels=ids))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {
        "losses": losses,
        "params": {n: _full(p) for n, p in sharded.named_parameters()},
        "kept": len(sharded._shapes.programs),
        "moved": placements != {n: str(p.placements) for n, p in sharded.named_parameters()},
    }


def _backend(rank: int, world: int, arg: None) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    compiled = torch.compile(model, backend="autoshard", options={"mesh": mesh, "backend": "eager", "recipe": "fsdp"})
    losses = []
    for ids in _batches():
        piece = ids.chunk(2)[rank]  # DDP's convention: each rank its half of the batch
        loss = compiled(input_ids=piece, labels=piece).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()}}


def _uneven(rank: int, world: int, arg: None) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ids = _batches()[0]
    sharded = autoshard.compile(
        _llama(), mesh, example_inputs=dict(input_ids=ids, labels=ids), backend="eager", recipe="ddp"
    )
    short = ids[:3]  # a last batch of 3 on 2 data-parallel ranks
    try:
        sharded(**sharded.shard_inputs(input_ids=short, labels=short))
    except autoshard.InputError as e:
        return str(e)
    return "no error"


def _check(got: dict[str, Any], losses: list[float], params: dict[str, torch.Tensor]) -> None:
    assert got["losses"] == pytest.approx(losses, rel=1e-5), (got["losses"], losses)
    for name, want in params.items():
        torch.testing.assert_close(got["params"][name], want, rtol=1e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_batches_of_changing_shape_train_like_one_device_on_dp2_tp2() -> None:
    losses, params = _reference()
    for got in launch(4, _compiled, None, timeout=600):
        _check(got, losses, params)
        assert got["kept"] == 4  # one program per distinct shape, the repeated one reused
        assert not got["moved"]  # no parameter changed its layout for a new shape


def test_batches_of_changing_shape_through_the_torch_compile_backend() -> None:
    losses, params = _reference()
    for got in launch(2, _backend, None, timeout=600):
        _check(got, losses, params)


def test_a_batch_the_ranks_cannot_split_evenly_says_how_to_avoid_it() -> None:
    msg = launch(2, _uneven, None, timeout=300)[0]
    assert "does not split evenly" in msg and "drop_last=True" in msg, msg
