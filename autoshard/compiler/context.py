"""The state one compiler run threads through its passes.

A ``PassContext`` is made per ``autoshard.plan``/``compile`` call and is the only mutable object the passes
share; nothing is kept at module level. Per-node facts live on the nodes themselves
(``node.meta["autoshard_*"]``), per-run products (groups, strategies, the solution, the program) live here,
each set by the pass named next to it (``autoshard/compiler/runner.py`` checks that it was).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from autoshard.cluster.profile import ClusterProfile
from autoshard.config import PlanConfig
from autoshard.ir import Group, GroupStrategy
from autoshard.runtime.program import Program

if TYPE_CHECKING:
    from autoshard._torch_compat.capture import OutputRole
    from autoshard.inputs import CallSignature
    from autoshard.solver.intra_op import IntraOpProblem, Solution
    from autoshard.solver.recipes import RecipeResult

log = logging.getLogger(__name__)

# compile(backend=...): "inductor" compiles the lowered graphs with Inductor, "eager" runs them as FX graphs. A
# context's backend may also be "interpret": under LocalTensorMode (every rank in one process, no rank graph)
# the plan is run on DTensors by the lowering's interpreter.
BACKENDS = ("inductor", "eager")
# the outputs the forward returns, in this order (capture puts them so): the loss (or a stage's activations), the
# model's other outputs, the buffers it updates (BatchNorm's running statistics); then come the gradients
FORWARD_KINDS = ("loss", "output", "buffer")

Progress = Callable[[str, float, str], None]  # (pass, fraction done, message), for a CLI's progress display


@dataclass
class PlanningCache:
    """What the planning attempts on one example share (the recomputation mixes under a budget, which differ only
    in ``config.recompute``; the recipes planned alone, which differ only in what the solve pins): the capture as
    traced, before any recomputation is tagged (``capture_layers``), and the candidate enumerator and priced groups of
    ``strategies`` (a group's signature holds its recomputation flags, so a group priced under one tagging is reused
    only where it is tagged alike)."""

    captured: tuple | None = None
    enumerator: Any = None
    alike: dict = field(default_factory=dict)
    # by recomputation tagging: the graph and context after the strategies pass, with the integer program once
    # built (``search/planned.py: _solved``)
    prepared: dict = field(default_factory=dict)
    # (recomputation tagging, recipe) -> the recipe's solve alongside a plan: its Solution under the budget, or
    # the InfeasibleBudget it met; the same recipe planned alone at that tagging takes it (``compiler/solve.py``)
    recipe_outcomes: dict = field(default_factory=dict)


@dataclass
class PassContext:
    mesh: DeviceMesh
    cluster: ClusterProfile
    config: PlanConfig
    broadcast_solution: bool = False  # rank 0 solves, the others receive (compile on a real process group)
    stage: bool = False  # a pipeline stage: tensor outputs with tangents, gradients of inputs (passes.capture)
    backend: str = "inductor"  # one of BACKENDS or "interpret": how lower .. compile make the rank program
    example_inputs: Any = None  # the global-shaped example call: tuple, dict or autoshard.inputs.Call
    progress: Progress | None = None
    cache: PlanningCache | None = None  # shared with the other planning attempts of one plan_graph call
    timings: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    # capture
    signature: CallSignature | None = None  # the example call's structure (autoshard.inputs)
    loss_form: Callable[[Any], Any] | None = None  # the loss shaped as the model returns it (capture.loss_form)
    output_roles: list[OutputRole] = field(default_factory=list)
    param_modules: dict[str, str] = field(default_factory=dict)  # parameter name -> its module's class name
    # (container path, layers captured, layers in the model) when only some repeated layers were captured
    sampled_layers: tuple[str, int, int] | None = None
    # coarsen
    groups: list[Group] = field(default_factory=list)
    # share_layers: group id -> its canonical group; group id -> how many real groups it stands for
    layer_of_group: dict[int, int] = field(default_factory=dict)
    group_weight: dict[int, float] = field(default_factory=dict)
    # strategies
    strategies: dict[int, list[GroupStrategy]] = field(default_factory=dict)
    # solve
    problem: IntraOpProblem | None = None  # the integer program (recipes re-solve it with layouts pinned)
    solution: Solution | None = None
    recipes: list[RecipeResult] = field(default_factory=list)  # each manual recipe solved alongside the plan
    # lower: the solved global graph it lowered, and which forward outputs have a tangent, in tangent order
    planned: fx.GraphModule | None = None
    tangent_of: tuple[int, ...] = ()
    # partition (then overlap reorders each in place)
    forward_graph: fx.GraphModule | None = None
    backward_graph: fx.GraphModule | None = None
    # compile
    program: Program | None = None

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        names = self.mesh.mesh_dim_names
        return tuple(names) if names else tuple(f"d{i}" for i in range(self.mesh.ndim))

    @property
    def forward_outputs(self) -> int:
        """How many outputs the forward returns (the loss, or a pipeline stage's activations, and the buffers it
        updates)."""
        return sum(1 for r in self.output_roles if r.kind in FORWARD_KINDS)

    def report(self, stage: str, fraction: float, message: str = "") -> None:
        if self.progress is not None:
            self.progress(stage, fraction, message)

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self.report(name, 0.0, "")
        yield
        dt = time.perf_counter() - t0
        self.report(name, 1.0, f"{dt:.2f} s")
        self.timings[name] = self.timings.get(name, 0.0) + dt
        log.info("autoshard pass %-12s %.3f s", name, dt)


def debug_enabled() -> bool:
    return os.environ.get("AUTOSHARD_DEBUG", "") not in ("", "0")
