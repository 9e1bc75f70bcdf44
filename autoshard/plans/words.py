"""A plan in words: what each mesh axis does, the pipeline, memory against the budget and speed against the best
recipe, in one sentence (the first line of the terminal report and the HTML page's title).

Each axis is named after the recipe its layouts realise, read off the parameters and the program inputs:

- the batch split over the axis (dim 0 of an input, or of the outputs of most of the forward's compute):
  data parallelism; with the parameters sharded over it too,
  FSDP (ZeRO-3); with only the optimizer state (and gradients) sharded, ZeRO-1 (ZeRO-2); else DDP;
- the sequence (dim 1 of an input) split: context parallelism;
- the parameters sharded and the batch not: tensor parallelism (Megatron), "with sequence-parallel norms" when
  the forward's layer norms run on sequence shards; expert weights sharded on their expert dim: expert
  parallelism;
- nothing split: the axis is not used (every device on it repeats the same work).

Where only part of the parameter bytes follows the rule the share is given ("FSDP on 62% of parameter bytes").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.notation import describe, format_bytes, format_seconds
from autoshard.plans.plan import Plan, StagePlan, TensorLayout

_NORMS = ("native_layer_norm", "rms_norm", "_fused_rms_norm")


@dataclass(frozen=True)
class AxisRole:
    """What one mesh axis does in a stage: ``kind`` is "dp", "fsdp", "zero1", "zero2", "tp", "cp", "ep" or
    "unused"; ``words`` says it for a reader; ``share`` is the fraction of parameter bytes sharded over it."""

    axis: str
    size: int
    kind: str
    words: str
    share: float


def _sharded(p: str) -> bool:
    return p.startswith("S(")


def _bytes(t: TensorLayout) -> int:
    return math.prod(t.shape) if t.shape else 1


def axis_roles(stage: StagePlan) -> list[AxisRole]:
    """The role of every mesh axis of ``stage`` (size-1 axes included, as "unused")."""
    params = [t for t in stage.tensors if t.role == "parameter"]
    inputs = [t for t in stage.tensors if t.role == "input" and t.shape]
    total = sum(_bytes(t) for t in params) or 1
    out = []
    for i, (name, size) in enumerate(zip(stage.mesh.names, stage.mesh.shape)):
        batch = any(t.placements[i] == "S(0)" for t in inputs) or _batch_split(stage, i)
        seq = any(t.placements[i] == "S(1)" and len(t.shape) > 1 for t in inputs)
        share = sum(_bytes(t) for t in params if _sharded(t.placements[i])) / total
        state = (
            sum(
                _bytes(t)
                for t in params
                if not _sharded(t.placements[i]) and t.state_placements and _sharded(t.state_placements[i])
            )
            / total
        )
        grads = any(
            t.grad_placements and _sharded(t.grad_placements[i]) and not _sharded(t.placements[i]) for t in params
        )
        experts = any("expert" in t.name and t.placements[i] == "S(0)" and len(t.shape) == 3 for t in params)
        kind, words = _role(name, size, batch, seq, share, state, grads, experts, _sequence_norms(stage, i))
        out.append(AxisRole(name, size, kind, words, share))
    return out


def _share(f: float) -> str:
    return "" if f > 0.95 else f" on {f:.0%} of parameter bytes"


def _role(
    name: str,
    size: int,
    batch: bool,
    seq: bool,
    share: float,
    state: float,
    grads: bool,
    experts: bool,
    seq_norms: bool,
) -> tuple[str, str]:
    axis = f"{name}={size}"
    if size == 1:
        return "unused", f"{axis} (size 1)"
    if batch and share > 0.05:
        return "fsdp", f"{axis} FSDP (ZeRO-3){_share(share)}"
    if batch and state > 0.05:
        kind = "zero2" if grads else "zero1"
        return kind, f"{axis} {kind.upper().replace('ZERO', 'ZeRO-')}{_share(state)}"
    if batch:
        return "dp", f"{axis} DDP"
    if seq:
        return "cp", f"{axis} context parallel (sequence split{', weights sharded' if share > 0.05 else ''})"
    if experts:
        return "ep", f"{axis} expert parallel"
    if share > 0.05:
        return "tp", f"{axis} Megatron TP{_share(share)}" + (" with sequence-parallel norms" if seq_norms else "")
    return "unused", f"{axis} unused (every device repeats the same work)"


def _batch_split(stage: StagePlan, i: int) -> bool:
    """Whether most of the forward's compute (by predicted time) runs on batch shards over axis ``i``: outputs
    split on dim 0 (an input may come in whole and be cut at the embedding)."""
    fwd = [o for o in stage.ops if o.phase == "forward" and len(o.shape) >= 2]
    total = sum(o.compute_s for o in fwd)
    return total > 0 and sum(o.compute_s for o in fwd if o.output[i] == "S(0)") > 0.5 * total


def _sequence_norms(stage: StagePlan, i: int) -> bool:
    norms = [o for o in stage.ops if o.phase == "forward" and any(k in o.op for k in _NORMS) and len(o.shape) > 2]
    return bool(norms) and sum(o.output[i] == "S(1)" for o in norms) * 2 >= len(norms)


def plan_in_words(plan: Plan) -> str:
    """E.g. "dp=8 FSDP (ZeRO-3) × tp=8 Megatron TP with sequence-parallel norms, 4 pipeline stages 1F1B, 8
    micro-batches; 71.2 GiB of 80 GiB per device; 0.91× the best recipe's step (fsdp+tp)"."""
    if not plan.stages:
        return "an empty plan"
    stage = plan.stages[0]
    roles = [r.words for r in axis_roles(stage) if r.size > 1] or ["one device"]
    parts = [" × ".join(roles)]
    if len(plan.stages) > 1:
        chunks = f" ({plan.chunks} chunks per rank)" if plan.chunks > 1 else ""
        parts[0] += f", {len(plan.stages)} pipeline stages {plan.schedule}{chunks}, {plan.microbatches} micro-batches"
    elif plan.microbatches > 1:
        parts[0] += f", {plan.microbatches} accumulated micro-batches"
    extras = []
    if plan.recompute or plan.recompute_layers:
        extras.append(
            "recomputing "
            + (
                "every layer"
                if plan.recompute and not plan.recompute_layers
                else f"{len(plan.recompute_layers)} module group(s)"
            )
        )
    if plan.peak_memory.host:
        extras.append(f"{format_bytes(plan.peak_memory.host)} offloaded to host")
    if plan.mixed_precision:
        extras.append(f"{plan.mixed_precision} " + ("autocast" if plan.precision_policy != "params" else "parameters"))
    if extras:
        parts[0] += " (" + ", ".join(extras) + ")"
    peak = plan.peak_memory.total
    budget = f" of {format_bytes(plan.memory_budget_bytes)}" if plan.memory_budget_bytes else ""
    parts.append(f"{format_bytes(peak)}{budget} per device")
    parts.append(f"step {format_seconds(plan.step_time_s)}" + _against_best(plan))
    return "; ".join(parts)


