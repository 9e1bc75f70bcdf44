"""The state one compiler run threads through its passes.

A ``PassContext`` is made per ``autoshard.plan``/``compile`` call and is the only mutable object the passes
share; nothing is kept at module level. Per-node facts live on the nodes themselves
(``node.meta["autoshard_*"]``), per-run products (groups, strategies, the solution) live here.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from autoshard.cluster import ClusterProfile
from autoshard.config import PlanConfig

log = logging.getLogger(__name__)


@dataclass
class PassContext:
    mesh: DeviceMesh
    cluster: ClusterProfile
    config: PlanConfig
    broadcast_solution: bool = False  # rank 0 solves, the others receive (compile on a real process group)
    stage: bool = False  # a pipeline stage: tensor outputs with tangents, gradients of inputs (passes.capture)
    timings: dict[str, float] = field(default_factory=dict)
    # filled in by the passes, in pipeline order
    signature: Any = None  # CallSignature of the example call (autoshard.inputs), set by capture
    output_roles: list[Any] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)
    strategies: dict[int, list[Any]] = field(default_factory=dict)
    layer_of_group: dict[int, Any] = field(default_factory=dict)
    # group id -> how many real groups it stands for (1 unless layers were sampled; see share_layers)
    group_weight: dict[int, float] = field(default_factory=dict)
    # (container path, layers captured, layers in the model) when only some repeated layers were captured
    sampled_layers: tuple[str, int, int] | None = None
    param_modules: dict[str, str] = field(default_factory=dict)  # parameter name -> its module's class name
    baselines: list[Any] = field(default_factory=list)  # BaselineResult per manual recipe (autoshard.baselines)
    progress: Any = None  # callable(stage, fraction done, message) for a CLI's progress display, or None
    problem: Any = None  # the IntraOpProblem solve built (baselines re-solve it with layouts pinned)
    solution: Any = None
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        names = self.mesh.mesh_dim_names
        return tuple(names) if names else tuple(f"d{i}" for i in range(self.mesh.ndim))

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
