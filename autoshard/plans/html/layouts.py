"""The page's layouts view: each parameter and each forward activation of a stage drawn as its tensor cut into
the tiles the mesh holds (what ``[S(0), S(1)]`` means, seen, as JAX's ``visualize_array_sharding`` draws it).

A tensor is drawn as a rectangle: rows along dim 0, columns along its last dim split over the mesh (or its last
dim); a 1-D tensor is one row. Each tile is one shard, coloured by its index and labelled with the mesh
coordinates that hold it (``dp1·tp0``); axes that replicate it are said once under the drawing ("on every tp"),
and a partial sum (``P``) is drawn hatched. Repeated layers are folded as in the terminal report: one layer is
drawn, with "layers.1–31: same as layers.0" in place of the others; a layer that differs is drawn in full.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from autoshard.notation import fold_layers, local_shape
from autoshard.plans.html.svg import Svg, colour, esc
from autoshard.plans.plan import MeshSpec, StagePlan

MAX_SIDE = 8  # tiles drawn per side; more are summarized ("…64 row shards")
MAX_CARDS = 80  # drawings per section of a stage


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _dim(p: str) -> int | None:
    return int(p[2:-1]) if p.startswith("S(") else None


def _axes_on(placements: Sequence[str], dim: int | None) -> list[int]:
    return [i for i, p in enumerate(placements) if dim is not None and _dim(p) == dim]


def _coords(k: int, axes: Sequence[int], mesh: MeshSpec) -> list[tuple[int, int]]:
    """Chunk ``k`` of a dim split over ``axes`` (outer mesh axis first) as (axis, coordinate) pairs."""
    out = []
    for i in reversed(axes):
        out.append((i, k % mesh.shape[i]))
        k //= mesh.shape[i]
    return list(reversed(out))


def tensor_tiles(name: str, shape: Sequence[int], placements: Sequence[str], mesh: MeshSpec, note: str = "") -> Svg:
    """``name`` (global ``shape``) drawn as its shards over ``mesh`` under ``placements``."""
    shape = tuple(shape)
    nd = len(shape)
    row_dim = 0 if nd >= 2 else None
    sharded_cols = [d for d in range(1, nd) if any(_dim(p) == d for p in placements)]
    col_dim = (sharded_cols[-1] if sharded_cols else nd - 1) if nd >= 2 else (0 if nd == 1 else None)
    row_axes, col_axes = _axes_on(placements, row_dim), _axes_on(placements, col_dim)
    rows = math.prod(mesh.shape[i] for i in row_axes)
    cols = math.prod(mesh.shape[i] for i in col_axes)
    other = [(i, p) for i, p in enumerate(placements) if _dim(p) is not None and i not in row_axes + col_axes]
    repl = [mesh.names[i] for i, p in enumerate(placements) if p == "R" and mesh.shape[i] > 1]
    partial = [mesh.names[i] for i, p in enumerate(placements) if p.startswith("P") and mesh.shape[i] > 1]
    w = 170.0
    aspect = (shape[row_dim] / max(shape[col_dim], 1)) if row_dim is not None and col_dim is not None else 0.1
    dr, dc = min(rows, MAX_SIDE), min(cols, MAX_SIDE)
    h = min(max(w * aspect, 26.0, 14.0 * dr), 160.0)  # (at least 14 px a row of tiles: no unlabelled hairlines)
    lines = [f"{_shape(shape)}  {'[' + ', '.join(placements) + ']'}"]
    try:
        lines.append(f"each device: {_shape(local_shape(shape, tuple(placements), mesh.shape))}")
    except ValueError:
        lines.append("uneven shards")
    if repl:
        lines.append("same on every " + ", ".join(repl))
    if partial:
        lines.append("partial sums over " + ", ".join(partial))
    lines += [f"dim {_dim(p)} also split over {mesh.names[i]}" for i, p in other]
    if note:
        lines.append(note)
    # as wide as its title and its lines need (6.5 px a character at these sizes): nothing cut off
    wide = max(w + 12, 6.8 * len(name) + 12, 5.9 * max(len(x) for x in lines) + 12)
    svg = Svg(wide, h + 30 + 13 * len(lines), f"{name} tiles")
    svg.text(6, 13, name, size=11, bold=True)
    tw, th = w / dc, h / dr
    for r in range(dr):
        for c in range(dc):
            k = r * cols + c
            holders = _coords(r, row_axes, mesh) + _coords(c, col_axes, mesh)
            label = "·".join(f"{mesh.names[i]}{v}" for i, v in sorted(holders)) or "every device"
            tip = f"shard {k}: held by {label}" + (f", every {', '.join(repl)}" if repl else "")
            fill = "url(#hatch)" if partial else colour(k)
            svg.rect(6 + c * tw, 20 + r * th, tw, th, fill, tip, stroke="#fff", cls="tile")
            if tw > 34 and th > 13:
                svg.text(6 + c * tw + tw / 2, 20 + r * th + th / 2 + 4, label, size=9, anchor="middle", fill="#fff")
    more = [f"…{rows} row shards" if rows > dr else "", f"…{cols} column shards" if cols > dc else ""]
    if any(more):
        lines.insert(1, " ".join(m for m in more if m))
    for j, s in enumerate(lines):
        svg.text(6, h + 36 + 13 * j, s, size=10, fill="#444")
    return svg


def _section(title: str, cards: list[tuple[str, str, Svg]]) -> str:
    """Cards grouped under their module headers; ``cards`` are (header, folded-line-or-"", drawing)."""
    out, header = [f"<h4>{esc(title)}</h4>", '<div class="cards">'], None
    for head, fold, svg in cards[:MAX_CARDS]:
        if fold:
            out.append(f'<div class="fold">{esc(fold)}</div>')
            continue
        if head != header:
            out.append(f'<div class="cardhead">{esc(head or "(top level)")}</div>')
            header = head
        out.append(f'<div class="card">{svg}</div>')
    if len(cards) > MAX_CARDS:
        out.append(f'<div class="fold">… {len(cards) - MAX_CARDS} more (the plan JSON has all)</div>')
    return "\n".join(out + ["</div>"])


def _folded(rows: list[tuple[str, tuple]], draw: Callable[[int, str], Svg], depth: int) -> list[tuple[str, str, Svg]]:
    """Cards of ``rows`` (name, signature) with repeated layers folded; a card's header is its name less the last
    ``depth`` components (a parameter's module's parent, an op's module's parent), and ``draw(i, short name)``
    draws row ``i`` under it."""
    cards = []
    for e in fold_layers(rows):
        if isinstance(e, str):
            cards.append(("", e, Svg(0, 0, "")))
        else:
            parts = rows[e][0].split(".")
            head = ".".join(parts[:-depth]) if len(parts) > depth else ""
            cards.append((head, "", draw(e, ".".join(parts[-depth:]) if head else rows[e][0])))
    return cards


def layouts_view(stage: StagePlan) -> str:
    """The parameters and the forward activations of ``stage``, each as its tiles, repeated layers folded."""
    params = [t for t in stage.tensors if t.role in ("parameter", "input")]
    prow = [(t.name, (t.placements, t.shape, t.frozen)) for t in params]
    notes = [
        (t.zero and f"optimizer state: {t.zero}") or ("frozen: no gradient, no optimizer state" if t.frozen else "")
        for t in params
    ]
    pcards = _folded(
        prow, lambda i, name: tensor_tiles(name, params[i].shape, params[i].placements, stage.mesh, notes[i]), 2
    )
    acts = [o for o in stage.ops if o.phase == "forward" and o.shape]
    arow = [(o.module or o.node, (o.op, o.output, o.shape)) for o in acts]
    acards = _folded(
        arow,
        lambda i, name: tensor_tiles(f"{name}: {acts[i].op.split('.')[-2]}", acts[i].shape, acts[i].output, stage.mesh),
        1,
    )
    return _section("parameters and inputs", pcards) + _section("activations (forward outputs)", acards)
