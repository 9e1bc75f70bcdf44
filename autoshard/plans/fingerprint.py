"""What a plan was made for, so that a saved plan is only run on the program it fits, and a plan's digest.

``fingerprint`` names, part by part, what decides a plan: the traced program (every op in order, the parameters'
names, shapes, dtypes and which are frozen), the call's inputs (names, shapes, dtypes), the mesh, the cluster
profile (its numbers, hashed), the options that change the program (mixed precision, recomputation, the optimizer's
state) and the torch and autoshard versions (which change how a model traces and which candidates an op has).
``mismatch`` says which parts of two fingerprints differ, for the error of ``compile(..., plan=saved)``.

``canonical_json`` / ``digest``: the plan's JSON without its wall-clock fields (the solver's ``wall_s``), so that
the same inputs give byte-identical text and the same digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from autoshard.notation import mesh_str

if TYPE_CHECKING:
    from autoshard.cluster.profile import ClusterProfile
    from autoshard.config import PlanConfig
    from autoshard.plans.plan import Plan

Fingerprint = tuple[tuple[str, str], ...]
WALL_CLOCK = ("wall_s",)  # fields that measure this run, not the plan (SolverStats.wall_s)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _tensor(v: object) -> str:
    if not isinstance(v, torch.Tensor):
        return type(v).__name__
    return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"


def _version() -> str:
    try:
        return metadata.version("autoshard")
    except metadata.PackageNotFoundError:  # a source tree that is not installed
        return "unknown"


def fingerprint(
    gm: fx.GraphModule,
    mesh_shape: Sequence[int],
    mesh_names: Sequence[str],
    cluster: ClusterProfile,
    config: PlanConfig,
    input_names: Sequence[str] = (),
) -> Fingerprint:
    """The parts of what a plan of the captured graph ``gm`` was made for (see the module docstring)."""
    ops, params, inputs = [], [], []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            ops.append(str(n.target))
        elif n.op == "placeholder":
            role = n.meta.get("autoshard_role")
            if role is None or role.kind == "tangent":
                continue
            item = f"{role.name} {_tensor(n.meta.get('val'))}" + (" frozen" if n.meta.get("autoshard_frozen") else "")
            if role.kind == "input":
                alias = input_names[role.index] if role.index < len(input_names) else ""
                inputs.append(f"{alias or role.name} {_tensor(n.meta.get('val'))}")
            else:
                params.append(item)
    profile = cluster.to_dict() if hasattr(cluster, "to_dict") else repr(cluster)
    options = {
        "mixed_precision": config.mixed_precision,
        "reduce_dtype": config.reduce_dtype,
        "recompute": list(config.recompute),
        "optimizer": config.optimizer,
    }
    if config.mixed_precision:
        options["precision_policy"] = config.precision_policy
    return (
        (
            "program",
            f"{len(ops)} ops, {len(params)} parameters/buffers, {_digest(json.dumps(ops) + json.dumps(params))}",
        ),
        ("inputs", ", ".join(inputs)),
        ("mesh", mesh_str(tuple(mesh_shape), tuple(mesh_names))),
        ("cluster", f"{getattr(cluster, 'name', '?')} {_digest(json.dumps(profile, sort_keys=True, default=str))}"),
        ("options", json.dumps(options, sort_keys=True)),
        ("torch", torch.__version__),
        ("autoshard", _version()),
    )


def mismatch(saved: Fingerprint, now: Fingerprint) -> list[str]:
    """The parts that differ, each as ``part: saved ... / now ...``."""
    old, new = dict(saved), dict(now)
    return [
        f"{k}: the plan's {old.get(k, '(none)')!r}, now {new.get(k, '(none)')!r}"
        for k in dict.fromkeys([*old, *new])
        if old.get(k) != new.get(k)
    ]


def canonical_json(plan: Plan) -> str:
    """``plan.to_json()`` with its wall-clock fields zeroed: the same inputs give the same bytes."""

    def strip(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: (0.0 if k in WALL_CLOCK else strip(v)) for k, v in d.items()}
        if isinstance(d, list):
            return [strip(x) for x in d]
        return d

    return json.dumps(strip(json.loads(plan.to_json())), indent=1)


def digest(plan: Plan) -> str:
    """A short hash of :func:`canonical_json`."""
    return _digest(canonical_json(plan))


__all__ = ["Fingerprint", "canonical_json", "digest", "fingerprint", "mismatch"]
