"""The errors autoshard raises, under one base class.

Every error names what it refused (the op, shape, mesh, placement, option or file) and the fix. Catch
:class:`AutoshardError` for all of them; each is also the built-in type it has always been (``InputError`` is a
``ValueError``, ``CallError`` a ``TypeError``, the others ``RuntimeError``), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class AutoshardError(Exception):
    """Base class of autoshard's errors."""


class InputError(AutoshardError, ValueError):
    """Something given to autoshard it cannot take: a model, call, mesh, option, plan or checkpoint."""


class CallError(AutoshardError, TypeError):
    """A call of a compiled module that does not match what was traced: how many inputs, a tensor where one was
    traced, a DTensor where a local shard is expected, a keyword the program never saw."""


class InfeasibleBudget(InputError):
    """No plan fits the memory budget (proven); ``least_bytes`` is the smallest per-device memory any plan needs
    (None when unknown); ``accumulation`` says which micro-batch counts were tried, when gradient accumulation
    was (``autoshard/search/accumulate.py``). ``fixed_bytes``: of ``least_bytes``, the part no smaller batch
    shrinks (parameters, gradients, optimizer state), when known: then one of k micro-batches needs at least
    ``fixed + (least - fixed) / k`` (``micro_floor``). ``step_floor``: the least peak any plan of the program has
    whatever its batch (its state and the optimizer step's temporaries: ``compiler/solve_memory.py: step_floor``),
    when known."""

    def __init__(
        self,
        message: str,
        least_bytes: int | None = None,
        accumulation: str = "",
        fixed_bytes: int | None = None,
        step_floor: int | None = None,
    ) -> None:
        super().__init__(message)
        self.least_bytes = least_bytes
        self.accumulation = accumulation
        self.fixed_bytes = fixed_bytes
        self.step_floor = step_floor

    def micro_floor(self, k: int) -> float | None:
        """The least memory a plan of one of ``k`` micro-batches can need (None when unknown): what does not
        shrink with the batch, plus the rest divided by k (saved activations and temporaries are at most
        proportional to the batch), and never below ``step_floor``."""
        floors = [self.step_floor]
        if self.least_bytes is not None and self.fixed_bytes is not None:
            floors.append(self.fixed_bytes + (self.least_bytes - self.fixed_bytes) / k)
        known = [f for f in floors if f is not None]
        return max(known) if known else None


class SolverTimeout(AutoshardError, RuntimeError):
    """The solver's time limit ran out before it found a plan or proved that none fits: not an out-of-memory
    verdict. A longer ``time_limit_s`` (or a looser budget) may find one."""


class DataDependentError(AutoshardError, RuntimeError):
    """The model's Python branches on a tensor's value, which a trace with fake tensors cannot know."""


class LaunchError(AutoshardError, RuntimeError):
    """A child process raised, died or timed out; the message is one line, ``detail`` the full traceback, ``rank``
    the failing rank (None for a time-out)."""

    def __init__(self, message: str, detail: str = "", rank: int | None = None) -> None:
        super().__init__(message)
        self.detail = detail
        self.rank = rank


class RankFailed(AutoshardError, RuntimeError):
    """Another rank raised during a step, so this one stopped too (``autoshard/runtime/rank_failures.py``); the
    message names ``rank`` and its error, and the process group is closed."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class UsageError(AutoshardError, RuntimeError):
    """Something asked of an autoshard object, or of torch.compile's autoshard backend, in a state or a way it
    cannot serve: a lazily compiled module before its first call, tensors built on the meta device still without
    values at the first step, a graph break or dynamic shapes under the backend. The message says what to do."""


class InternalError(AutoshardError, RuntimeError):
    """A broken invariant inside autoshard: a bug, not the user's input. The message names what broke; please
    report it with the model (or graph) it was planning."""


__all__ = [
    "AutoshardError",
    "CallError",
    "DataDependentError",
    "InfeasibleBudget",
    "InputError",
    "InternalError",
    "LaunchError",
    "RankFailed",
    "SolverTimeout",
    "UsageError",
]
