"""Planner and compiler options: one keyword-only, validated, frozen dataclass."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from torch.distributed.tensor.placement_types import Placement, Replicate

from autoshard.errors import InputError
from autoshard.notation import parse_bytes, parse_placement, parse_placements

# optimizer-state bytes per parameter byte. "adamw-mixed": 16-bit parameters and gradients with fp32 master weights
# and fp32 moments (12 bytes per 2-byte parameter), the mixed-precision Adam of Megatron-LM and of ZeRO's
# "16 bytes per parameter" (Rajbhandari et al. 2020, section 3.1)
OPTIMIZER_STATE_FACTOR = {"adamw": 2, "adam": 2, "adamw-mixed": 6, "sgd": 1, "none": 0}

# A constraint value: either a full placement list (one per mesh axis: "[S(0), R]", ("S(0)", "R"),
# [Shard(0), Replicate()]) or a partial mapping {axis name: placement} that leaves other axes free.
ConstraintValue = Union[str, Sequence[Union[str, Placement, None]], Mapping[str, Union[str, Placement]]]


# the manual recipes a plan can be forced to (PlanConfig.recipe) and is compared with (autoshard.solver.recipes)
# gradient buckets of the lowered program (autoshard/compiler/lower_buckets.py) and the memory they take
# (cost/memory.py): DDP's defaults, a small first bucket so that its reduction starts early, then 25 MiB
FIRST_BUCKET_BYTES = 2**20
BUCKET_BYTES = 25 * 2**20

# PlanConfig.mixed_precision: the dtype the step computes in (fp32 master weights, gradients and state)
MIXED_PRECISION = {"bf16": "bfloat16", "bfloat16": "bfloat16"}
# PlanConfig.precision_policy: how mixed_precision runs (autoshard/compiler/precision.py). "params": FSDP2's
# MixedPrecisionPolicy(param_dtype=bf16): the parameters cast to bf16 and the whole forward and backward in bf16, fp32
# masters, gradients and state; "autocast": torch.autocast (bf16 matmuls, every other op in fp32)
PRECISION_POLICIES = ("params", "autocast")
# PlanConfig.reduce_dtype: the dtype gradients are reduced in under mixed precision
REDUCE_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
# PlanConfig.offload (ZeRO-Offload, autoshard/compiler/parameter_forms.py: offload_variants): a parameter's optimizer
# state and the master it steps held and stepped in host memory. "auto": the solver's choice where device memory forces
# it (not on a CPU cluster, whose host memory is the device's); "none": never; "optimizer": every parameter's; "params":
# every parameter's, with ZeRO-3 compute layouts (the device keeps only a shard of each parameter)
OFFLOAD_MODES = ("auto", "none", "optimizer", "params")

RECIPES = ("ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "fsdp+tp", "ep", "cp")
ALIASES = {
    "megatron": "tp",
    "megatron-tp": "tp",
    "zero3": "fsdp",
    "2d": "fsdp+tp",
    "fsdp+megatron": "fsdp+tp",
    "zero-1": "zero1",
    "zero-2": "zero2",
    "zero-3": "fsdp",
    "hybrid": "hsdp",
    "fsdp+ep": "ep",
    "expert": "ep",
    "context": "cp",
    "fsdp+cp": "cp",
}


def normalize(name: str) -> str:
    """A recipe's canonical name (aliases such as "zero3" or "megatron" accepted)."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in RECIPES:
        raise InputError(
            f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)} "
            f"(aliases: {', '.join(f'{a}={b}' for a, b in ALIASES.items())})"
        )
    return key


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """What the planner optimizes under.

    ``constraints`` pins placements. Keys are ``"inputs"`` (every input), ``"input[i]"`` (one input),
    ``"params"`` (every parameter) or a glob over parameter names (``"layers.*.mlp.fc1.weight"``); values are a
    full placement list or ``{mesh axis name: placement}``, e.g. ``{"inputs": {"dp": Shard(0)}}`` shards the batch
    over ``dp`` and leaves the other axes to the solver.

    ``solve_recipes`` solves each manual recipe that applies (``autoshard.solver.recipes``) alongside the plan and keeps
    the fastest that fits when a time-limited search ends slower, so the plan is never slower than it.
    ``recipe`` ("ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "fsdp+tp", "ep", "cp") makes the plan that recipe instead
    of a free choice. ``shard_state`` lets the solver place a parameter's gradient and optimizer state apart from the
    parameter (ZeRO-1/2: state sharded over axes where the parameter is replicated). ``sample_layers`` captures only
    that many of a model's identical repeated layers and lets them stand for all of them (planning only: the plan's
    costs and memory count every layer; ``compile`` needs every layer).
    """

    memory_budget: int | None = None
    constraints: Mapping[str, ConstraintValue] = field(default_factory=dict)
    optimizer: str = "adamw"
    time_limit_s: float = 30.0
    share_layers: bool = True
    disable_passes: tuple[str, ...] = ()
    num_workers: int = 1
    seed: int = 0
    solve_recipes: bool = True
    recipe: str | None = None
    sample_layers: int | None = None
    tie_axes: bool = True
    shard_state: bool = True
    # "bf16": the step run in bf16 on bf16 casts of the fp32 parameters, which stay the master weights the optimizer
    # steps; precision_policy says how (PRECISION_POLICIES)
    mixed_precision: str | None = None
    precision_policy: str = "params"
    reduce_dtype: str = "float32"  # gradients reduced in this dtype under mixed_precision
    offload: str = "auto"
    reuse: Any = None  # a saved Plan whose choices are run instead of solving (compile(..., plan=saved))
    recompute: tuple[
        str, ...
    ] = ()  # module paths whose forward the backward runs again (autoshard/compiler/capture_recompute.py)
    # picks the scalar loss out of what forward returns; default: a tensor itself, a ModelOutput's or dict's
    # "loss", a tuple's first element (autoshard/compiler/capture.py: loss_of)
    loss_fn: Callable[[Any], Any] | None = None
    # random ops (docs/guide/api.md, "Random numbers"): "local", each rank draws only its piece, from a stream of that
    # piece (replicas alike, the seed honoured); "exact", each rank draws one device's numbers (every random tensor
    # whole, its piece kept: a fifth of a CPU GPT-2 step at dp=2, benchmarks/random_draws.py)
    random: str = "local"

    def __post_init__(self) -> None:
        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        if self.optimizer not in OPTIMIZER_STATE_FACTOR:
            raise InputError(
                f"optimizer={self.optimizer!r} is not known; use one of {sorted(OPTIMIZER_STATE_FACTOR)} "
                "(it sets how many optimizer-state bytes each parameter byte costs)"
            )
        if self.recipe is not None:
            object.__setattr__(self, "recipe", normalize(self.recipe))
        if self.mixed_precision is not None:
            key = str(self.mixed_precision).removeprefix("torch.").lower()
            if key in ("fp16", "float16", "half"):
                raise InputError("mixed_precision='fp16' needs loss scaling, which autoshard does not do; use 'bf16'")
            if key not in MIXED_PRECISION:
                raise InputError(f"mixed_precision={self.mixed_precision!r} is not known; use 'bf16' (or None)")
            object.__setattr__(self, "mixed_precision", MIXED_PRECISION[key])
        if self.precision_policy not in PRECISION_POLICIES:
            raise InputError(
                f"precision_policy={self.precision_policy!r} is not known; use 'params' (bf16 parameters, "
                "the whole step in bf16: FSDP2's MixedPrecisionPolicy) or 'autocast' (torch.autocast)"
            )
        key = str(self.reduce_dtype).removeprefix("torch.").lower()
        if key not in REDUCE_DTYPES:
            raise InputError(f"reduce_dtype={self.reduce_dtype!r} is not known; use 'float32' or 'bfloat16'")
        object.__setattr__(self, "reduce_dtype", REDUCE_DTYPES[key])
        if self.offload not in OFFLOAD_MODES:
            raise InputError(
                f"offload={self.offload!r} is not known; use one of {', '.join(OFFLOAD_MODES)} (auto: "
                "host memory where device memory forces it, none: never, optimizer/params: always)"
            )
        if self.random not in ("exact", "local"):
            raise InputError(
                f"random={self.random!r} is not known; use 'exact' (one device's numbers, each rank drawing "
                "every random tensor whole) or 'local' (each rank draws only its piece: cheaper)"
            )
        if isinstance(self.recompute, str):
            object.__setattr__(self, "recompute", (self.recompute,))
        object.__setattr__(self, "recompute", tuple(self.recompute))
        if self.sample_layers is not None and self.sample_layers < 2:
            raise InputError(f"sample_layers must be >= 2 (or None to capture every layer), got {self.sample_layers}")
        if self.time_limit_s <= 0:
            raise InputError(f"time_limit_s must be positive, got {self.time_limit_s}")

    @property
    def optimizer_factor(self) -> int:
        return OPTIMIZER_STATE_FACTOR[self.optimizer]

    @property
    def precision_fields(self) -> dict[str, str]:
        """The ``Plan`` fields that record the precision it was planned in."""
        if self.mixed_precision is None:
            return {}
        return {
            "mixed_precision": self.mixed_precision,
            "reduce_dtype": self.reduce_dtype,
            "precision_policy": self.precision_policy,
        }

    @property
    def reduce_itemsize(self) -> int | None:
        """Bytes per element gradients are reduced in when that is not their own dtype (mixed precision with
        ``reduce_dtype="bfloat16"``: fp32 gradients cast to bf16 for their reduction); None otherwise."""
        return 2 if self.mixed_precision is not None and self.reduce_dtype == "bfloat16" else None

    def check_constraints(self, params: Sequence[str], inputs: Sequence[str], mesh_names: Sequence[str]) -> None:
        """Refuse a constraint that would be silently ignored: a key that names no input and whose glob matches
        no parameter, or a mesh axis the mesh does not have. ``inputs`` are the arguments' names in the call
        (``input_ids``, ``args[0]``); ``input[i]`` keys count the tensor inputs."""
        for key, value in self.constraints.items():
            _to_axis_list(value, mesh_names, key)
            if key in ("inputs", "params") or key in inputs:
                continue
            if key.startswith("input[") and key.endswith("]"):
                idx = key[len("input[") : -1]
                if idx.isdigit() and int(idx) < len(inputs):
                    continue
                raise InputError(
                    f"constraint {key!r}: the model is called with {len(inputs)} tensor inputs "
                    f"({', '.join(inputs)}); use input[0] .. input[{len(inputs) - 1}] or their names"
                )
            if not any(fnmatch.fnmatchcase(p, key) for p in params):
                close = sorted(params, key=lambda p: -_common(p, key))[:3]
                raise InputError(
                    f"constraint {key!r} matches no parameter and no input; keys are 'inputs', 'params', an input "
                    f"('input[i]' or an argument name: {', '.join(inputs) or 'none'}) or a glob over parameter names "
                    f"(such as {', '.join(close)})"
                )

    def constraint_for(
        self, name: str, role: str, mesh_names: Sequence[str], alias: str = ""
    ) -> tuple[Placement | None, ...] | None:
        """Pinned placement per mesh axis (None = free) for a parameter/input, or None when unconstrained.
        ``alias``: an input's argument name (``attention_mask``), which a constraint may use for it."""
        keys: list[str] = []
        if role == "input":
            keys = ["inputs", name] + ([alias] if alias else [])
        elif role in ("parameter", "buffer"):
            keys = ["params"] + [
                k for k in self.constraints if k not in ("inputs", "params") and fnmatch.fnmatchcase(name, k)
            ]
        found: list[Placement | None] | None = None
        for key in keys:
            if key not in self.constraints:
                continue
            value = self.constraints[key]
            pinned = _to_axis_list(value, mesh_names, key)
            if found is None:
                found = [None] * len(mesh_names)
            for i, p in enumerate(pinned):
                if p is not None:
                    found[i] = p
        return None if found is None else tuple(found)


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _to_axis_list(value: ConstraintValue, mesh_names: Sequence[str], key: str) -> list[Placement | None]:
    if isinstance(value, Mapping):
        out: list[Placement | None] = [None] * len(mesh_names)
        for axis, p in value.items():
            if axis not in mesh_names:
                raise InputError(
                    f"constraint {key!r} names mesh axis {axis!r}, but the mesh axes are {tuple(mesh_names)}"
                )
            out[list(mesh_names).index(axis)] = p if isinstance(p, Placement) else parse_placement(str(p))
        return out
    if isinstance(value, str):
        pls = list(parse_placements(value))
    else:
        pls = [p if isinstance(p, Placement) else parse_placement(str(p)) for p in value]
    if len(pls) != len(mesh_names):
        raise InputError(
            f"constraint {key!r} gives {len(pls)} placements but the mesh has {len(mesh_names)} axes "
            f"{tuple(mesh_names)}; give one placement per axis, or a mapping {{axis: placement}}"
        )
    return pls


def replicate_all(ndim: int) -> tuple[Placement, ...]:
    return tuple(Replicate() for _ in range(ndim))
