"""The page's pipeline view: the schedule of a pipelined plan drawn as micro-batches over stages (the GPipe /
1F1B / interleaved / zero-bubble diagrams of the papers), from the plan's per-stage micro-batch times.

The drawing is a list schedule of the plan's own numbers: each stage's micro-batch time split one third forward,
two thirds backward (the backward computes two gradients), over ``chunks`` model chunks per rank; a task starts
when its rank is free and its inputs exist (a forward after the previous stage's, a backward after the next
stage's). GPipe runs every forward first; the 1F1B family runs a backward as soon as one is ready and keeps at
most the schedule's in-flight micro-batches (``solver.inter_op.in_flight``); the zero-bubble schedules split each
backward into its input- and weight-gradient halves and run weight halves where a stage would idle. (A greedy
order: for interleaved 1F1B it can draw a larger bubble than the schedule's ideal the cost model prices.) The idle share
of the busiest stage in the drawing is shown beside the plan's predicted bubble: the drawing is a check of the
prediction, not a measurement."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoshard.errors import InternalError
from autoshard.notation import format_seconds
from autoshard.plans.html.svg import Svg, colour, esc
from autoshard.plans.plan import Plan
from autoshard.solver.inter_op import SPLIT_BACKWARD, in_flight, pipeline_time


@dataclass(frozen=True)
class Task:
    """One block of the drawing: rank, kind ("F", "B", or "I"/"W" for a split backward), micro-batch, chunk."""

    rank: int
    kind: str
    mb: int
    chunk: int
    start: float
    end: float


def simulate(schedule: str, times: list[float], microbatches: int, chunks: int) -> list[Task]:
    """The list schedule described in the module docstring, for per-stage micro-batch ``times``."""
    S, B, v = len(times), microbatches, chunks
    split = schedule in SPLIT_BACKWARD
    kinds = ("F", "I", "W") if split else ("F", "B")
    share = {"F": 1 / 3, "B": 2 / 3, "I": 1 / 3, "W": 1 / 3}
    K = S * v  # virtual stages: chunk c of rank s is stage c * S + s

    def rank(k: int) -> int:
        return k % S

    def deps(kind: str, m: int, k: int) -> list[tuple[str, int, int]]:
        back = "I" if split else "B"
        if kind == "F":
            return [("F", m, k - 1)] if k else []
        if kind == back:
            return [("F", m, k)] + ([(back, m, k + 1)] if k < K - 1 else [])
        return [("I", m, k)]  # W after its own input gradient

    pending = {r: [(kd, m, k) for m in range(B) for k in range(K) if rank(k) == r for kd in kinds] for r in range(S)}
    # forwards a rank may have open (run, backward not yet): GPipe all; 1F1B the schedule's in-flight count;
    # interleaved twice Megatron's warm-up ((S - r - 1) * 2 + (v - 1) * S forwards, plus the steady state's one):
    # with Megatron's own bound this greedy order stalls (S=8, 32 micro-batches, 4 chunks: a loop 40% longer than
    # the schedule's), with twice it it draws the zero-bubble loops exactly and interleaved 1F1B within 5-13%
    limit = {
        r: B * v
        if schedule == "GPipe"
        else max(1, math.ceil(in_flight(schedule, r, S, B, v)))
        if v == 1
        else min(B * v, 2 * ((S - r - 1) * 2 + (v - 1) * S + 1))
        for r in range(S)
    }
    done: dict[tuple[str, int, int], float] = {}
    free, out, open_fw, t, relax = [0.0] * S, [], [0] * S, 0.0, False
    while any(pending.values()):
        for r in range(S):
            if not pending[r] or free[r] > t:
                continue
            ready = [x for x in pending[r] if all(d in done and done[d] <= t for d in deps(*x))]
            pick = _choose(schedule, ready, relax or open_fw[r] < limit[r], S)
            if pick is None:
                continue
            kd, m, k = pick
            dur = times[r] / v * share[kd]
            done[pick] = free[r] = t + dur
            pending[r].remove(pick)
            open_fw[r] += 1 if kd == "F" else -1 if kd in ("B", "I") else 0
            out.append(Task(r, kd, m, k // S, t, t + dur))
        later = [x for x in [*free, *done.values()] if x > t]
        if not later and any(pending.values()):  # every rank waits at its in-flight limit: let one forward more
            if relax:
                raise InternalError(f"pipeline drawing stalled at {t} ({schedule}, {B} micro-batches, {S} stages)")
            relax = True
            continue
        relax = False
        t = min(later, default=t)
    return out


def _choose(schedule: str, ready: list[tuple[str, int, int]], may_forward: bool, S: int) -> tuple[str, int, int] | None:
    """The next task among ``ready`` (kind, micro-batch, virtual stage): by kind as the schedule prefers, then
    Megatron's interleaved order (micro-batches in groups of ``S``, each group through the chunks, forwards in
    chunk order and backwards in reverse)."""
    order = {"F": 0, "B": 1, "I": 1, "W": 2} if schedule == "GPipe" else {"B": 0, "I": 0, "F": 1, "W": 2}
    ok = [x for x in ready if x[0] != "F" or may_forward or schedule == "GPipe"]
    if not ok:
        return None
    return min(ok, key=lambda x: (order[x[0]], x[1] // S, x[2] // S if x[0] == "F" else -(x[2] // S), x[1]))


def idle_share(tasks: list[Task], stages: int) -> float:
    """The idle fraction of the busiest stage over the drawing's span."""
    span = max(t.end for t in tasks) - min(t.start for t in tasks)
    busy = max(sum(t.end - t.start for t in tasks if t.rank == r) for r in range(stages))
    return 1.0 - busy / span if span > 0 else 0.0


