"""Inline SVG for the plan's HTML page (``autoshard/plans/html/page.py``): a small builder of rectangles, lines and
text with native tooltips (``<title>``), a colour palette, and the horizontal stacked bar every chart of the page
is made of. No script, no external file: the page opens offline in any browser."""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autoshard.notation import format_seconds

# colour-blind-safe hues (Okabe-Ito, then lighter companions) for categories and devices
PALETTE = (
    "#0072B2",
    "#E69F00",
    "#009E73",
    "#CC79A7",
    "#56B4E9",
    "#D55E00",
    "#F0E442",
    "#999999",
    "#7FB8D8",
    "#F2CF80",
    "#80CEB9",
    "#E5BCD3",
    "#AAD9F4",
    "#EAAE80",
    "#F7F1A1",
    "#CCCCCC",
)


def colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def esc(s: object) -> str:
    return html.escape(str(s), quote=True)


class Svg:
    """An SVG drawing built element by element; ``str(svg)`` is the markup."""

    def __init__(self, width: float, height: float, label: str) -> None:
        self.width, self.height, self.label = width, height, label
        self.parts: list[str] = []

    def rect(
        self, x: float, y: float, w: float, h: float, fill: str, tip: str = "", stroke: str = "#fff", cls: str = ""
    ) -> None:
        title = f"<title>{esc(tip)}</title>" if tip else ""
        c = f' class="{esc(cls)}"' if cls else ""
        self.parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.0):.1f}" height="{max(h, 0.0):.1f}" '
            f'fill="{fill}" stroke="{stroke}" stroke-width="0.5"{c}>{title}</rect>'
        )

    def text(
        self,
        x: float,
        y: float,
        s: str,
        size: float = 11,
        anchor: str = "start",
        fill: str = "#222",
        bold: bool = False,
    ) -> None:
        weight = ' font-weight="bold"' if bold else ""
        self.parts.append(
            f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{fill}"{weight}>{esc(s)}</text>'
        )

    def line(
        self, x1: float, y1: float, x2: float, y2: float, stroke: str = "#222", dash: str = "", tip: str = ""
    ) -> None:
        d = f' stroke-dasharray="{dash}"' if dash else ""
        title = f"<title>{esc(tip)}</title>" if tip else ""
        self.parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}" '
            f'stroke-width="1.5"{d}>{title}</line>'
        )

    def __str__(self) -> str:
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width:.0f}" height="{self.height:.0f}" '
            f'viewBox="0 0 {self.width:.0f} {self.height:.0f}" role="img" aria-label="{esc(self.label)}" '
            f'font-family="system-ui, sans-serif">' + "".join(self.parts) + "</svg>"
        )


@dataclass(frozen=True)
class Segment:
    """One piece of a stacked bar: its size (in the chart's unit), legend name and tooltip."""

    value: float
    name: str
    tip: str = ""


@dataclass(frozen=True)
class Bar:
    """One row of a stacked bar chart: its label, pieces, the text after it, and an optional marker (e.g. a
    measured value) drawn as a dark tick on the bar."""

    label: str
    segments: tuple[Segment, ...]
    after: str = ""
    marker: float = 0.0
    marker_tip: str = ""
    faded: bool = False


def stacked_bars(
    bars: Sequence[Bar],
    label: str,
    names: Sequence[str],
    limit: float = 0.0,
    limit_tip: str = "",
    width: float = 760,
    label_w: float = 150,
    after_w: float = 170,
    axis: bool = False,
    fills: Mapping[str, str] | None = None,
) -> Svg:
    """Horizontal stacked bars on one scale (the largest bar or ``limit``, a dashed vertical line such as the
    memory budget), each category coloured by its index in ``names`` (``legend(names)`` says which); ``axis``: a
    time axis under them (seconds, four ticks)."""
    row, top = 24, 8
    svg = Svg(width, top + row * len(bars) + (30 if axis else 8), label)
    scale_max = max([limit] + [sum(s.value for s in b.segments) for b in bars] + [b.marker for b in bars]) or 1.0
    plot = width - label_w - after_w
    for j, b in enumerate(bars):
        y = top + j * row
        svg.text(label_w - 6, y + 15, b.label, anchor="end", fill="#888" if b.faded else "#222")
        x = label_w
        for s in b.segments:
            w = plot * s.value / scale_max
            fill = (fills or {}).get(s.name) or (colour(names.index(s.name)) if s.name in names else "#bbb")
            svg.rect(x, y + 3, w, row - 8, fill, s.tip or s.name, cls="seg")
            x += w
        svg.text(label_w + plot + 6, y + 15, b.after, fill="#888" if b.faded else "#222")
        if b.marker:
            mx = label_w + plot * b.marker / scale_max
            svg.line(mx, y + 1, mx, y + row - 3, stroke="#000", tip=b.marker_tip)
    if limit:
        lx = label_w + plot * limit / scale_max
        svg.line(lx, top - 4, lx, top + row * len(bars), stroke="#C00", dash="4 3", tip=limit_tip)
    if axis:
        y = top + row * len(bars) + 4
        svg.line(label_w, y, label_w + plot, y, stroke="#888")
        for k in range(5):
            x = label_w + plot * k / 4
            svg.line(x, y, x, y + 4, stroke="#888")
            svg.text(x, y + 16, format_seconds(scale_max * k / 4) if k else "0", anchor="middle", size=10, fill="#555")
    return svg


def legend(
    names: Sequence[str], offset: int = 0, drawn: Sequence[Bar] = (), fills: Mapping[str, str] | None = None
) -> str:
    """An HTML legend (it wraps) of ``names`` coloured from ``offset`` in the palette; given the ``drawn`` bars,
    only the names some segment of them has (each keeps its colour)."""
    used = {seg.name for b in drawn for seg in b.segments} if drawn else set(names)
    keys = "".join(
        f'<span class="key" style="background:{(fills or {}).get(n) or colour(offset + i)}"></span>{esc(n)}'
        for i, n in enumerate(names)
        if n in used
    )
    return f'<div class="legend">{keys}</div>'
