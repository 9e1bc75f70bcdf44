"""A plan as one self-contained HTML page: ``write_html(plan, "plan.html")``, ``autoshard plan ... --html FILE``
and ``autoshard.compile(..., report="FILE.html")``.

The page has no script and loads nothing: inline SVG and CSS, so it opens offline and prints. Its sections, in
order (each a ``<section data-view=...>``):

- **header**: the plan in words (``plans/words.py``), then model, mesh, cluster, options, solver, fingerprint and
  versions;
- **against the recipes** (``recipes``): step time and peak memory of the plan and every recipe solved for it;
- **memory** (``memory``): bytes per device at the peak, by kind, per stage, against the budget;
- **step time** (``step``): each stage's step split into compute, recomputation, offload, exposed and
  overlapped communication and pipeline idle time; then per layer; then one step's collectives per mesh axis;
- **pipeline** (``pipeline``): the schedule of micro-batches over stages (``plans/html/schedule.py``);
- **layouts** (``layouts``): every parameter and forward activation cut into its tiles over the mesh, repeated
  layers folded (``plans/html/layouts.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from autoshard.errors import InputError
from autoshard.notation import format_bytes, format_seconds
from autoshard.plans.html.charts import (
    collectives_view,
    explain_view,
    layers_view,
    memory_view,
    recipes_view,
    step_view,
    top_tables,
)
from autoshard.plans.html.layouts import layouts_view
from autoshard.plans.html.schedule import pipeline_view
from autoshard.plans.html.svg import esc
from autoshard.plans.plan import Plan
from autoshard.plans.words import axis_roles, plan_in_words, precision_words, what_bounds

log = logging.getLogger(__name__)

VIEWS = ("header", "recipes", "memory", "step", "pipeline", "layouts")

_CSS = """
body { font-family: system-ui, sans-serif; margin: 0 auto; max-width: 1100px; padding: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 4px 0; } h2 { font-size: 17px; border-bottom: 1px solid #ddd; padding-top: 8px; }
h4 { margin: 10px 0 4px; font-size: 13px; } .words { font-size: 15px; background: #f4f7fb; padding: 10px 12px;
border-left: 4px solid #0072B2; } nav a { margin-right: 14px; font-size: 13px; }
table.kv { border-collapse: collapse; font-size: 12px; margin: 6px 0; } \
table.kv td, table.kv th { padding: 2px 10px 2px 0;
text-align: left; vertical-align: top; } table.kv th { color: #555; font-weight: 600; }
.note { font-size: 12px; color: #555; } .chart { margin: 6px 0 10px; overflow-x: auto; }
.cards { display: flex; flex-wrap: wrap; gap: 6px; align-items: flex-start; } .card { border: 1px solid #e4e4e4; }
.cardhead, .fold { flex-basis: 100%; font-size: 12px; font-weight: 600; margin-top: 6px; } \
.fold { color: #777; font-weight: 400; }
td.num { text-align: right; font-variant-numeric: tabular-nums; } .delta { display: inline-block; height: 10px; }
.legend { font-size: 11px; } .key { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 10px; }
"""

_HATCH = (
    '<svg width="0" height="0" style="position:absolute"><defs><pattern id="hatch" width="6" height="6" '
    'patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" height="6" fill="#cfd8e3"/>'
    '<line x1="0" y1="0" x2="0" y2="6" stroke="#6b7c93" stroke-width="2"/></pattern></defs></svg>'
)


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def _kv(rows: list[tuple[str, str]]) -> str:
    return '<table class="kv">' + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows) + "</table>"


def _header(plan: Plan) -> str:
    sv = plan.solver
    rows = [
        ("model", plan.model or "-"),
        ("mesh", str(plan.mesh)),
        ("cluster", plan.cluster),
        ("predicted step", format_seconds(plan.step_time_s)),
        (
            "peak memory / device",
            format_bytes(plan.peak_memory.total)
            + (f" of {format_bytes(plan.memory_budget_bytes)} budget" if plan.memory_budget_bytes else ""),
        ),
    ]
    if plan.measured_s:
        rows.append(("measured step", format_seconds(plan.measured_s)))
    if plan.measured_peak_bytes:
        rows.append(("measured peak memory", f"{format_bytes(plan.measured_peak_bytes)} (the largest rank's)"))
    if plan.tokens_per_step:
        rows.append(
            ("throughput", f"{plan.tokens_per_s:,.0f} tokens/s" + (f", MFU {plan.mfu:.1%}" if plan.mfu else ""))
        )
    if plan.recipe:
        rows.append(("recipe", plan.recipe))
    if len(plan.stages) > 1:
        rows.append(
            (
                "pipeline",
                f"{len(plan.stages)} stages, {plan.schedule}, {plan.microbatches} micro-batches, "
                f"{plan.chunks} chunk(s) per rank",
            )
        )
    elif plan.microbatches > 1:
        rows.append(("gradient accumulation", f"{plan.microbatches} micro-batches"))
    rows += [
        (
            "mixed precision",
            f"{precision_words(plan)}, gradients reduced in {plan.reduce_dtype}" if plan.mixed_precision else "off",
        ),
        ("recomputation", ", ".join(plan.recompute_layers) or ("every layer" if plan.recompute else "none")),
        ("offloaded to host", format_bytes(plan.peak_memory.host) if plan.peak_memory.host else "nothing"),
    ]
    if plan.sampled_layers:
        rows.append(("repeated layers", plan.sampled_layers))
    rows += [("what bounds the step", what_bounds(plan))]
    rows += [
        (
            "solver",
            f"{sv.status}, objective {format_seconds(sv.objective_s)}, bound {format_seconds(sv.bound_s)}, "
            f"gap {sv.gap:.1%}, {format_seconds(sv.wall_s)}; {sv.groups} groups, {sv.variables} variables",
        )
    ]
    rows += [(f"made for: {k}", v) for k, v in plan.fingerprint] or [
        ("made for", "not recorded: a plan with pipeline stages is not replayed with plan= (it is planned again)")
        if len(plan.stages) > 1
        else ("made for", "not recorded (a plan of a recipe or one saved before fingerprints)")
    ]
    rows += [("rendered by", f"autoshard {_version('autoshard')}, torch {_version('torch')}")]
    pp = (
        f"<tr><td>pp={len(plan.stages)}</td><td>pp</td><td>{len(plan.stages)} pipeline stages ({esc(plan.schedule)}, "
        f"{plan.microbatches} micro-batches{f', {plan.chunks} chunks per rank' if plan.chunks > 1 else ''}), each on "
        f"its own sub-mesh</td><td>each stage holds its own layers' parameters</td></tr>"
        if len(plan.stages) > 1
        else ""
    )
    roles = pp + (
        "".join(
            f"<tr><td>{esc(r.axis)}={r.size}</td><td>{esc(r.kind)}</td><td>{esc(r.words)}</td>"
            f"<td>{r.share:.0%} of parameter bytes sharded</td></tr>"
            for r in axis_roles(plan.stages[0])
        )
        if plan.stages
        else ""
    )
    return (
        f'<section data-view="header"><h1>autoshard plan: {esc(plan.model or "model")} on {esc(plan.mesh)}</h1>'
        f'<p class="words" data-words>{esc(plan_in_words(plan))}</p>'
        f'<table class="kv"><tr><th>axis</th><th>role</th><th>in words</th><th>parameters</th></tr>{roles}</table>'
        f"{_kv(rows)}</section>"
    )


def render_html(
    plan: Plan, views: Sequence[str] = VIEWS, compare: Plan | None = None, names: tuple[str, str] = ("A", "B")
) -> str:
    """The page (see the module docstring) as a string, with the sections ``views`` (all by default); with
    ``compare``, an ``explain`` section after the header: why ``plan`` (named ``names[1]``) differs from
    ``compare`` (``names[0]``), ``plans/explain.py``."""
    if unknown := sorted(set(views) - set(VIEWS)):
        raise InputError(f"views {unknown} are not known; use some of {', '.join(VIEWS)}")
    timelines = "".join(
        (f"<h4>stage {s.index} ({esc(s.mesh)})</h4>" if len(plan.stages) > 1 else "")
        + collectives_view(plan, s)
        + top_tables(s)
        for s in plan.stages
    )
    layouts = "".join(
        (f"<h3>stage {s.index} ({esc(s.mesh)}, ranks {s.ranks[0]}–{s.ranks[-1]})</h3>" if len(plan.stages) > 1 else "")
        + layouts_view(s)
        for s in plan.stages
    )
    sections = dict(
        zip(
            VIEWS,
            [
                _header(plan),
                f'<section data-view="recipes"><h2 id="recipes">Against the recipes</h2>{recipes_view(plan)}</section>',
                f'<section data-view="memory"><h2 id="memory">'
                f"Memory per device (predicted; a black tick: measured)</h2>"
                f"{memory_view(plan)}</section>",
                f'<section data-view="step"><h2 id="step">Step time (predicted)</h2>{step_view(plan)}<h3>Per layer</h3>'
                f"{layers_view(plan)}<h3>Collectives per step, and the largest of everything</h3>"
                f'<p class="note">Each kind of collective on each mesh axis in each phase, added up over the step: '
                f"exposed (the step waits for it) and overlapped (hidden behind the backward by the cost model's "
                f"credit). Then the most expensive collectives, the largest tensors and the most expensive ops."
                f"</p>{timelines}</section>",
                f'<section data-view="pipeline"><h2 id="pipeline">Pipeline schedule</h2>'
                f"{pipeline_view(plan)}</section>",
                f'<section data-view="layouts"><h2 id="layouts">Layouts</h2>'
                f'<p class="note">Each tensor cut into the shards the mesh holds; a tile is labelled with the mesh '
                f"coordinates that hold it. Hover for details.</p>"
                f"{layouts}</section>",
            ],
        )
    )
    if compare is not None:
        sections["header"] += (
            f'<section data-view="explain"><h2 id="explain">Against {esc(names[0])}</h2>'
            f"{explain_view(compare, plan, names)}</section>"
        )
    nav = "".join(f'<a href="#{v}">{v}</a>' for v in VIEWS[1:] if v in views)
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(plan_in_words(plan))}</title><style>{_CSS}</style></head><body>{_HATCH}"
        f"<nav>{nav}</nav>" + "\n".join(sections[v] for v in VIEWS if v in views) + "</body></html>\n"
    )


def write_html(
    plan: Plan,
    path: str | Path,
    views: Sequence[str] = VIEWS,
    compare: Plan | None = None,
    names: tuple[str, str] = ("A", "B"),
) -> Path:
    """Write ``plan``'s page to ``path`` (see ``render_html``); returns the path."""
    out = Path(path)
    out.write_text(render_html(plan, views, compare, names), encoding="utf-8")
    log.info("plan page written to %s", out)
    return out
