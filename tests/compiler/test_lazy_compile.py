"""``autoshard.compile(model, mesh)`` with nothing else: planned on the first call from each rank's batch
shard (DDP's convention), with an optimizer built before that call; training equals one device on the
concatenated batch."""

from __future__ import annotations

import pytest
import torch
from harness import local_ranks, single_device_reference
from numerics_utils import LR
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.runtime.lazy import LazyShardedModule

pytest.importorskip("transformers")

from autoshard.models.hf import build  # noqa: E402


def _value(t: torch.Tensor) -> torch.Tensor:
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t._local_tensors[0] if hasattr(t, "_local_tensors") else t


def test_compile_on_first_call_with_an_optimizer_made_before() -> None:
    model, batch = build("llama", dropout=False, batch=4)
    ref = single_device_reference(lambda: build("llama", dropout=False)[0], batch, steps=2, lr=LR)
    with local_ranks(4) as ltm:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        sharded = autoshard.compile(model, mesh)
        assert isinstance(sharded, LazyShardedModule)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)  # before the first call, on the plain parameters
        with pytest.raises(RuntimeError, match="not compiled yet"):
            _ = sharded.plan
        # rank r holds batch rows of its dp coordinate (r // 2): the ranks' shards stacked are the batch
        shard = {k: ltm.rank_map(lambda r, v=v: v.chunk(2)[r // 2].clone()) for k, v in batch.items()}
        losses = []
        for step in range(2):
            loss = sharded(**shard).loss  # the model's own output type, as Hugging Face users read it
            loss.backward()
            if step == 0:
                grads = {n: _value(p.grad) for n, p in sharded.named_parameters()}
            opt.step()
            opt.zero_grad()
            losses.append(float(_value(loss)))
        params = {n: _value(p.data) for n, p in sharded.named_parameters()}
        assert sharded.plan.stages[0].tensors  # compiled now
        pieces = [t for t in sharded.plan.stages[0].tensors if t.role == "input"]
        assert all(t.placements == ("S(0)", "R") for t in pieces)
    assert losses == pytest.approx(ref.losses, abs=2e-5)
    for n, g in ref.grads.items():
        assert torch.allclose(grads[n], g, atol=2e-5), n
    moved = [n for n, p in ref.params.items() if not torch.allclose(params[n], p, atol=2e-4)]
    assert not moved, moved


def test_first_call_convention_needs_a_batch_axis() -> None:
    model, _ = build("gpt2", dropout=False)
    with local_ranks(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        with pytest.raises(ValueError, match=r"none is named as a data-parallel axis.*mesh_dim_names=\('dp', 'tp'\)"):
            autoshard.compile(model, mesh)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(ValueError, match="without example_inputs splits every input"):
            autoshard.compile(model, mesh, constraints={"inputs": "[R, R]"})
