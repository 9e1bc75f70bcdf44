"""The compiler as one ordered list of passes, and the runner that owns it.

    capture -> coarsen -> share_layers -> strategies -> solve          (planning: ``autoshard.plan``)
    -> lower -> partition -> overlap -> compile                         (this rank's program: ``autoshard.compile``)

Each pass is a file in ``autoshard/compiler/`` with the signature ``(GraphModule, PassContext) -> GraphModule``
(``capture`` takes the user's module) and a docstring of what it needs and guarantees (``autoshard/compiler/README.md``
tabulates them). The runner runs a slice of the list: it times and logs every pass (``autoshard pass <name> <seconds>``
at INFO), checks that each returns a graph module and sets the products it promises on the context, dumps the graph
after each with ``AUTOSHARD_DEBUG=1``, and honours ``PlanConfig.disable_passes``: a pass that can be disabled runs its
stated stand-in instead, one that cannot is refused, and an unknown name is refused, all before any pass runs.

Adding a pass: one file in ``autoshard/compiler/`` and one ``PassSpec`` line in ``PASSES``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx
from torch import nn

from autoshard import _torch_compat as tc
from autoshard.compiler.capture_layers import capture_model
from autoshard.compiler.coarsen import coarsen, coarsen_per_node
from autoshard.compiler.compile import compile_program, run_graphs
from autoshard.compiler.context import BACKENDS, PassContext, debug_enabled
from autoshard.compiler.lower import lower
from autoshard.compiler.overlap import overlap
from autoshard.compiler.partition import partition
from autoshard.compiler.share_layers import share_layers, share_nothing
from autoshard.compiler.solve import solve
from autoshard.compiler.strategies import strategies
from autoshard.errors import CallError, InputError, InternalError
from autoshard.runtime.program import Program

log = logging.getLogger(__name__)

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]
CapturePass = Callable[[nn.Module, PassContext], fx.GraphModule]


def _keep(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    return gm


def _lowered(ctx: PassContext) -> bool:
    return ctx.backend != "interpret"


def _always(ctx: PassContext) -> bool:
    return True


@dataclass(frozen=True)
class PassSpec:
    """One pass: its name, what it runs, the ``PassContext`` fields it must leave set, what runs instead when
    the user disables it (None: it cannot be disabled) and when it applies (the interpreted program of
    ``LocalTensorMode`` is not lowered)."""

    name: str
    run: Pass | CapturePass
    produces: tuple[str, ...] = ()
    when_disabled: Pass | None = None
    applies: Callable[[PassContext], bool] = _always


PASSES: tuple[PassSpec, ...] = (
    PassSpec("capture", capture_model, ("signature", "output_roles")),
    PassSpec("coarsen", coarsen, ("groups",), when_disabled=coarsen_per_node),
    PassSpec("share_layers", share_layers, ("layer_of_group",), when_disabled=share_nothing),
    PassSpec("strategies", strategies, ("strategies",)),
    PassSpec("solve", solve, ("solution",)),
    PassSpec("lower", lower, ("planned",), applies=_lowered),
    PassSpec("partition", partition, ("forward_graph", "backward_graph"), applies=_lowered),
    PassSpec("overlap", overlap, (), when_disabled=_keep, applies=_lowered),
    PassSpec("compile", compile_program, ("program",), when_disabled=run_graphs),
)
PASS_NAMES: tuple[str, ...] = tuple(p.name for p in PASSES)
PLANNING = ("capture", "solve")  # the slice autoshard.plan runs
PROGRAM = ("lower", "compile")  # the slice autoshard.compile runs after it


def check_disabled(names: tuple[str, ...]) -> None:
    """Refuse a ``disable_passes`` entry that names no pass, or a pass the compiler cannot do without."""
    optional = [p.name for p in PASSES if p.when_disabled is not None]
    for name in names:
        if name not in PASS_NAMES:
            raise InputError(
                f"disable_passes: {name!r} is not a pass; the passes are {', '.join(PASS_NAMES)} "
                f"(of which these can be disabled: {', '.join(optional)})"
            )
        if name not in optional:
            raise InputError(
                f"disable_passes: the {name} pass cannot be disabled (every later pass needs what it "
                f"makes); these can: {', '.join(optional)}"
            )


def _check(spec: PassSpec, out: object, ctx: PassContext) -> None:
    if not isinstance(out, fx.GraphModule):
        raise CallError(f"pass {spec.name} returned {type(out).__name__}, not a torch.fx.GraphModule")
    for field in spec.produces:
        value = getattr(ctx, field)
        if value is None or (isinstance(value, (list, dict, tuple)) and not value):
            raise InternalError(f"pass {spec.name} did not set PassContext.{field}")


def run_passes(module: nn.Module, ctx: PassContext, first: str, last: str) -> fx.GraphModule:
    """Run the passes from ``first`` to ``last`` (inclusive) on ``module`` (the user's module when ``first`` is
    capture, else the graph the pass before ``first`` returned); returns the last pass's graph."""
    check_disabled(tuple(ctx.config.disable_passes))
    lo, hi = PASS_NAMES.index(first), PASS_NAMES.index(last)
    gm = module
    last_planning = PASS_NAMES.index(PLANNING[1])
    for i, spec in enumerate(PASSES[lo : hi + 1], start=lo):
        if not spec.applies(ctx):
            log.debug("autoshard pass %-12s not applicable (backend %s)", spec.name, ctx.backend)
            continue
        fn = spec.run
        if spec.name in ctx.config.disable_passes:
            log.info("autoshard pass %-12s disabled: running its stand-in", spec.name)
            fn = spec.when_disabled
        # planning runs on fake tensors whatever the caller's mode; the program passes run in it
        # (LocalTensorMode's interpreted program is built inside it)
        planning = i <= last_planning
        with ctx.timed(spec.name), tc.outside_local_tensor_mode() if planning else contextlib.nullcontext():
            out = fn(gm, ctx)
        _check(spec, out, ctx)
        gm = out
        if debug_enabled():
            log.info("graph after %s:\n%s", spec.name, gm.graph)
    return gm


def rank_program(gm: fx.GraphModule, ctx: PassContext, backend: str) -> Program:
    """The program passes (lower .. compile) on a planned graph: this rank's program. ``backend`` is
    "inductor" or "eager"; under ``LocalTensorMode`` the plan is interpreted instead (no rank graph)."""
    if backend not in BACKENDS:
        raise InputError(f"backend={backend!r} is not known; use one of {BACKENDS}")
    ctx.backend = "interpret" if tc.in_local_tensor_mode() else backend
    run_passes(gm, ctx, *PROGRAM)
    assert ctx.program is not None  # _check: compile sets it
    return ctx.program


__all__ = ["PASSES", "PASS_NAMES", "PLANNING", "PROGRAM", "PassSpec", "check_disabled", "rank_program", "run_passes"]
