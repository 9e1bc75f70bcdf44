"""Why two plans differ: the layouts that differ (repeated layers folded) and the cost each kind of difference adds
or saves, summing to the difference in predicted step time and in peak memory per device.

``autoshard explain A.json B.json`` prints it; ``write_html(b, path, compare=a)`` draws it on B's page
(``html/charts.py: explain_view``). Costs are
split the way the cost model adds them up: compute, each collective kind on each mesh axis and phase (attributed
to the layer block whose op waits for it), the overlap credit, and, for pipelined or accumulated plans, what the
schedule adds (bubble, micro-batches) as the remainder; memory by kind (parameters, gradients, optimizer state,
activations, temporaries) at the peak stage."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from autoshard.ir import layer_parts
from autoshard.notation import format_bytes, format_seconds
from autoshard.plans.plan import Plan
from autoshard.plans.words import plan_in_words

_MEMORY = ("parameters", "gradients", "optimizer", "activations", "temporaries")


@dataclass(frozen=True)
class LayoutChange:
    """Parameters whose placements differ: ``name`` with ``{i}`` for the layer index when ``layers`` > 1."""

    name: str
    layers: str
    before: tuple[str, ...]
    after: tuple[str, ...]


@dataclass(frozen=True)
class CostChange:
    """One term of the difference (B − A): seconds of step time or bytes of peak memory."""

    what: str
    value: float


@dataclass(frozen=True)
class Explanation:
    """B against A: the layouts that differ and the step-time and memory terms (each list sums to its total)."""

    layouts: tuple[LayoutChange, ...]
    time: tuple[CostChange, ...]
    memory: tuple[CostChange, ...]
    step_delta_s: float
    memory_delta_bytes: int


def _ranges(idx: list[int]) -> str:
    idx = sorted(set(idx))
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}–{a}")
            start = b
    return ",".join(out)


def layout_changes(a: Plan, b: Plan) -> list[LayoutChange]:
    """Parameters whose placements differ between the plans (by name; meshes of a different shape compare as
    strings), repeated layers folded into one row with their indices."""
    pa, pb = a.parameter_placements(), b.parameter_placements()
    rows: dict[tuple[str, tuple, tuple], list[int]] = defaultdict(list)
    for name in pa.keys() & pb.keys():
        if pa[name] == pb[name]:
            continue
        parts = layer_parts(name)
        key = f"{parts[0]}.{{i}}.{parts[2]}" if parts else name
        rows[(key, pa[name], pb[name])].append(parts[1] if parts else -1)
    order = {n: i for i, n in enumerate(pb)}
    first = {k: min(order.get(k[0].replace("{i}", str(i)), 0) for i in v) for k, v in rows.items()}
    return [
        LayoutChange(k[0], _ranges(v) if v[0] >= 0 else "", k[1], k[2])
        for k, v in sorted(rows.items(), key=lambda kv: first[kv[0]])
    ]


def _block(module: str) -> str:
    parts = layer_parts(module + ".x")
    return f"{parts[0]}.*" if parts else "outside the layers"


def _terms(plan: Plan) -> dict[str, float]:
    """Step-time terms of ``plan`` as the cost model adds them up: one stage's compute and collectives (the
    busiest stage of a pipelined plan, which bounds its step), less the overlap credit."""
    out: dict[str, float] = defaultdict(float)
    if plan.stages:
        s = max(plan.stages, key=lambda s: s.compute_s + s.comm_s)
        out["compute"] += s.compute_s
        module_of = {o.node: o.module for o in s.ops}
        for c in s.collectives:
            out[f"{c.kind} on {c.axis} ({c.phase}), {_block(module_of.get(c.consumer, c.consumer))}"] += (
                c.time_s * c.repeat
            )
    out["overlap credit (communication hidden behind backward)"] -= plan.hidden_comm_s
    return out


def explain(a: Plan, b: Plan) -> Explanation:
    """B against A (see the module docstring)."""
    ta, tb = _terms(a), _terms(b)
    delta = b.step_time_s - a.step_time_s
    time = [CostChange(k, tb.get(k, 0.0) - ta.get(k, 0.0)) for k in sorted(ta.keys() | tb.keys())]
    time = [c for c in time if abs(c.value) > 1e-9 * max(a.step_time_s, b.step_time_s, 1e-12)]
    rest = delta - sum(c.value for c in time)
    if abs(rest) > 1e-6 * max(a.step_time_s, b.step_time_s):
        time.append(CostChange("pipeline schedule, micro-batches and stage balance (the rest)", rest))
    ma, mb = a.peak_memory, b.peak_memory
    memory = [CostChange(k, getattr(mb, k) - getattr(ma, k)) for k in _MEMORY if getattr(mb, k) != getattr(ma, k)]
    if mb.host != ma.host:
        memory.append(CostChange("host (offloaded; not in the device peak)", 0.0))
    time.sort(key=lambda c: -abs(c.value))
    return Explanation(tuple(layout_changes(a, b)), tuple(time), tuple(memory), delta, mb.total - ma.total)


def headline(a: Plan, b: Plan, n: int = 3) -> tuple[str, ...]:
    """The ``n`` largest step-time terms of B − A and the first layout change, one line each (e.g. "+11.8 ms
    all_gather on dp (forward), layers.*"): what a recipe's row on the plan's page says."""
    e = explain(a, b)
    out = [f"{signed(c.value, format_seconds)} {c.what}" for c in e.time[:n]]
    if e.layouts:
        c = e.layouts[0]
        more = f" and {len(e.layouts) - 1} more parameter(s)" if len(e.layouts) > 1 else ""
        out.append(f"{c.name} [{', '.join(c.before)}] -> [{', '.join(c.after)}]{more}")
    return tuple(out)


def signed(v: float, fmt: Callable[[float], str]) -> str:
    """``+1.20 ms`` / ``−3.0 GiB``: ``fmt`` of the magnitude with its sign (bytes are whole numbers)."""
    return ("+" if v >= 0 else "−") + fmt(abs(v) if fmt is not format_bytes else int(abs(v)))


def explain_lines(a: Plan, b: Plan, names: tuple[str, str] = ("A", "B"), max_rows: int = 30) -> list[str]:
    """The explanation as text: both plans in words, the totals, the layouts that differ, the terms."""
    e = explain(a, b)
    na, nb = names
    ratio = b.step_time_s / a.step_time_s if a.step_time_s else float("inf")
    lines = [
        f"{na}: {plan_in_words(a)}",
        f"{nb}: {plan_in_words(b)}",
        "",
        f"step: {na} {format_seconds(a.step_time_s)}, {nb} {format_seconds(b.step_time_s)} "
        f"({nb} {signed(e.step_delta_s, format_seconds)}, {ratio:.2f}×); peak memory per device: {na} "
        f"{format_bytes(a.peak_memory.total)}, {nb} {format_bytes(b.peak_memory.total)} "
        f"({nb} {signed(e.memory_delta_bytes, format_bytes)})",
        "",
    ]
    if e.layouts:
        lines.append(f"parameter layouts that differ ({na} -> {nb}), by change:")
        groups: dict[tuple, list[str]] = defaultdict(list)
        for c in e.layouts:
            groups[(c.before, c.after, c.layers)].append(c.name)
        for (before, after, layers), group in list(groups.items())[:max_rows]:
            where = f" (layers {layers})" if layers else ""
            names_ = ", ".join(group)
            names_ = names_ if len(names_) <= 110 else names_[:107] + "..."
            lines.append(f"  [{', '.join(before)}] -> [{', '.join(after)}]{where}: {len(group)} parameter(s): {names_}")
        if len(groups) > max_rows:
            lines.append(f"  ... {len(groups) - max_rows} more kinds of change")
    else:
        lines.append("parameter layouts: the same")
    lines += ["", f"step time, {nb} − {na} (the terms sum to {signed(e.step_delta_s, format_seconds)}):"]
    lines += [f"  {signed(c.value, format_seconds):>10}  {c.what}" for c in e.time[:max_rows]]
    if len(e.time) > max_rows:
        rest = sum(c.value for c in e.time[max_rows:])
        lines.append(f"  {signed(rest, format_seconds):>10}  {len(e.time) - max_rows} smaller terms")
    lines += ["", f"peak memory per device, {nb} − {na} (sums to {signed(e.memory_delta_bytes, format_bytes)}):"]
    lines += [f"  {signed(c.value, format_bytes):>10}  {c.what}" for c in e.memory] or ["  the same"]
    return lines
