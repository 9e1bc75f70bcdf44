"""The Plan: what autoshard decided, as a frozen, serializable value. Planning runs on a laptop for any device
count, execution on the cluster later, and a user reviews the decision in between: so the plan survives JSON
exactly (``Plan.from_json(p.to_json()) == p``), holds no torch objects (placements are notation strings such as
``"S(0)"``, dtypes names such as ``"float32"``) and reads as a table (:meth:`Plan.report`). It is a tuple of
stages: one spanning the whole mesh, or (pipeline parallelism) several, each on a sub-mesh with its own ranks,
layers and intra-op decisions."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from autoshard.errors import InputError
from autoshard.ir import layer_key
from autoshard.notation import dtype_bytes, dtype_name, local_shape, mesh_str, placements_str, placements_tuple

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TENSOR_ROLES = ("parameter", "buffer", "input")
PHASES = ("forward", "backward", "optimizer")
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send_recv")


def _set(obj: object, **values: Any) -> None:
    """Normalize fields of a frozen dataclass in ``__post_init__`` (lists from JSON become tuples, etc.)."""
    for k, v in values.items():
        object.__setattr__(obj, k, v)


def _check(value: str, allowed: Sequence[str], what: str, owner: str) -> None:
    if value not in allowed:
        raise InputError(f"{owner}: {what} {value!r} is not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh by shape and axis names, outer axis first (inner axes map to the faster links)."""

    shape: tuple[int, ...]
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        _set(self, shape=tuple(int(n) for n in self.shape), names=tuple(str(n) for n in self.names))
        if not len(self.shape) == len(self.names) == len(set(self.names)) or min(self.shape, default=1) < 1:
            raise InputError(f"mesh {self.shape} {self.names}: name every axis, once; sizes must be ≥ 1")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __str__(self) -> str:
        return mesh_str(self.shape, self.names)


@dataclass(frozen=True)
class TensorLayout:
    """Where one parameter, buffer or program input lives: global shape plus one placement per mesh axis.

    A parameter whose gradient or optimizer state is sharded further than it is computed with (ZeRO-1/2) also
    gives ``grad_placements`` / ``state_placements`` (empty: the same as ``placements``). ``frozen``: a parameter
    the step takes no gradient of (``requires_grad=False``), which holds no gradient and no optimizer state."""

    name: str
    role: str
    shape: tuple[int, ...]
    dtype: str
    placements: tuple[str, ...]
    grad_placements: tuple[str, ...] = ()
    state_placements: tuple[str, ...] = ()
    offload: str = ""  # "optimizer" / "params": master and optimizer state in host memory (ZeRO-Offload)
    frozen: bool = False  # (left out of the JSON when False: plans of trainable models read as before)

    def __post_init__(self) -> None:
        _check(self.role, TENSOR_ROLES, "role", f"tensor {self.name!r}")
        _check(self.offload, ("", "optimizer", "params"), "offload", f"tensor {self.name!r}")
        _set(self, shape=tuple(int(d) for d in self.shape), dtype=dtype_name(self.dtype), frozen=bool(self.frozen))
        _set(
            self,
            placements=placements_tuple(self.placements),
            grad_placements=placements_tuple(self.grad_placements),
            state_placements=placements_tuple(self.state_placements),
        )
        if any(w and len(w) != len(self.placements) for w in (self.grad_placements, self.state_placements)):
            raise InputError(f"tensor {self.name!r}: grad/state placements need one placement per mesh axis")
        if self.frozen and (self.role != "parameter" or self.offload or self.zero):
            raise InputError(
                f"tensor {self.name!r}: only a parameter can be frozen, and a frozen one has no optimizer "
                "state to shard (ZeRO) or offload; drop its state_placements and offload"
            )

    @property
    def zero(self) -> str:
        """ "zero1" / "zero2" when the optimizer state is sharded further than the parameter, else ""."""
        if not self.state_placements or self.state_placements == self.placements:
            return ""
        return "zero1" if self.grad_placements in ((), self.placements) else "zero2"

    def local_shape(self, mesh: MeshSpec) -> tuple[int, ...]:
        """Per-device shape on ``mesh``; raises ValueError (naming the tensor) if a shard is uneven."""
        try:
            return local_shape(self.shape, self.placements, mesh.shape)
        except ValueError as e:
            raise InputError(f"tensor {self.name!r}: {e}") from None


