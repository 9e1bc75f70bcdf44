"""The plain-text report of a :class:`~autoshard.plans.plan.Plan` (``autoshard.report(plan)``): header, recipe
comparison, then per stage the placements per module with repeated layers folded, the decisions and the collectives."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import NamedTuple

from autoshard.ir import layer_parts
from autoshard.notation import (
    describe,
    fold_layers,
    format_bytes,
    format_seconds,
    op_str,
    placements_str,
    tensor_str,
)
from autoshard.plans.plan import MemoryBreakdown, Plan, StagePlan
from autoshard.plans.words import plan_in_words, precision_words, what_bounds

# ---------------------------------------------------------------------------------------------------------------
# report


class _Row(NamedTuple):
    """One report row: ``key`` finds its layer, ``header`` groups it, ``label`` and ``cells`` print."""

    key: str
    header: str
    label: str
    sig: Hashable
    cells: tuple[str, ...]


def _split(name: str) -> tuple[str, str]:
    """``layers.0.attn.wq.weight`` -> (``layers.0.attn``, ``wq.weight``): header the module's parent, so one
    block holds a whole attention or MLP rather than one Linear; short names (``embed.weight``) get no header."""
    parts = name.split(".")
    return (".".join(parts[:-2]), ".".join(parts[-2:])) if len(parts) > 2 else ("", name)


def _table(title: str, columns: str, rows: Sequence[_Row], collapse: bool, max_rows: int) -> list[str]:
    """Rows grouped under headers (each header once, first-seen order) with repeated layers folded."""
    if not rows:
        return []
    entries = fold_layers([(r.key, r.sig) for r in rows]) if collapse else list(range(len(rows)))
    blocks: dict[str, list[_Row]] = {}
    order: list[str | tuple[str]] = []  # a header, or a 1-tuple holding a collapse line
    for e in entries:
        if isinstance(e, str):
            order.append((e,))
        elif rows[e].header in blocks:
            blocks[rows[e].header].append(rows[e])
        else:
            blocks[rows[e].header] = [rows[e]]
            order.append(rows[e].header)
    shown_rows = [r for b in blocks.values() for r in b]
    name_w = max([36] + [len(r.label) + 2 for r in shown_rows])
    col = [max(len(r.cells[j]) for r in shown_rows if j < len(r.cells)) + 2 for j in range(len(rows[0].cells))]
    lines, shown = [f"{title:<{name_w + 2}}{columns}"], 0
    for item in order:
        if isinstance(item, tuple):
            lines.append(item[0])
            continue
        if item:
            lines.append(item)
        for r in blocks[item]:
            if shown == max_rows:
                lines.append(f"  ... {len(shown_rows) - shown} more rows (Plan.to_json() has all)")
                return lines
            shown += 1
            lines.append(f"  {r.label.ljust(name_w)}" + "".join(c.ljust(w) for c, w in zip(r.cells, col)).rstrip())
    return lines


def _tensor_rows(stage: StagePlan, role: str) -> list[_Row]:
    rows = []
    for t in stage.tensors:
        if t.role != role:
            continue
        try:
            local = tensor_str(t.dtype, t.local_shape(stage.mesh))
        except ValueError:
            local = "(uneven shard)"
        header, label = _split(t.name)
        where = placements_str(t.placements)
        offload = getattr(t, "offload", "")  # master and optimizer state in host memory (ZeRO-Offload)
        if offload:
            where += f" offload: state {placements_str(t.state_placements or t.placements)} on the host"
        elif t.zero:  # the optimizer steps a shard of it (ZeRO-1/2)
            where += f" {t.zero}: state {placements_str(t.state_placements)}"
        elif t.frozen:  # no gradient, no optimizer state
            where += " frozen"
        cells = (tensor_str(t.dtype, t.shape), where, local)
        rows.append(
            _Row(
                t.name,
                header,
                label,
                (t.shape, t.dtype, t.placements, t.state_placements, t.grad_placements, offload, t.frozen),
                cells,
            )
        )
    return rows


def _decision_rows(stage: StagePlan) -> list[_Row]:
    rows = []
    for d in stage.ops:
        if d.phase != "forward":
            continue
        out = tensor_str(d.dtype, d.shape) if d.dtype else f"[{', '.join(map(str, d.shape))}]"
        ins = ", ".join(placements_str(p) for p in d.inputs)
        cells = (op_str(d.op), out, placements_str(d.output), f"<- {ins}", format_seconds(d.compute_s), d.node)
        header, _, label = d.module.rpartition(".")
        # layers fold by module and choice, not by node name (mm_3 in layer 0 is mm_17 in layer 1)
        sig = (d.op, d.shape, d.dtype, d.output, d.inputs)
        rows.append(_Row(d.module, header, label or d.node, sig, cells))
    return rows


def _backward_summary(stage: StagePlan) -> list[str]:
    ops = Counter(op_str(d.op) for d in stage.ops if d.phase == "backward")
    if not ops:
        return []
    kinds = ", ".join(f"{op} {n}" for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0])))
    return [f"decisions (backward): {sum(ops.values())} anchors  ({kinds})"]


def _collective_rows(stage: StagePlan) -> list[_Row]:
    return [
        _Row("", "", r.kind, None, (r.axis, str(r.count), format_bytes(r.nbytes), format_seconds(r.time_s)))
        for r in stage.collective_summary()
    ]


def _memory_line(m: MemoryBreakdown, label: str) -> str:
    unit = format_bytes(m.total).split()[-1]
    f = lambda n: format_bytes(n, unit)  # noqa: E731 - one unit for all terms so the sum reads at a glance
    return (
        f"{label} {f(m.total)} = params {f(m.parameters)} + grads {f(m.gradients)} + "
        f"optimizer {f(m.optimizer)} + activations {f(m.activations)}"
        + (f" + temporaries {f(m.temporaries)}" if m.temporaries else "")
    )


def offload_text(mode: str, params: int, total: int, host_bytes: int, step_s: float, link: str) -> str:
    """The report's offload line (also ``autoshard plan``'s progress line): what lives in host memory and what
    it costs per step (``autoshard/cost/offload.py``)."""
    what = "parameters (ZeRO-3 shards on the device) and optimizer state" if mode == "params" else "optimizer state"
    return (
        f"offload: {what} of {params} of {total} parameters in host memory ({format_bytes(host_bytes)} per "
        f"device: masters, their gradients, optimizer state), {format_seconds(step_s)} per step (gradient to "
        f"the host, host optimizer step, parameter back over {link}; in the predicted step)"
    )


def _offload_lines(plan: Plan) -> list[str]:
    """One line when the plan holds optimizer state in host memory (``TensorLayout.offload``; the host bytes and
    per-step seconds of ``MemoryBreakdown.host`` and ``StagePlan.offload_s``)."""
    stage = max(plan.stages, key=lambda s: s.memory.total) if plan.stages else None
    off = [t for t in (stage.tensors if stage is not None else ()) if getattr(t, "offload", "")]
    if not off:
        return []
    total = sum(1 for t in stage.tensors if t.role == "parameter")
    mode = max(t.offload for t in off)
    return [
        offload_text(
            mode, len(off), total, getattr(stage.memory, "host", 0), getattr(stage, "offload_s", 0.0), "the host link"
        )
    ]


def _frozen_lines(plan: Plan) -> list[str]:
    """One line when some parameters take no gradient (``TensorLayout.frozen``: a LoRA model's base weights)."""
    count, nbytes = plan.frozen_parameters()
    if not count:
        return []
    total = len({t.name for s in plan.stages for t in s.tensors if t.role == "parameter"})
    return [
        f"frozen: {count} of {total} parameters ({format_bytes(nbytes)}, requires_grad=False) hold no gradient "
        "and no optimizer state and take no gradient reduction; their layouts serve the forward and the "
        "activations' gradients"
    ]


def _pipelined(plan: Plan) -> bool:
    return len(plan.stages) > 1 or plan.microbatches > 1


def _recipe_lines(plan: Plan) -> list[str]:
    """The plan next to every manual recipe, in the same cost model; ratio = recipe time / plan time. Autotuned
    plans (``measured_s``) add each candidate's measured median step and its ratio to the plan's."""
    if not plan.recipes:
        return []
    budget = plan.memory_budget_bytes
    piped = _pipelined(plan)
    timed = plan.measured_s > 0
    own = "autoshard" if piped or not plan.recipe else plan.recipe
    mine = "; ".join(
        x
        for x in (
            plan.recompute_layers and f"recomputing {describe(plan.recompute_layers)}",
            plan.microbatches > 1 and f"{plan.microbatches} micro-batches",
        )
        if x
    )
    rows = [(own, plan.step_time_s, plan.peak_memory.total, True, mine, plan.measured_s)]
    # each recipe as it was priced (its own recomputation and micro-batches: search/recipes_alone.py), then why
    rows += [
        (b.name, b.step_time_s, b.peak_memory_bytes, b.fits, "; ".join(x for x in (b.how, b.note) if x), b.measured_s)
        for b in plan.recipes
    ]
    w = max(len(r[0]) for r in rows) + 2
    head = f"{'vs manual recipes':<{w}}{'step':>12}{'x plan':>9}{'memory/device':>16}  fits  note"
    lines = ["", head.replace("  fits", f"{'measured':>12}{'x plan':>9}  fits") if timed else head]
    for name, t, mem, fits, note, m in rows:
        if not math.isfinite(t):
            lines.append(f"  {name:<{w - 2}}{'-':>12}{'-':>9}{'-':>16}  -     {note}")
            continue
        fit = "yes" if fits else "OOM"
        if not budget and fits:
            fit = "-"
        ratio = t / plan.step_time_s if plan.step_time_s > 0 else math.nan
        clock = ""
        if timed:
            clock = f"{format_seconds(m):>12}{m / plan.measured_s:>8.2f}x" if m > 0 else f"{'-':>12}{'-':>9}"
        lines.append(
            f"  {name:<{w - 2}}{format_seconds(t):>12}{ratio:>8.2f}x{format_bytes(mem):>16}{clock}  {fit:<5} "
            f"{note}".rstrip()
        )
    if timed:
        lines.append(f"autotune: the fastest of {len(rows)} candidates as measured on the mesh (median step)")
        return lines
    best = plan.best_recipe()
    if best is not None and (piped or not plan.recipe):
        gain = best.step_time_s / plan.step_time_s if plan.step_time_s > 0 else math.nan
        lines.append(f"best recipe that fits: {best.name}; the plan is {gain:.2f}x as fast")
        lines += [f"  {best.name} - plan: {d}" for d in best.differences]
    return lines


def layers_str(layers: Sequence[str]) -> str:
    """``wte, wpe, layers.0–3, layers.8–11``: runs of consecutive numbered layers folded."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None  # (container, first, last)

    def close() -> None:
        if run is not None:
            out.append(f"{run[0]}.{run[1]}" if run[1] == run[2] else f"{run[0]}.{run[1]}–{run[2]}")

    for name in layers:
        key = layer_parts(name)
        if key is not None and not key[2]:
            if run is not None and run[0] == key[0] and run[2] + 1 == key[1]:
                run = (run[0], run[1], key[1])
                continue
            close()
            run = (key[0], key[1], key[1])
            continue
        close()
        run = None
        out.append(name)
    close()
    return ", ".join(out) or "-"


def _ranks_str(r: Sequence[int]) -> str:
    return f"{r[0]}–{r[-1]}" if r and list(r) == list(range(r[0], r[-1] + 1)) else ",".join(map(str, r))


def _recompute_str(plan: Plan) -> str:
    """Which layers replay their forward in the backward, in which mode, and what the replays cost."""
    if not plan.recompute_layers:
        return "the chosen layers run their forward again in the backward"
    return (
        f"{describe(plan.recompute_layers)} (full: the whole forward runs again in the backward; selective: all "
        f"but the matmuls and attention), +{format_seconds(plan.recompute_s)} per step"
    )


def _pipeline_lines(plan: Plan) -> list[str]:
    """Per stage: ranks, sub-mesh, predicted time per micro-batch, memory and layers; then the balance."""
    redo = "; activation recomputation (layers keep only their inputs)" if plan.recompute else ""
    if len(plan.stages) < 2:
        if plan.microbatches > 1:
            return ["", f"no pipeline stages: gradient accumulation over {plan.microbatches} micro-batches{redo}"]
        return ["", f"activation recomputation: {_recompute_str(plan)}"] if redo else []
    chunks = f" ({plan.chunks} model chunks per rank)" if plan.chunks > 1 else ""
    lines = [
        "",
        f"pipeline: {len(plan.stages)} stages, schedule {plan.schedule or '-'}{chunks}, {plan.microbatches} "
        f"micro-batches, bubble {plan.bubble_fraction:.1%} of the step (predicted){redo}",
        f"  {'stage':<7}{'ranks':<12}{'sub-mesh':<20}{'time / micro-batch':>20}{'memory/device':>16}  layers",
    ]
    for s in plan.stages:
        lines.append(
            f"  {s.index:<7}{_ranks_str(s.ranks):<12}{str(s.mesh):<20}{format_seconds(s.microbatch_time_s):>20}"
            f"{format_bytes(s.memory.total):>16}  {layers_str(s.layers)}"
        )
    times = [s.microbatch_time_s for s in plan.stages]
    if min(times) > 0:
        lines.append(f"stage balance: slowest / fastest stage = {max(times) / min(times):.2f}{_why_unbalanced(plan)}")
    return lines


def _why_unbalanced(plan: Plan) -> str:
    """Why the fastest stage has fewer layers, where memory is the reason: it sits at the per-device budget (the
    one given, else the device's memory) with its share of the schedule's in-flight activations."""
    from autoshard.cluster.presets import get_cluster

    budget = plan.memory_budget_bytes
    if not budget:
        try:
            budget = get_cluster(plan.cluster).device.memory_bytes
        except (ValueError, OSError, KeyError):  # a profile known only by the file it came from
            return ""
    fast = min(plan.stages, key=lambda s: s.microbatch_time_s)
    per_layer = fast.memory.total / max(1, len(fast.layers))  # on average
    if (
        budget - fast.memory.total >= per_layer
        or max(s.microbatch_time_s for s in plan.stages) <= 1.1 * fast.microbatch_time_s
    ):
        return ""
    return (
        f" (stage {fast.index} is memory-bound: {format_bytes(fast.memory.total)} of {format_bytes(budget)} per "
        "device; a layer more does not fit)"
    )


def report(plan: Plan, *, collapse: bool = True, max_rows: int = 400) -> str:
    """The plan as a plain-text table (``autoshard.report(plan)``, the CLI's output); ``collapse`` folds repeated
    layers with identical placements, ``max_rows`` caps the decision rows."""
    return "\n".join(_report_lines(plan, collapse=collapse, max_rows=max_rows)) + "\n"


def _report_lines(plan: Plan, *, collapse: bool, max_rows: int) -> list[str]:
    # a pipelined step is bounded by its busiest stage: show that stage's split, not the sum over stages
    busiest = max(plan.stages, key=lambda s: s.compute_s + s.comm_s) if plan.stages else None
    compute = sum(s.compute_s for s in plan.stages) if len(plan.stages) < 2 else busiest.compute_s
    comm = sum(s.comm_s for s in plan.stages) if len(plan.stages) < 2 else busiest.comm_s
    where = f"busiest stage {busiest.index}: " if len(plan.stages) > 1 and busiest is not None else ""
    head = (
        f"autoshard plan  mesh {plan.mesh}  cluster {plan.cluster}  predicted step {format_seconds(plan.step_time_s)}"
        f"  ({where}compute {format_seconds(compute)}, comm {format_seconds(comm)})"
    )
    if len(plan.stages) > 1 or plan.schedule:
        head += f"  pipeline {len(plan.stages)} stages, {plan.schedule or 'no schedule'} × {plan.microbatches} mb"
    sv = plan.solver
    lines = [
        plan_in_words(plan),
        head,
        _memory_line(plan.peak_memory, "peak memory / device"),
        f"solver {sv.status}  objective {format_seconds(sv.objective_s)}  bound {format_seconds(sv.bound_s)}  "
        f"gap {sv.gap:.1%}  groups {sv.groups}  variables {sv.variables}  shared layers {sv.shared_layers}  "
        f"({format_seconds(sv.wall_s)})",
    ]
    if plan.recipe and _pipelined(plan):
        lines.append(f"stage layout: recipe {plan.recipe} (the free layout's stages do not fit the memory budget)")
    elif plan.recipe:
        lines.append(f"manual recipe: {plan.recipe} (parameter and batch layouts pinned, the rest solved)")
    lines += _offload_lines(plan)
    lines += _frozen_lines(plan)
    if plan.tokens_per_step and plan.step_time_s > 0:
        mfu = f"  MFU {plan.mfu:.1%}" if plan.peak_flops_per_device and plan.model_flops_per_step else ""
        lines.append(f"throughput {plan.tokens_per_s:,.0f} tokens/s ({plan.tokens_per_step:,} tokens per step){mfu}")
    if bounds := what_bounds(plan):
        lines.append(f"what bounds the step: {bounds}")
    if plan.hidden_comm_s:
        lines.append(f"overlap: {format_seconds(plan.hidden_comm_s)} of gradient reductions hidden behind backward")
    if plan.sampled_layers:
        lines.append(f"repeated layers: {plan.sampled_layers}")
    if plan.mixed_precision:
        lines.append(
            f"mixed precision: {precision_words(plan)}; fp32 gradients and optimizer state; gradients "
            f"reduced in {plan.reduce_dtype}"
        )
    lines += _recipe_lines(plan)
    lines += _pipeline_lines(plan)
    for stage in plan.stages:
        lines.append("")
        if len(plan.stages) > 1:
            lines.append(
                f"== stage {stage.index}  mesh {stage.mesh}  ranks {_ranks_str(stage.ranks)}  layers "
                f"{layers_str(stage.layers)}  compute {format_seconds(stage.compute_s)}  comm "
                f"{format_seconds(stage.comm_s)} per step"
            )
            lines.append(_memory_line(stage.memory, "memory / device"))
        for role, title in (("parameter", "parameters"), ("buffer", "buffers"), ("input", "inputs")):
            lines += _table(title, "global / placements / local", _tensor_rows(stage, role), collapse, max_rows)
        cols = "op / output / placements / inputs / compute / node"
        lines += _table("decisions (forward)", cols, _decision_rows(stage), collapse, max_rows)
        lines += _backward_summary(stage)
        rows = _collective_rows(stage)
        lines += _table("collectives per step", "axis / count / bytes / time", rows, False, max_rows) or [
            "collectives per step: none"
        ]
    return lines