def what_bounds(plan: Plan) -> str:
    """What the predicted step is made of and what holds it there, from the plan's own numbers: its compute
    (recomputation apart), exposed communication and pipeline idle share; where the budget binds, the levers the
    plan pulled to fit it (micro-batches, recomputation, offload); and the solver's proof, its lower bound on the
    objective. E.g. "compute 2.05 s (91%), exposed communication 193 ms (9%); memory binds: 74.8 GiB of 95 GiB
    per device, met by 2 micro-batches; the solver's bound equals the plan: no choice of layouts is faster with these
    levers"."""
    if not plan.stages or plan.step_time_s <= 0:
        return ""
    step = plan.step_time_s
    if len(plan.stages) > 1:
        busiest = max(plan.stages, key=lambda s: s.microbatch_time_s)
        time = (
            f"the busiest stage ({busiest.index}) at {format_seconds(busiest.microbatch_time_s)} per "
            f"micro-batch, {plan.microbatches} micro-batches, pipeline idle {plan.bubble_fraction:.0%} of the step"
        )
    else:
        stage = plan.stages[0]
        rec = min(plan.recompute_s, stage.compute_s)
        work = max(0.0, stage.compute_s - rec - stage.offload_s)
        parts = [f"compute {format_seconds(work)} ({work / step:.0%})"]
        if rec > 0:
            parts.append(f"recomputation {format_seconds(rec)} ({rec / step:.0%})")
        if stage.offload_s > 0:
            parts.append(f"offload copies {format_seconds(stage.offload_s)} ({stage.offload_s / step:.0%})")
        parts.append(f"exposed communication {format_seconds(stage.comm_s)} ({stage.comm_s / step:.0%})")
        time = ", ".join(parts)
    levers = []
    if plan.microbatches > 1 and len(plan.stages) == 1:
        levers.append(f"{plan.microbatches} micro-batches")
    if plan.recompute or plan.recompute_layers:
        levers.append("recomputing " + (describe(plan.recompute_layers) or "every layer"))
    if plan.peak_memory.host:
        levers.append(f"{format_bytes(plan.peak_memory.host)} offloaded to host")
    budget = plan.memory_budget_bytes
    memory = ""
    if levers:
        memory = (
            f"; memory binds: {format_bytes(plan.peak_memory.total)}"
            + (f" of {format_bytes(budget)}" if budget else "")
            + " per device, met by "
            + " and ".join(levers)
        )
    sv = plan.solver
    if sv.objective_s <= 0:
        proof = ""
    elif sv.gap <= 1e-3:
        proof = "; the solver's bound equals the plan: no choice of layouts is faster with these levers"
    else:
        proof = f"; the solver's bound is {sv.gap:.1%} below the plan (a faster choice of layouts may exist)"
    return time + memory + proof


def _against_best(plan: Plan) -> str:
    best = plan.best_recipe()
    if best is None or best.step_time_s <= 0:
        return "" if plan.recipe else " (no recipe fits to compare with)" if plan.recipes else ""
    return (
        f", {plan.step_time_s / best.step_time_s:.2f}× the best recipe's "
        f"({best.name}, {format_seconds(best.step_time_s)})"
    )


def precision_words(plan: Plan) -> str:
    """How a mixed-precision plan runs, in a phrase (autoshard/compiler/precision.py)."""
    dtype = plan.mixed_precision
    if plan.precision_policy == "params":
        return (
            f"{dtype} parameters (FSDP2's MixedPrecisionPolicy: the fp32 master weights cast to {dtype} where "
            f"first used, the whole forward and backward in {dtype})"
        )
    return f"autocast to {dtype} (matmuls on {dtype} copies of the fp32 master weights, the other ops in fp32)"
