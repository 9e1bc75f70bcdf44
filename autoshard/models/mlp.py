"""A small MLP whose ``forward(x, y)`` returns the mean-squared-error loss.

Layout: ``fc1`` (d_in -> d_hidden), activation, then ``depth`` extra hidden layers
(d_hidden -> d_hidden, each followed by the activation) in the ``nn.ModuleList``
``layers``, then ``fc2`` (d_hidden -> d_out). Initialisation uses torch's default
RNG: seed it before constructing to get identical models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoshard.errors import InputError

__all__ = ["MLP", "mlp_example_inputs"]

_ACTIVATIONS = ("relu", "gelu")


class MLP(nn.Module):
    """``fc1 -> act -> [layers[i] -> act]* -> fc2``; forward returns ``mse_loss(out, y)``."""

    def __init__(
        self,
        d_in: int = 64,
        d_hidden: int = 256,
        d_out: int = 64,
        *,
        depth: int = 0,
        activation: str = "relu",
        bias: bool = True,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise InputError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
        if depth < 0:
            raise InputError(f"depth must be >= 0, got {depth}")
        self.activation = activation
        self.fc1 = nn.Linear(d_in, d_hidden, bias=bias)
        self.layers = nn.ModuleList(nn.Linear(d_hidden, d_hidden, bias=bias) for _ in range(depth))
        self.fc2 = nn.Linear(d_hidden, d_out, bias=bias)

    def _act(self, x: Tensor) -> Tensor:
        return F.relu(x) if self.activation == "relu" else F.gelu(x)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = self._act(self.fc1(x))
        for layer in self.layers:
            h = self._act(layer(h))
        return F.mse_loss(self.fc2(h), y)


def mlp_example_inputs(batch: int, d_in: int, d_out: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random float32 ``(x, y)`` of shapes (batch, d_in), (batch, d_out) from a private generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d_in, generator=g)
    y = torch.randn(batch, d_out, generator=g)
    return x, y
