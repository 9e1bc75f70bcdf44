"""Random streams of pipeline stages: each stage draws from a stream of its own, the same on all its replicas.

A stage's program draws its random numbers (dropout masks, ``rand_like``, a sampled router) from the default
generator of its device, as one device does (``autoshard/rules/random_draws.py``). Every rank starts a step with
the same generator state (the same seed, the same earlier draws), so without more, stage 1 would draw the same
numbers as stage 0: layer 5's dropout mask equal to layer 1's. Instead, at the start of each step every rank
takes one number from its default generator (``begin_step``: all ranks alike, so their generators stay equal and
``torch.manual_seed`` before the step decides everything), and stage ``k`` draws from a generator seeded by that
number and ``k``, carried from one micro-batch's forward to the next (``drawing``). So:

- ranks that hold the same stage (its data-parallel and tensor-parallel replicas) draw the same numbers;
- two stages, two micro-batches, two steps never draw the same numbers;
- the numbers are not the ones one device draws for the unpipelined model.

With ``random="exact"`` (the stages' programs draw whole tensors from the default generator, as one device does),
``ReplayStreams`` instead gives stage ``k``'s forward of micro-batch ``j`` the generator state one device has there
when it runs the same micro-batches one after another (gradient accumulation): every rank replays, once per step,
the draws of every stage for every micro-batch in that order (the stages' draw lists are exchanged over the
pipeline group when the module is built), keeping the states where its own stages start. The step then draws
what one device accumulating the micro-batches draws, at the price of each rank drawing all of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch

_GOLDEN = 0x9E3779B97F4A7C15  # spreads stage indices over the seed space (Fibonacci hashing)
_MASK = (1 << 63) - 1


def _state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


class StageStreams:
    """The random streams of this rank's stages (``stages``: their indices) on ``device``."""

    def __init__(self, device: torch.device, stages: Iterable[int]) -> None:
        self.device = torch.device(device)
        self.stages = tuple(stages)
        self._states: dict[int, torch.Tensor] = {}

    def begin_step(self) -> None:
        """Seed every stage's stream for a step from one draw of the default generator (the same on every rank)."""
        base = int(torch.randint(0, 1 << 62, (1,), device=self.device).item())
        for k in self.stages:
            g = torch.Generator(self.device)
            g.manual_seed((base + (k + 1) * _GOLDEN) & _MASK)
            self._states[k] = g.get_state()

    @contextlib.contextmanager
    def drawing(self, stage: int) -> Iterator[None]:
        """Inside: the default generator is stage ``stage``'s stream; after: the default generator as before."""
        state = self._states.get(stage)
        if state is None:  # (a forward outside a step: the default generator itself)
            yield
            return
        outside = _state(self.device)
        _set_state(self.device, state)
        try:
            yield
        finally:
            self._states[stage] = _state(self.device)
            _set_state(self.device, outside)


DrawSpec = tuple  # (kind, shape, params, dtype, device, order): one draw of a stage's forward, as ``draw`` takes it


class ReplayStreams:
    """One device's generator states at each (stage, micro-batch) forward: see the module docstring. ``draws``: every
    stage's draw list by stage index; ``stages``: this rank's; ``microbatches``: per step."""

    def __init__(
        self,
        device: torch.device,
        stages: Iterable[int],
        draws: dict[int, list[DrawSpec]],
        microbatches: int,
        draw: Callable[..., torch.Tensor],
    ) -> None:
        self.device = torch.device(device)
        self.stages = tuple(stages)
        self.draws = dict(draws)
        self.microbatches = microbatches
        self._draw = draw
        self._states: dict[tuple[int, int], torch.Tensor] = {}
        self._next: dict[int, int] = {}
        self._end: torch.Tensor | None = None

    def begin_step(self) -> None:
        """Replay one device's draws of the step from the default generator; it ends where one device's does."""
        self._states.clear()
        self._next = {k: 0 for k in self.stages}
        for j in range(self.microbatches):
            for k in sorted(self.draws):
                if k in self.stages:
                    self._states[(k, j)] = _state(self.device)
                for kind, shape, params, dtype, device, order in self.draws[k]:
                    self._draw(kind, shape, params, dtype, device, order=order)
        self._end = _state(self.device)

    @contextlib.contextmanager
    def drawing(self, stage: int) -> Iterator[None]:
        """Inside: the default generator at one device's state for this stage's next micro-batch."""
        j = self._next.get(stage)
        state = self._states.get((stage, j)) if j is not None else None
        if state is None:
            yield
            return
        self._next[stage] = j + 1
        _set_state(self.device, state)
        try:
            yield
        finally:
            _set_state(self.device, self._end)


__all__ = ["DrawSpec", "ReplayStreams", "StageStreams"]