@dataclass(frozen=True)
class OpDecision:
    """One decision group's choice, reported at its anchor op (the matmul/norm/... the group follows).

    ``dtype`` (the anchor output's, e.g. ``"float32"``) is optional so decisions print as ``f32[8, 256]``.
    """

    node: str
    op: str
    module: str
    phase: str
    shape: tuple[int, ...]
    output: tuple[str, ...]
    inputs: tuple[tuple[str, ...], ...]
    compute_s: float
    group_size: int
    dtype: str = ""

    def __post_init__(self) -> None:
        _check(self.phase, PHASES, "phase", f"decision {self.node!r}")
        _set(self, shape=tuple(int(d) for d in self.shape), output=placements_tuple(self.output))
        _set(self, inputs=tuple(placements_tuple(ps) for ps in self.inputs), compute_s=float(self.compute_s))
        _set(self, group_size=int(self.group_size), dtype=dtype_name(self.dtype) if self.dtype else "")


@dataclass(frozen=True)
class CollectiveStat:
    """One collective the program runs per step: what, on which mesh axis, how big, how long, and why."""

    kind: str
    axis: str
    nbytes: int
    time_s: float
    tensor: str
    consumer: str
    phase: str
    repeat: float = 1.0  # how many times per step (> 1 when a captured layer stands for uncaptured ones)
    owner: str = ""  # the module of the op (or parameter) that waits for it: the layer it is counted in

    def __post_init__(self) -> None:
        _check(self.kind, COLLECTIVE_KINDS, "kind", f"collective on {self.tensor!r}")
        _check(self.phase, PHASES, "phase", f"collective on {self.tensor!r}")
        _set(self, nbytes=int(self.nbytes), time_s=float(self.time_s), repeat=float(self.repeat))


class CollectiveRow(NamedTuple):
    """One row of :meth:`Plan.collective_summary`; a tuple, so ``kind, axis, n, b, t = row`` works."""

    kind: str
    axis: str
    count: int
    nbytes: int
    time_s: float


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device at the step's peak, split the way users act on it (shard params? offload optimizer?)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporaries: int = 0  # the rest of the peak: backward temporaries, gathered weights (autoshard/cost/memory.py)
    host: int = 0  # offloaded masters, their gradients and optimizer state, in host memory (not in total)

    def __post_init__(self) -> None:
        _set(self, **{f.name: int(getattr(self, f.name)) for f in dataclasses.fields(self)})

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.temporaries

    @property
    def state(self) -> int:
        """Parameters, gradients and optimizer state: what neither recomputation nor micro-batches shrink."""
        return self.parameters + self.gradients + self.optimizer


@dataclass(frozen=True)
class SolverStats:
    """How the solver got there: a plan whose gap is large is a plan worth re-solving with more time."""

    status: str
    objective_s: float
    bound_s: float
    wall_s: float
    groups: int
    variables: int
    shared_layers: int

    def __post_init__(self) -> None:
        _set(self, objective_s=float(self.objective_s), bound_s=float(self.bound_s), wall_s=float(self.wall_s))

    @property
    def gap(self) -> float:
        return (self.objective_s - self.bound_s) / self.objective_s if self.objective_s else 0.0


OUTSIDE = "outside the layers"


def block_of(module: str) -> str:
    """The row of the per-layer breakdown a module's work is counted in: its repeated layer, or outside them."""
    key = layer_key(module)
    return f"{key[0]}.{key[1]}" if key else OUTSIDE


