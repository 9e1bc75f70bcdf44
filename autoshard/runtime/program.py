"""The programs the runtime runs: the contract between the compiler, which makes them, and the runtime.

The runtime owns these protocols and imports no compiler module; ``autoshard/compiler/compile.py``'s
``CompiledProgram`` and ``InterpretedProgram`` implement them (a flat program, or one pipeline stage's).

Placements are by name: the parameters' (``layer.weight``) and the call's tensors' (``input[i]``): those they are
computed with (``layouts``), those the gradients come back in (``grad_layouts``) and those the optimizer steps
(``state_layouts``; they differ for ZeRO-1/2 parameters); ``offload``: the parameters whose masters live in host
memory ("optimizer" or "params", ``runtime/offload.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.distributed.tensor import Placement


class Program(Protocol):
    """One rank's training step of a flat plan: ``forward`` then ``backward``."""

    layouts: dict[str, tuple[Placement, ...]]
    grad_layouts: dict[str, tuple[Placement, ...]]
    state_layouts: dict[str, tuple[Placement, ...]]
    offload: dict[str, str]

    def forward(self, flat: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Any, dict[str, torch.Tensor]]:
        """(the loss, what backward needs, the new value of each buffer the forward updates, by name)."""
        ...

    def backward(self, saved: Any, grad_loss: torch.Tensor) -> list[torch.Tensor]:
        """The local gradients: the parameters', then those of the inputs that require grad."""
        ...


class StageProgram(Program, Protocol):
    """One pipeline stage's program (and an evaluation program's forward): every output in and out, and the
    backward in two parts for zero-bubble schedules."""

    tangent_of: list[int]  # the forward outputs that take a gradient, in the backward's tangent order

    def forward_many(self, flat: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(every forward output, the tensors saved for the backward)."""
        ...

    def backward_many(self, saved: list[torch.Tensor], grad_outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients from the saved tensors and one gradient per forward output."""
        ...

    def split_backward(self, is_input_grad: Sequence[bool]) -> None:
        """Make ``backward_input`` and ``backward_weight``: ``is_input_grad[k]`` says whether backward output ``k``
        is a received activation's gradient."""
        ...

    def backward_input(
        self, saved: list[torch.Tensor], grad_outs: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the input gradients, what ``backward_weight`` needs)."""
        ...

    def backward_weight(self, carry: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters' gradients, from ``backward_input``'s carry."""
        ...


__all__ = ["Program", "StageProgram"]
