"""The page's charts of a plan: memory per device against the budget, where the step's time goes (per stage and
per layer), the collectives of one step per mesh axis, and the plan against every recipe that was solved.

Every number drawn is the plan's own (``Plan`` fields, predicted by the cost model), except where a chart says
measured (``measured_s``, from autotuning on the mesh). Tooltips give each piece's exact value."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

from autoshard.notation import fold_layers, format_bytes, format_seconds
from autoshard.plans.explain import CostChange, explain, signed
from autoshard.plans.html.svg import Bar, Segment, Svg, colour, esc, legend, stacked_bars
from autoshard.plans.plan import LayerTime, Plan, StagePlan
from autoshard.plans.words import plan_in_words

MEMORY = ("parameters", "gradients", "optimizer state", "activations", "temporaries", "host (offloaded)")
STEP = (
    "compute",
    "recompute",
    "offload copies",
    "communication (exposed)",
    "idle (pipeline bubble)",
    "communication (overlapped)",
)
LAYER = ("forward compute", "backward compute", "recompute", "forward comm", "backward comm", "once a step")
MAX_LAYERS = 64


def _stage_label(plan: Plan, s: StagePlan) -> str:
    return f"stage {s.index} ({s.mesh})" if len(plan.stages) > 1 else f"per device ({s.mesh})"


def memory_view(plan: Plan) -> str:
    """Stacked bars of each stage's bytes per device at its peak, the budget as a dashed line."""
    bars = []
    for s in plan.stages:
        m = s.memory
        parts = zip(MEMORY, (m.parameters, m.gradients, m.optimizer, m.activations, m.temporaries))
        segs = tuple(Segment(v, n, f"{n}: {format_bytes(v)}") for n, v in parts if v > 0)
        of = f" of {format_bytes(plan.memory_budget_bytes)}" if plan.memory_budget_bytes else ""
        measured = plan.measured_peak_bytes if len(plan.stages) == 1 else 0
        got = f", measured {format_bytes(measured)}" if measured else ""
        bars.append(
            Bar(
                _stage_label(plan, s),
                segs,
                f"{format_bytes(m.total)}{of}{got}",
                measured,
                f"measured peak {format_bytes(measured)} (autotune)",
            )
        )
        if m.host:
            bars.append(
                Bar(
                    "  host memory",
                    (Segment(m.host, MEMORY[-1], f"offloaded: {format_bytes(m.host)}"),),
                    f"{format_bytes(m.host)} in host memory",
                )
            )
    budget = plan.memory_budget_bytes
    svg = stacked_bars(
        bars, "memory per device", MEMORY, limit=budget, limit_tip=f"budget {format_bytes(budget)}" if budget else ""
    )
    return f'<div class="chart" data-view="memory">{svg}{legend(MEMORY, drawn=bars)}</div>'


def _idle(plan: Plan, s: StagePlan) -> float:
    return max(0.0, plan.step_time_s - s.compute_s - s.comm_s) if len(plan.stages) > 1 else 0.0


def step_view(plan: Plan) -> str:
    """Each stage's step split into compute (recomputation and offload's copies apart), exposed communication and
    pipeline idle time; the communication the cost model overlaps is drawn after it, lighter, not in the step."""
    bars = []
    for s in plan.stages:
        rec = plan.recompute_s if len(plan.stages) == 1 else 0.0
        pieces = (
            max(0.0, s.compute_s - s.offload_s - rec),
            rec,
            s.offload_s,
            s.comm_s,
            _idle(plan, s),
            plan.hidden_comm_s if len(plan.stages) == 1 else 0.0,
        )
        segs = tuple(Segment(v, n, f"{n}: {format_seconds(v)}") for n, v in zip(STEP, pieces) if v > 0)
        bars.append(
            Bar(
                _stage_label(plan, s),
                segs,
                f"step {format_seconds(plan.step_time_s)}",
                marker=plan.measured_s,
                marker_tip=f"measured {format_seconds(plan.measured_s)}",
            )
        )
    return (
        f'<div class="chart" data-view="step">{stacked_bars(bars, "step time", STEP)}{legend(STEP, drawn=bars)}</div>'
    )


def _layer_parts(r: LayerTime) -> tuple[float, ...]:
    """A row's step in LAYER's six kinds (seconds per step)."""
    n = r.runs
    return (
        n * (r.forward_s - r.forward_comm_s),
        n * (r.backward_s - r.backward_comm_s),
        n * r.recompute_s,
        n * r.forward_comm_s,
        n * r.backward_comm_s,
        r.step_s,
    )