@dataclass(frozen=True)
class LayerTime:
    """One block of a stage's step on each of its devices: a layer (``"layers.3"``), a module outside the layers,
    or a part of the step no layer owns (``"stage boundary sends"``, ``"optimizer step"``). ``forward_s`` and
    ``backward_s`` are one run's (a micro-batch's), the activation communication they wait for included
    (``forward_comm_s`` and ``backward_comm_s`` of them); ``recompute_s`` the forward run again in the backward; a
    step runs them ``runs`` times; ``step_s`` is once a step (gradient reductions not hidden, ZeRO's gathers
    after the step, the optimizer update). The rows of a stage add up to its ``compute_s + comm_s``."""

    name: str
    forward_s: float
    backward_s: float
    runs: float = 1.0
    step_s: float = 0.0
    forward_comm_s: float = 0.0
    backward_comm_s: float = 0.0
    recompute_s: float = 0.0

    @property
    def run_s(self) -> float:
        """One run (micro-batch): forward, backward and the replayed forward."""
        return self.forward_s + self.backward_s + self.recompute_s

    @property
    def per_step_s(self) -> float:
        return self.runs * self.run_s + self.step_s


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a sub-mesh, its global ranks, its layers and its intra-op plan."""

    index: int
    mesh: MeshSpec
    ranks: tuple[int, ...]
    layers: tuple[str, ...]
    tensors: tuple[TensorLayout, ...]
    ops: tuple[OpDecision, ...]
    collectives: tuple[CollectiveStat, ...]
    memory: MemoryBreakdown
    compute_s: float  # per step on each of the stage's devices (every micro-batch), as is comm_s
    comm_s: float
    microbatch_time_s: float = 0.0  # pipelined: forward + backward of one micro-batch, boundary sends included
    offload_s: float = 0.0  # offload's host copies and host optimizer step per step (in compute_s)
    layer_times: tuple[LayerTime, ...] = ()  # the step per block, adding up to compute_s + comm_s

    def __post_init__(self) -> None:
        _set(self, ranks=tuple(int(r) for r in self.ranks), layers=tuple(self.layers), tensors=tuple(self.tensors))
        _set(self, ops=tuple(self.ops), collectives=tuple(self.collectives), layer_times=tuple(self.layer_times))
        _set(
            self,
            compute_s=float(self.compute_s),
            comm_s=float(self.comm_s),
            microbatch_time_s=float(self.microbatch_time_s),
            offload_s=float(self.offload_s),
        )
        if self.ranks and len(self.ranks) != self.mesh.size:
            raise InputError(f"stage {self.index}: {len(self.ranks)} ranks for mesh {self.mesh} of {self.mesh.size}")
        ndim = len(self.mesh.shape)
        for t in self.tensors:
            if len(t.placements) != ndim:
                raise InputError(
                    f"stage {self.index}: tensor {t.name!r} has placements {placements_str(t.placements)} "
                    f"for a {ndim}-axis mesh {self.mesh}; give one placement per mesh axis"
                )

    def collective_summary(self) -> list[CollectiveRow]:
        """This stage's collectives per step by (kind, axis), most expensive first."""
        return summarize_collectives(self.collectives)


@dataclass(frozen=True)
class RecipeSummary:
    """A manual recipe costed in the same model as the plan (``autoshard.solver.recipes``)."""

    name: str
    step_time_s: float  # inf when the recipe does not apply
    peak_memory_bytes: int
    fits: bool  # within the memory budget
    note: str = ""
    measured_s: float = 0.0  # autotune: its median step measured on the mesh (0: not measured)
    differences: tuple[str, ...] = ()  # the largest terms of its difference with the plan (plans/explain.py)
    measured_peak_bytes: int = 0  # autotune on CUDA: the largest rank's peak device memory (0: not measured)
    # how it was priced: its recomputation (notation.describe; "" none), its gradient-accumulation micro-batches,
    # and its parameters, gradients and optimizer state per device (what neither of the two frees)
    recompute: str = ""
    microbatches: int = 1
    state_bytes: int = 0

    def __post_init__(self) -> None:
        _set(
            self,
            step_time_s=float(self.step_time_s),
            peak_memory_bytes=int(self.peak_memory_bytes),
            measured_s=float(self.measured_s),
            differences=tuple(str(d) for d in self.differences),
            measured_peak_bytes=int(self.measured_peak_bytes),
            microbatches=int(self.microbatches),
            state_bytes=int(self.state_bytes),
        )

    @property
    def applies(self) -> bool:
        return math.isfinite(self.step_time_s)

    @property
    def how(self) -> str:
        """How it was priced, in words: ``layers.0-9 full, layers.10-31 selective; 2 micro-batches``."""
        return "; ".join(
            x
            for x in (
                self.recompute and f"recomputing {self.recompute}",
                self.microbatches > 1 and f"{self.microbatches} micro-batches",
            )
            if x
        )


