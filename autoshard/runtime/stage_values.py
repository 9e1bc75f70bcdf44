"""What a pipeline stage reads and sends at run time, and the weight of each micro-batch's loss.

``autoshard/pipeline/wiring.py`` works out, when the model is cut, a ``StageWiring`` per stage (where each argument
of its graph comes from, what it sends on) and how the loss counts its targets; the runtime
(``runtime/pipelined.py``) applies them every step with the functions here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MEAN, SUM = 1, 2  # aten's reduction enum

Source = tuple[str, int]  # ("input", i): model input i; ("recv", p): received value p; ("out", j): own output j


@dataclass(frozen=True)
class StageWiring:
    """One stage: where each argument of its graph comes from, and what it sends to the next stage."""

    args: tuple[Source, ...]  # ("input", i) or ("recv", p)
    sends: tuple[Source, ...]  # ("out", j) or ("recv", p); the last stage sends its loss, ("out", 0)
    received: int  # how many values it receives from the previous stage
    last: bool = False  # sends the loss, shaped (1,) (the schedule concatenates the micro-batches' outputs)


def stage_args(w: StageWiring, received: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """The stage graph's arguments from what it received and the (micro-batch) model inputs."""
    return [inputs[i] if kind == "input" else received[i] for kind, i in w.args]


def stage_sends(w: StageWiring, outputs: Sequence[Any], received: Sequence[Any]) -> tuple[Any, ...]:
    """What the stage sends on: its own outputs and the values it relays (the last stage: its loss, shape (1,))."""
    if w.last:
        return (outputs[0].reshape(1),)
    return tuple(outputs[i] if kind == "out" else received[i] for kind, i in w.sends)


def loss_weights(
    reduction: int, counter: Callable[..., torch.Tensor] | None, tensors: Sequence[torch.Tensor], microbatches: int
) -> torch.Tensor:
    """Per micro-batch, the factor on its loss such that the schedule's mean over micro-batches is the whole
    batch's loss: M * count_i / count for a mean over counted targets, M for a sum, else 1."""
    if reduction == SUM:
        return torch.full((microbatches,), float(microbatches))
    if counter is None:
        return torch.ones(microbatches)
    pieces = [torch.tensor_split(t, microbatches) for t in tensors]
    counts = torch.stack([counter([p[i] for p in pieces]).float() for i in range(microbatches)])
    return counts * microbatches / counts.sum().clamp_min(1.0)


__all__ = ["MEAN", "SUM", "Source", "StageWiring", "loss_weights", "stage_args", "stage_sends"]