def _rounded(parts: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(round(v, 4 - int(math.floor(math.log10(v)))) if v > 0 else 0.0 for v in parts)


def layers_view(plan: Plan) -> str:
    """Per stage, its step per block (``StagePlan.layer_times``): each layer's forward and backward compute, the
    communication its ops wait for and its once-a-step work, per step (every micro-batch), then what no layer
    owns (boundary sends, the optimizer update); the rows add up to the stage's compute and communication."""
    out = []
    for s in plan.stages:
        rows = s.layer_times
        if not rows:
            continue
        parts = {r.name: _layer_parts(r) for r in rows}
        # consecutive layers with the same times (to 0.1%) folded, as the terminal report folds equal layouts
        entries = fold_layers([(r.name + ".x", _rounded(parts[r.name])) for r in rows])
        shown = [rows[e] for e in entries if isinstance(e, int)][:MAX_LAYERS]
        bars = [
            Bar(
                r.name,
                tuple(Segment(v, k, f"{k}: {format_seconds(v)}") for k, v in zip(LAYER, parts[r.name]) if v > 0),
                format_seconds(r.per_step_s)
                + (f" ({r.runs:g} x {format_seconds(r.run_s)})" if r.runs != 1 and r.run_s > 0 else ""),
            )
            for r in shown
        ]
        folds = "".join(f'<div class="fold">{esc(e.replace(".x", ""))}</div>' for e in entries if isinstance(e, str))
        total = sum(r.per_step_s for r in rows)
        runs = max(r.runs for r in rows)
        what = f"{runs:g} micro-batches" if len(plan.stages) > 1 or plan.microbatches > 1 else "one step"
        head = f"{_stage_label(plan, s)}: " if len(plan.stages) > 1 else ""
        title = (
            f"<h4>{esc(head)}{format_seconds(total)} of work per step ({esc(what)}; a row: per step, and per "
            "micro-batch in brackets)</h4>"
        )
        out.append(
            f'{title}<div class="chart" data-view="layers">{stacked_bars(bars, "time per step", LAYER)}'
            f"{folds}{legend(LAYER, drawn=bars)}</div>"
        )
    note = f'<p class="note">{esc(plan.sampled_layers)}.</p>' if plan.sampled_layers else ""
    return "\n".join(out) + note


def _phase_totals(s: StagePlan) -> dict[str, float]:
    captured = defaultdict(float)
    for o in s.ops:
        captured[o.phase] += o.compute_s
    total = sum(captured.values()) or 1.0
    return {p: s.compute_s * captured[p] / total for p in ("forward", "backward", "optimizer")}


def timeline_view(s: StagePlan, label: str) -> str:
    """One step of ``s`` as lanes: compute by phase on top, then each mesh axis's collectives in issue order from
    the start of their phase, widths to scale. Where a lane runs past the compute above it, that communication
    cannot hide behind compute."""
    axes = sorted({c.axis for c in s.collectives}, key=lambda a: (a not in s.mesh.names, a))
    compute = _phase_totals(s)
    per = {(a, p): [c for c in s.collectives if c.axis == a and c.phase == p] for a in axes for p in compute}
    span = {p: max([compute[p]] + [sum(c.time_s * c.repeat for c in per[(a, p)]) for a in axes]) for p in compute}
    total = sum(span.values()) or 1.0
    lane, left, width = 26, 110, 640
    svg = Svg(left + width + 20, 20 + lane * (len(axes) + 1) + 10, f"{label} collectives timeline")
    x0 = 0.0
    for p in ("forward", "backward", "optimizer"):
        if span[p] <= 0:
            continue
        x = left + width * x0 / total
        svg.rect(
            x,
            16,
            width * compute[p] / total,
            lane - 8,
            colour(("forward", "backward").index(p) if p != "optimizer" else 2),
            f"{p} compute {format_seconds(compute[p])}",
        )
        svg.text(x + 2, 12, p, size=10, fill="#555")
        for j, a in enumerate(axes):
            cx = x
            for c in per[(a, p)]:
                w = width * c.time_s * c.repeat / total
                tip = (
                    f"{c.kind} on {a}: {c.tensor or '(latency)'} for {c.consumer}, {format_bytes(c.nbytes)}, "
                    f"{format_seconds(c.time_s)} × {c.repeat:g}"
                )
                svg.rect(
                    cx,
                    16 + lane * (j + 1),
                    w,
                    lane - 8,
                    colour(
                        4
                        + ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send_recv").index(
                            c.kind
                        )
                    ),
                    tip,
                    stroke="none",
                )
                cx += w
        x0 += span[p]
        svg.line(left + width * x0 / total, 10, left + width * x0 / total, 20 + lane * (len(axes) + 1), "#bbb", "2 2")
    svg.text(left - 6, 16 + lane / 2, "compute", anchor="end")
    for j, a in enumerate(axes):
        svg.text(left - 6, 16 + lane * (j + 1) + lane / 2, f"{a} comm", anchor="end")
    kinds = legend(("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "send_recv"), 4)
    return f'<div class="chart" data-view="timeline">{svg}{kinds}</div>'


def recipes_view(plan: Plan) -> str:
    """The plan and every recipe solved for it: predicted step time (measured ticked where autotuned) and peak
    memory per device against the budget; which fit; each recipe's note."""
    rows = [r for r in plan.recipes if r.applies]
    if not rows:
        return '<p class="note">No recipe was solved alongside this plan (a recipe plan, or --no-recipes).</p>'
    names = ("the plan", "recipe (fits)", "recipe (over budget)")
    me = Bar(
        "autoshard plan",
        (Segment(plan.step_time_s, names[0], format_seconds(plan.step_time_s)),),
        f"{format_seconds(plan.step_time_s)}  1.00×",
        plan.measured_s,
        f"measured {format_seconds(plan.measured_s)}",
    )
    time_bars, mem_bars = (
        [me],
        [
            Bar(
                "autoshard plan",
                (Segment(plan.peak_memory.total, names[0]),),
                format_bytes(plan.peak_memory.total),
                plan.measured_peak_bytes,
                f"measured {format_bytes(plan.measured_peak_bytes)}",
            )
        ],
    )
    for r in sorted(rows, key=lambda r: r.step_time_s):
        kind = names[1] if r.fits else names[2]
        ratio = r.step_time_s / plan.step_time_s if plan.step_time_s else math.inf
        time_bars.append(
            Bar(
                r.name,
                (Segment(r.step_time_s, kind, f"{r.name}: {format_seconds(r.step_time_s)}"),),
                f"{format_seconds(r.step_time_s)}  {ratio:.2f}×",
                r.measured_s,
                f"measured {format_seconds(r.measured_s)}",
                faded=not r.fits,
            )
        )
        mem_bars.append(
            Bar(
                r.name,
                (Segment(r.peak_memory_bytes, kind, format_bytes(r.peak_memory_bytes)),),
                format_bytes(r.peak_memory_bytes),
                r.measured_peak_bytes,
                f"measured {format_bytes(r.measured_peak_bytes)}",
                faded=not r.fits,
            )
        )
    budget = plan.memory_budget_bytes
    notes = "".join(
        f"<tr><td>{esc(r.name)}</td><td>{'yes' if r.fits else 'no'}</td>"
        f"<td>{esc('; '.join(x for x in (r.how, r.note) if x))}</td>"
        f"<td>{'<br>'.join(esc(d) for d in r.differences)}</td></tr>"
        for r in rows
    )
    return (
        f'<h4>predicted step time (a black tick: measured)</h4><div class="chart" data-view="recipes-time">'
        f"{stacked_bars(time_bars, 'step time by recipe', names)}{legend(names)}</div>"
        f"<h4>peak memory per device (dashed: the budget; a black tick: measured)</h4>"
        f'<div class="chart" data-view="recipes-memory">'
        f"{stacked_bars(mem_bars, 'peak memory by recipe', names, limit=budget, limit_tip='budget')}</div>"
        f'<table class="kv"><tr><th>recipe</th><th>fits</th><th>note</th><th>what makes the difference (recipe − '
        f"plan, the largest terms; <code>autoshard explain</code> has all)</th></tr>{notes}</table>"
    )


def explain_view(a: Plan, b: Plan, names: tuple[str, str] = ("A", "B")) -> str:
    """The explanation as an HTML section body: the totals, the layout changes and the signed terms, each with a
    bar to scale (red adds, green saves)."""
    e = explain(a, b)
    na, nb = names
    most = max([abs(c.value) for c in e.time] + [1e-30])
    most_b = max([abs(c.value) for c in e.memory] + [1.0])

    def rows(changes: tuple[CostChange, ...], fmt: Callable[[float], str], top: float) -> str:
        return "".join(
            f'<tr><td class="num">{esc(signed(c.value, fmt))}</td><td><span class="delta" style="width:'
            f'{120 * abs(c.value) / top:.0f}px;background:{"#D55E00" if c.value > 0 else "#009E73"}"></span></td>'
            f"<td>{esc(c.what)}</td></tr>"
            for c in changes
        )

    layouts = "".join(
        f"<tr><td>{esc(c.name)}</td><td>{esc(c.layers)}</td><td>[{esc(', '.join(c.before))}]</td>"
        f"<td>[{esc(', '.join(c.after))}]</td></tr>"
        for c in e.layouts[:200]
    )
    return (
        f'<p class="words">{esc(na)}: {esc(plan_in_words(a))}<br>{esc(nb)}: {esc(plan_in_words(b))}</p>'
        f"<p>{esc(nb)} − {esc(na)}: step {esc(signed(e.step_delta_s, format_seconds))}, peak memory per device "
        f"{esc(signed(e.memory_delta_bytes, format_bytes))}.</p>"
        f'<h4>step time terms (they sum to the difference)</h4><table class="kv">'
        f"{rows(e.time, format_seconds, most)}</table>"
        f'<h4>peak memory terms</h4><table class="kv">{rows(e.memory, format_bytes, most_b)}</table>'
        f'<h4>parameter layouts that differ ({len(e.layouts)})</h4><table class="kv"><tr><th>parameter</th>'
        f"<th>layers</th><th>{esc(na)}</th><th>{esc(nb)}</th></tr>{layouts}</table>"
    )
