"""A pipeline stage's weight gradients deferred, as zero-bubble schedules run them.

``torch.distributed.pipelining``'s zero-bubble schedules (``ScheduleInterleavedZeroBubble``) run each
micro-batch's backward as B, the received activations' gradients, sent at once to the previous stage, then
later W, the parameters' gradients. A stage built with a ``dw_builder`` gets B from its ordinary autograd
backward and W from the runner the builder returns right after it. Here the compiled stage program's backward
is split (``CompiledProgram.split_backward``): the stage's autograd backward (``runtime/pipelined.py:
_RunStage``) runs only the input part and queues what the weight part needs; ``runner()`` takes the queued
entry and returns the W action, which runs the weight part and adds the gradients into the parameters'
``.grad`` as autograd would have (in the parameters' layouts, ``scatter_grads``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from autoshard.runtime.param_state import ParamStates, scatter_grads
from autoshard.runtime.program import StageProgram


class DeferredWeights:
    """One stage's queue of weight-gradient work (see the module docstring)."""

    def __init__(self, program: StageProgram, grad_slots: Sequence[int], first_input_slot: int) -> None:
        is_input = [s >= first_input_slot for s in grad_slots]
        program.split_backward(is_input)
        self._program = program
        self._input_slots = tuple(s for s, i in zip(grad_slots, is_input) if i)
        self._weight_slots = tuple(s for s, i in zip(grad_slots, is_input) if not i)
        self._pending: list[tuple[Any, ...]] = []
        self.weight_runs = 0  # W actions run (the schedule's, counted for tests and logs)

    def input_backward(
        self,
        saved: list[torch.Tensor],
        grads_out: Sequence[torch.Tensor],
        flat: Sequence[torch.Tensor],
        like: Sequence[Any],
        states: ParamStates,
    ) -> list[torch.Tensor | None]:
        """B: the gradients of the stage program's flat inputs (``flat``: parameters, buffers, activations) that
        are received activations, None for the others; the weight part's inputs queued for :meth:`runner`."""
        grads, carry = self._program.backward_input(saved, grads_out)
        self._pending.append((carry, flat, like, states))
        return scatter_grads(grads, self._input_slots, like, states)

    def runner(self) -> Callable[[], None]:
        """W for the micro-batch whose B ran last (the stage asks right after each B)."""
        carry, flat, like, states = self._pending.pop()

        def run() -> None:
            grads = scatter_grads(self._program.backward_weight(carry), self._weight_slots, like, states)
            self.weight_runs += 1
            for slot in self._weight_slots:
                param, g = flat[slot], grads[slot]
                if g is None:
                    continue
                if param.grad is None:
                    param.grad = g
                else:
                    param.grad += g

        return run


__all__ = ["DeferredWeights"]
