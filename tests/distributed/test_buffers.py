"""Buffers the forward updates in place: BatchNorm's running statistics in a stock Hugging Face ResNet, and a
plain module's ``register_buffer`` updated with ``add_`` / ``copy_``. On data-parallel ranks the batch
statistics are the global batch's (what one device computes: SyncBatchNorm's semantics, planned as sums that the
ranks add up), and after every step each rank's buffers equal one device's."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from harness import assert_close_to_reference, single_device_reference
from numerics_utils import LR, PARAM_ATOL
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.testing.launch import launch

pytest.importorskip("transformers")
from transformers import ResNetConfig, ResNetForImageClassification  # noqa: E402


def _resnet() -> nn.Module:
    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10, layer_type="basic")
    return ResNetForImageClassification(cfg)


def _images() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return dict(pixel_values=torch.randn(8, 3, 32, 32, generator=g), labels=torch.randint(0, 10, (8,), generator=g))


class Tracked(nn.Module):
    """Plain user code: a step counter and an exponential average of the features, both buffers updated in the
    forward, and a normalization by the running average (the buffer is read after it is written)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(32))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        self.steps.add_(1)
        self.ema.copy_(0.9 * self.ema + 0.1 * h.detach().mean(0))
        return nn.functional.cross_entropy(self.fc2(h - self.ema), y)


def _tracked_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _reference_buffers(make: Any, inputs: Any, steps: int) -> list[dict[str, torch.Tensor]]:
    """One device's buffers after each of ``steps`` AdamW steps."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for _ in range(steps):
        loss = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        (loss.loss if hasattr(loss, "loss") else loss).backward()
        opt.step()
        opt.zero_grad()
        out.append({n: b.detach().clone() for n, b in model.named_buffers()})
    return out


def _train(rank: int, world: int, arg: tuple) -> dict:
    which, shape, names, options = arg
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    make, inputs = (
        (_resnet, _images()) if which == "resnet" else (lambda: (torch.manual_seed(0), Tracked())[1], _tracked_inputs())
    )
    model = make()
    sharded = autoshard.compile(model, mesh, example_inputs=inputs, backend="eager", **options)
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
    losses, grads, buffers = [], {}, []
    for step in range(3):
        pieces = sharded.shard_inputs(**inputs) if isinstance(inputs, dict) else sharded.shard_inputs(*inputs)
        loss = sharded(**pieces) if isinstance(pieces, dict) else sharded(*pieces)
        loss.backward()
        if step == 0:
            grads = {
                n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
                for n, p in sharded.named_parameters()
            }
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        buffers.append({n: b.detach().clone() for n, b in model.named_buffers()})
    params = {
        n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for n, p in sharded.named_parameters()
    }
    return {"losses": losses, "grads": grads, "params": params, "buffers": buffers}


@pytest.mark.parametrize(
    "which,world,shape,names,options",
    [
        ("resnet", 2, (2,), ("dp",), {"recipe": "ddp"}),
        ("resnet", 4, (2, 2), ("dp", "tp"), {"recipe": "fsdp"}),
        ("tracked", 2, (2,), ("dp",), {"recipe": "ddp"}),
    ],
    ids=["resnet-ddp-2", "resnet-fsdp-2x2", "user-buffers-ddp-2"],
)
def test_buffers_updated_in_the_forward_equal_one_device(
    which: str, world: int, shape: tuple, names: tuple, options: dict
) -> None:
    results = launch(world, _train, (which, shape, names, options), timeout=400)
    make = _resnet if which == "resnet" else (lambda: (torch.manual_seed(0), Tracked())[1])
    inputs = _images() if which == "resnet" else _tracked_inputs()
    ref = single_device_reference(lambda: copy.deepcopy(make()), inputs, steps=3, lr=LR)
    want = _reference_buffers(make, inputs, 3)
    for got in results:
        assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
        for step, (w, g) in enumerate(zip(want, got["buffers"])):
            assert set(w) == set(g)
            for name in w:
                torch.testing.assert_close(
                    g[name],
                    w[name],
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, n=name, s=step: f"buffer {n} after step {s}: {m}",
                )