@dataclass(frozen=True)
class Plan:
    """The whole decision: stages, predicted step time and memory, and how the solver fared."""

    mesh: MeshSpec
    cluster: str
    stages: tuple[StagePlan, ...]
    step_time_s: float
    solver: SolverStats
    schedule: str | None = None
    microbatches: int = 1
    model: str = ""  # what was planned (a zoo name, a config file, or the module's class)
    recipe: str = ""  # "" for a solved plan, else the manual recipe it realises ("fsdp", ...)
    tokens_per_step: int = 0  # global tokens (or samples' patches) one step trains on; 0 when unknown
    model_flops_per_step: float = 0.0  # model FLOPs of one step (6 N T + attention), for MFU; 0 when unknown
    peak_flops_per_device: float = 0.0  # the device's dense peak for the model's dtype
    hidden_comm_s: float = 0.0  # communication the cost model assumes overlapped (already out of step_time_s)
    memory_budget_bytes: int = 0  # 0 = none given
    mixed_precision: str = ""  # "bfloat16": the step in it (fp32 masters, gradients, state); "": the model's dtype
    reduce_dtype: str = ""  # under mixed_precision, the dtype gradients are reduced in
    # under mixed_precision: "params" (bf16 parameters, the whole step in bf16) or "autocast"; "" read as autocast
    precision_policy: str = ""
    sampled_layers: str = ""  # e.g. "layers: 3 of 80 captured" when identical layers were extrapolated
    recipes: tuple[RecipeSummary, ...] = ()
    format_version: int = FORMAT_VERSION
    chunks: int = 1  # model chunks per pipeline rank (interleaved schedules); each stage's layers hold all of its
    bubble_fraction: float = 0.0  # predicted idle share of the step on the busiest stage (pipelined plans)
    recompute: bool = False  # layers run their forward again in the backward (pipelined: all; else config.recompute)
    recompute_layers: tuple[
        str, ...
    ] = ()  # which modules replay, in which mode ("layers.3:selective"; notation.parse_spec)
    recompute_s: float = 0.0  # predicted time the replays add to the step (in step_time_s)
    fingerprint: tuple[tuple[str, str], ...] = ()  # what the plan was made for (autoshard/plans/fingerprint.py)
    measured_s: float = 0.0  # autotune: this plan's median step measured on the mesh; recipes hold the others'
    measured_peak_bytes: int = 0  # autotune on CUDA: the largest rank's peak device memory (0: not measured)

    def __post_init__(self) -> None:
        _set(self, stages=tuple(self.stages), step_time_s=float(self.step_time_s), microbatches=int(self.microbatches))
        _set(self, recipes=tuple(self.recipes), tokens_per_step=int(self.tokens_per_step))
        _set(self, chunks=int(self.chunks), bubble_fraction=float(self.bubble_fraction), recompute=bool(self.recompute))
        _set(
            self,
            recompute_layers=tuple(self.recompute_layers),
            recompute_s=float(self.recompute_s),
            fingerprint=tuple((str(k), str(v)) for k, v in self.fingerprint),
            measured_peak_bytes=int(self.measured_peak_bytes),
        )
        if self.microbatches < 1 or self.chunks < 1 or not 0.0 <= self.bubble_fraction < 1.0:
            raise InputError(
                f"plan: microbatches {self.microbatches} and chunks {self.chunks} must be >= 1 and "
                f"bubble_fraction {self.bubble_fraction} in [0, 1)"
            )
        if [s.index for s in self.stages] != list(range(len(self.stages))):
            raise InputError(f"stage indices {[s.index for s in self.stages]} must be 0, 1, ... in order")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s if self.tokens_per_step and self.step_time_s > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: model FLOPs per second over the peak of every device."""
        peak = self.peak_flops_per_device * self.mesh.size
        return self.model_flops_per_step / self.step_time_s / peak if peak and self.step_time_s > 0 else 0.0

    def best_recipe(self) -> RecipeSummary | None:
        """The fastest recipe that applies and fits the budget (None if none does)."""
        ok = [b for b in self.recipes if b.applies and b.fits]
        return min(ok, key=lambda b: b.step_time_s) if ok else None

    def parameter_placements(self) -> dict[str, tuple[str, ...]]:
        """Parameter name -> placements, over all stages (a name in two stages keeps its first stage's)."""
        out: dict[str, tuple[str, ...]] = {}
        for t in (t for stage in self.stages for t in stage.tensors if t.role == "parameter"):
            out.setdefault(t.name, t.placements)
        return out

    def input_placements(self) -> tuple[tuple[str, ...], ...]:
        """Placements of the program inputs ``input[0], input[1], ...`` in index order, over all stages."""
        found: dict[int, tuple[str, ...]] = {}
        for t in (t for stage in self.stages for t in stage.tensors if t.role == "input"):
            if m := re.fullmatch(r"input\[(\d+)\]", t.name):
                found.setdefault(int(m.group(1)), t.placements)
        if missing := sorted(set(range(len(found))) - set(found)):
            raise InputError(f"plan lists inputs {sorted(found)} but not input[{missing[0]}]; inputs must be dense")
        return tuple(found[i] for i in range(len(found)))

    @property
    def peak_memory(self) -> MemoryBreakdown:
        """Memory of the stage whose devices hold the most: the number that decides whether the plan fits."""
        if not self.stages:
            return MemoryBreakdown(0, 0, 0, 0)
        return max((s.memory for s in self.stages), key=lambda m: m.total)

    def collective_summary(self) -> list[CollectiveRow]:
        """Collectives per step over all stages by (kind, axis), most expensive first."""
        return summarize_collectives(c for s in self.stages for c in s.collectives)

    def frozen_parameters(self) -> tuple[int, int]:
        """(how many, bytes) of the parameters the step takes no gradient of, over all stages (each name once)."""
        seen = {t.name: t for stage in self.stages for t in stage.tensors if t.role == "parameter" and t.frozen}
        return len(seen), sum(math.prod(t.shape) * dtype_bytes(t.dtype) for t in seen.values())

    def to_json(self) -> str:
        return json.dumps(_defaults_left_out(dataclasses.asdict(self)), indent=1)

    @classmethod
    def from_json(cls, s: str) -> Plan:
        d = json.loads(s)
        version = d.get("format_version") if isinstance(d, dict) else None
        if version != FORMAT_VERSION:
            raise InputError(f"plan format_version {version!r} is not {FORMAT_VERSION}; re-plan with this autoshard")
        if "baselines" in d:  # plans written before the recipes had one name
            d["recipes"] = d.pop("baselines")
        plan = _build(cls, d, "plan")
        logger.debug("loaded plan: mesh %s, %d stage(s)", plan.mesh, len(plan.stages))
        return plan


# fields newer than FORMAT_VERSION 1, written only where not at their default
_LEFT_OUT = {"frozen": False, "recompute": "", "state_bytes": 0, "precision_policy": "", "owner": ""}


def _defaults_left_out(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _defaults_left_out(v) for k, v in d.items() if k not in _LEFT_OUT or v != _LEFT_OUT[k]}
    if isinstance(d, (list, tuple)):  # (asdict keeps a field's tuples)
        return [_defaults_left_out(v) for v in d]
    return d


def _nested(key: str) -> tuple[type, bool] | None:
    """The value type stored under a JSON key, and whether it is a list of them (field names are unique)."""
    one = {"mesh": MeshSpec, "solver": SolverStats, "memory": MemoryBreakdown}
    many = {
        "stages": StagePlan,
        "tensors": TensorLayout,
        "ops": OpDecision,
        "collectives": CollectiveStat,
        "recipes": RecipeSummary,
        "layer_times": LayerTime,
    }
    return (one[key], False) if key in one else (many[key], True) if key in many else None


def _build(cls: type, d: Any, path: str) -> Any:
    """Construct ``cls`` from a JSON object, naming the path of any missing or unknown key."""
    if not isinstance(d, dict):
        raise InputError(f"plan JSON at {path}: expected an object for {cls.__name__}, got {type(d).__name__}")
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise InputError(f"plan JSON at {path}: unknown keys {unknown} for {cls.__name__}")
    kwargs = dict(d)
    for k, v in d.items():
        if (nested := _nested(k)) is not None:
            sub, many = nested
            at = f"{path}.{k}"
            kwargs[k] = [_build(sub, x, f"{at}[{j}]") for j, x in enumerate(v)] if many else _build(sub, v, at)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise InputError(f"plan JSON at {path}: {e}") from None


def summarize_collectives(collectives: Iterable[CollectiveStat]) -> list[CollectiveRow]:
    """Collectives added up by (kind, axis): count, bytes and time per step, most expensive first."""
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for c in collectives:
        row = acc[(c.kind, c.axis)]
        row[0] += c.repeat
        row[1] += c.nbytes * c.repeat
        row[2] += c.time_s * c.repeat
    rows = [CollectiveRow(k, a, int(round(n)), int(b), t) for (k, a), (n, b, t) in acc.items()]
    return sorted(rows, key=lambda r: (-r.time_s, r.kind, r.axis))