MAX_TASKS = 48  # per stage: more, and the drawing shows the warm-up, one steady period and the cool-down
GAP = 46  # pixels between the two windows


def windows(tasks: list[Task], stages: int, microbatches: int) -> list[tuple[float, float]]:
    """The time ranges drawn: all of it for a short loop; else from the start until the first stage has finished
    the backward of micro-batch ``stages`` (the warm-up and one steady-state period), and as long at the end
    (one period and the cool-down)."""
    if not tasks:
        return []
    span = max(t.end for t in tasks)
    if max(sum(1 for t in tasks if t.rank == r) for r in range(stages)) <= MAX_TASKS or microbatches <= stages + 2:
        return [(0.0, span)]
    m = min(microbatches - 1, stages)
    first = max(t.end for t in tasks if t.rank == 0 and t.mb == m and t.kind in ("B", "I"))  # (W: deferred)
    if 2 * first >= span:
        return [(0.0, span)]
    return [(0.0, first), (span - first, span)]


def pipeline_view(plan: Plan) -> str:
    """The schedule chart of a pipelined plan (an explanation for a plan without stages): every task of a short
    loop, else its warm-up, one steady period and its cool-down (``windows``), with a legend."""
    if len(plan.stages) < 2 or not plan.schedule:
        return '<p class="note">No pipeline stages: the whole mesh runs every layer.</p>'
    times = [s.microbatch_time_s for s in plan.stages]
    tasks = simulate(plan.schedule, times, plan.microbatches, plan.chunks)
    span = max(t.end for t in tasks)
    wins = windows(tasks, len(times), plan.microbatches)
    row, left, width = 26, 70, 680
    plot = width - GAP * (len(wins) - 1)
    shown = sum(b - a for a, b in wins)
    svg = Svg(left + width + 20, 24 + row * len(times) + 20, "pipeline schedule")

    offsets, x = [], float(left)
    for a, b in wins:  # each window's left edge
        offsets.append(x)
        x += plot * (b - a) / shown + GAP

    pieces = []  # (task, x, width): a task drawn in each window it runs in, cut at the window's edges
    for t in tasks:
        for (a, b), x0 in zip(wins, offsets):
            if t.end > a and t.start < b:
                x = x0 + plot * (max(t.start, a) - a) / shown
                pieces.append((t, x, plot * (min(t.end, b) - max(t.start, a)) / shown))
    for t, x, w in pieces:
        if w <= 0:
            continue
        y = 18 + row * t.rank
        fill = colour(t.mb) if t.kind == "F" else "#444" if t.kind == "W" else colour(t.mb)
        op = 0.55 if t.kind == "F" else 1.0
        tip = (
            f"stage {t.rank}: "
            f"{dict(F='forward', B='backward', I='input-gradient backward', W='weight-gradient backward')[t.kind]} "
            f"of micro-batch {t.mb}"
            + (f", chunk {t.chunk}" if plan.chunks > 1 else "")
            + f", {format_seconds(t.start)}–{format_seconds(t.end)}"
        )
        stroke = ' stroke="#fff" stroke-width="0.5"' if w > 3 else ""  # thin blocks: the stroke would hide them
        svg.parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.5):.1f}" height="{row - 8}" fill="{fill}" '
            f'fill-opacity="{op}"{stroke} class="task"><title>{esc(tip)}</title></rect>'
        )
        if w > 14:
            svg.text(x + w / 2, y + row / 2 + 1, f"{t.kind}{t.mb}", size=9, anchor="middle", fill="#111")
    for r in range(len(times)):
        svg.text(left - 6, 18 + row * r + row / 2, f"stage {r}", anchor="end")
    bottom = 24 + row * len(times) + 8
    if len(wins) > 1:
        gx = left + plot * (wins[0][1] - wins[0][0]) / shown
        hidden = wins[1][0] - wins[0][1]
        svg.text(gx + GAP / 2, 18 + row * len(times) / 2, "⋯", size=16, anchor="middle", fill="#555")
        svg.text(
            left,
            bottom,
            f"0 … {format_seconds(wins[0][1])}: warm-up and a steady period · {format_seconds(hidden)} of steady "
            f"state not drawn · {format_seconds(wins[1][0])} … {format_seconds(span)}: a period and cool-down",
            size=10,
            fill="#555",
        )
    else:
        svg.text(left, bottom, f"0 … {format_seconds(span)} (the micro-batch loop)", size=10, fill="#555")
    split = plan.schedule in SPLIT_BACKWARD
    keys = (
        [
            ("forward (a micro-batch's colour, light)", colour(0), 0.55),
            ("input-gradient backward (solid)" if split else "backward (solid)", colour(0), 1.0),
        ]
        + ([("weight-gradient backward", "#444", 1.0)] if split else [])
        + [("idle", "#fff", 1.0)]
    )
    legend_html = (
        '<div class="legend">'
        + "".join(
            f'<span class="key" style="background:{c};opacity:{o};border:1px solid #ccc"></span>{esc(n)}'
            for n, c, o in keys
        )
        + "</div>"
    )
    drawn = idle_share(tasks, len(times))
    priced, _ = pipeline_time(plan.schedule, times, plan.microbatches, plan.chunks)
    note = (
        f"{plan.schedule}, {plan.microbatches} micro-batches"
        + (f", {plan.chunks} chunks per rank" if plan.chunks > 1 else "")
        + f": idle share of the busiest stage in this drawing {drawn:.1%}; the plan predicts a bubble of "
        f"{plan.bubble_fraction:.1%} of the step. F = forward (lighter), B = backward"
        + (", I / W = input- / weight-gradient halves (W dark)" if plan.schedule in SPLIT_BACKWARD else "")
        + "."
    )
    if span > 1.1 * priced:  # the drawing's greedy order falls short of the schedule's ideal: say so, with both
        note += (
            f" This drawing's loop ({format_seconds(span)}) is {span / priced - 1:.0%} longer than the loop the "
            f"cost model prices for this schedule ({format_seconds(priced)}): its task order is a greedy "
            "approximation of the interleaved schedule, not the runtime's."
        )
    return (
        f'<div class="chart" data-view="pipeline" data-drawn-bubble="{drawn:.4f}">{svg}{legend_html}</div>'
        f'<p class="note">{esc(note)}</p>'
    )
