"""The page's charts of a plan: memory per device against the budget, where the step's time goes (per stage and
per layer), the collectives of one step per mesh axis, and the plan against every recipe that was solved.

Every number drawn is the plan's own (``Plan`` fields, predicted by the cost model), except where a chart says
measured (``measured_s``, from autotuning on the mesh). Tooltips give each piece's exact value."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from autoshard.ir import layer_key
from autoshard.notation import dtype_bytes, fold_layers, format_bytes, format_seconds, local_shape, placements_str
from autoshard.plans.explain import CostChange, explain, signed
from autoshard.plans.html.svg import Bar, Segment, esc, legend, stacked_bars
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
    tip = f"budget {format_bytes(budget)}" if budget else ""
    svg = stacked_bars(bars, "memory per device", MEMORY, limit=budget, limit_tip=tip, label_w=200, after_w=150)
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
        f'<div class="chart" data-view="step">{stacked_bars(bars, "step time", STEP, label_w=200, after_w=150)}'
        f"{legend(STEP, drawn=bars)}</div>"
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
                + (f" ({r.runs:.3g} x {format_seconds(r.run_s)})" if r.runs != 1 and r.run_s > 0 else ""),
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


OVER = {"recipe (over budget)": "#D55E00"}
COMM = ("exposed", "overlapped")
TOP = 10


def _hidden_share(plan: Plan, s: StagePlan) -> dict[int, float]:
    """Per collective (by index), the share of it the cost model overlaps: the plan's overlap credit
    (``hidden_comm_s``) spread over the gradient reductions it is taken from, in proportion to their times."""
    params = {t.name for t in s.tensors if t.role == "parameter"}
    grads = {i: c.time_s * c.repeat for i, c in enumerate(s.collectives) if c.consumer in params}
    total = sum(grads.values())
    if len(plan.stages) > 1 or total <= 0 or plan.hidden_comm_s <= 0:
        return {}
    share = min(1.0, plan.hidden_comm_s / total)
    return {i: share for i in grads}


def collectives_view(plan: Plan, s: StagePlan) -> str:
    """One step's collectives of ``s`` added up by kind, mesh axis and phase: one bar each on one time scale,
    exposed and overlapped apart, with how many run a step and how many bytes; the largest first."""
    acc: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    hidden = _hidden_share(plan, s)
    for i, c in enumerate(s.collectives):
        t = c.time_s * c.repeat
        row = acc[(c.kind, c.axis, c.phase)]
        row[0] += t * (1 - hidden.get(i, 0.0))
        row[1] += t * hidden.get(i, 0.0)
        row[2] += c.repeat
        row[3] += c.nbytes * c.repeat
    if not acc:
        return '<p class="note">No collectives: every device computes on its own.</p>'
    order = sorted(acc, key=lambda k: -(acc[k][0] + acc[k][1]))
    bars = [
        Bar(
            f"{kind} · {axis} · {phase}",
            tuple(
                Segment(v, n, f"{kind} on {axis} ({phase}), {n}: {format_seconds(v)}")
                for n, v in zip(COMM, acc[(kind, axis, phase)][:2])
                if v > 0
            ),
            f"{format_seconds(sum(acc[(kind, axis, phase)][:2]))}, {acc[(kind, axis, phase)][2]:.0f} × "
            f"{format_bytes(acc[(kind, axis, phase)][3] / max(1.0, acc[(kind, axis, phase)][2]))}",
        )
        for kind, axis, phase in order
    ]
    chart = stacked_bars(bars, "collectives per step", COMM, axis=True, label_w=230, after_w=190)
    return f'<div class="chart" data-view="collectives">{chart}{legend(COMM, drawn=bars)}</div>'


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
    return '<table class="kv"><tr>' + "".join(f"<th>{esc(h)}</th>" for h in head) + f"</tr>{cells}</table>"


def _any_layer(name: str) -> str:
    """``layers.7.mlp.w1`` as ``layers.*.mlp.w1``: the same thing in every copy of a layer, for the top tables."""
    key = layer_key(name)
    return name.replace(f"{key[0]}.{key[1]}", f"{key[0]}.*", 1) if key else name


def _folded(items: Iterable[tuple[tuple, float]]) -> list[tuple[tuple, float, int]]:
    """Equal keys added up: (key, summed value, how many), the largest sum first, the first ``TOP``."""
    acc: dict[tuple, list[float]] = {}
    for key, v in items:
        a = acc.setdefault(key, [0.0, 0])
        a[0] += v
        a[1] += 1
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])[:TOP]
    return [(k, v, int(n)) for k, (v, n) in rows]


def _times(n: int) -> str:
    return f" (× {n})" if n > 1 else ""


def top_tables(s: StagePlan) -> str:
    """The compiler report's top-N tables of ``s``, the copies of a layer added up (``layers.*``, × how many): its
    most expensive collectives (per step), largest tensors per device and most expensive ops (per call each)."""
    mesh_shape = s.mesh.shape
    colls = [
        (k[0], k[1], k[2], k[3] + _times(n), format_bytes(k[4]), format_seconds(t))
        for k, t, n in _folded(
            ((c.kind, c.axis, c.phase, _any_layer(c.owner or c.consumer), c.nbytes), c.time_s * c.repeat)
            for c in s.collectives
        )
    ]
    tensors = [
        (k[0] + _times(n), k[1], k[2], k[3], format_bytes(b / n), format_bytes(b))
        for k, b, n in _folded(
            (
                (_any_layer(t.name), t.role, f"{t.dtype}{list(t.shape)}", placements_str(t.placements)),
                math.prod(local_shape(t.shape, t.placements, mesh_shape)) * dtype_bytes(t.dtype),
            )
            for t in s.tensors
        )
    ]
    ops = [
        (k[0], k[1] + _times(n), k[2], k[3], k[4], format_seconds(t / n), format_seconds(t))
        for k, t, n in _folded(
            (
                (
                    o.op.removeprefix("aten.").split(".")[0],
                    _any_layer(o.module) or "(root)",
                    o.phase,
                    f"{list(o.shape)}",
                    placements_str(o.output),
                ),
                o.compute_s,
            )
            for o in s.ops
        )
    ]
    return (
        "<h4>Most expensive collectives (per step)</h4>"
        + _table(("kind", "axis", "phase", "for", "bytes each", "per step"), colls)
        + "<h4>Largest tensors per device (parameters, buffers, inputs)</h4>"
        + _table(("tensor", "role", "global", "placements", "per device, each", "in all"), tensors)
        + "<h4>Most expensive ops (as captured: a sampled layer's ops run once for each copy)</h4>"
        + _table(
            ("op", "module", "phase", "output shape", "output placements", "one call", "all copies, one call each"), ops
        )
    )


def recipes_view(plan: Plan) -> str:
    """The plan and every recipe solved for it: predicted step time (measured ticked where autotuned) and peak
    memory per device against the budget; which fit; each recipe's note."""
    rows = [r for r in plan.recipes if r.applies]
    if not rows:
        return '<p class="note">No recipe was solved alongside this plan (a recipe plan, or --no-recipes).</p>'
    names = ("the plan", "recipe (fits)", "recipe (over budget)")  # (over budget: vermillion, not green)
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
        f"{stacked_bars(time_bars, 'step time by recipe', names, fills=OVER)}"
        f"{legend(names, drawn=time_bars, fills=OVER)}</div>"
        f"<h4>peak memory per device (dashed: the budget; a black tick: measured)</h4>"
        f'<div class="chart" data-view="recipes-memory">'
        f"{stacked_bars(mem_bars, 'peak memory by recipe', names, limit=budget, limit_tip='budget', fills=OVER)}</div>"
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
