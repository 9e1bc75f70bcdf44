"""Regenerate the plan guide's screenshots and numbers from the commands the docs show, so they cannot go stale.

    python docs/regen.py              # plans the guide's commands, writes docs/img/*.png and the marked numbers
    python docs/regen.py --check      # only says which marked numbers differ from a fresh run (no images)

Every image under docs/img is made here (``IMAGES``: its file, the command it shows, the page sections drawn),
rendered by headless Chromium from the page of that command's plan and cropped to its content. Every number in
the docs written as ``<!--n:key-->value<!--/n-->`` is replaced by this run's value of ``key`` (``numbers``); a
marker whose key this script does not make is an error, so none is left behind. Planning times are measured
here, on the machine this runs on, and written with its CPU named. ``tests/unit/test_structure.py`` checks that
every image has its entry here and that every ``autoshard`` command in the docs parses.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # (this checkout's autoshard, whatever is installed)
IMG = ROOT / "docs" / "img"
MEASURED = {"report-time"}  # (a wall time: --check does not hold it to a fresh run)
MARK = re.compile(r"<!--n:([a-z0-9_-]+)-->(.*?)<!--/n-->", re.S)

# the guide's commands, as the docs show them
REPORT = (
    "autoshard plan --model llama3-70b --cluster h100-sxm:16x8 --seq 8192 --global-batch 512 "
    "--mesh pp=4,dp=4,tp=8 --html plan.html"
)
README = "autoshard plan --model llama3-70b --cluster h100-sxm:16x8 --seq 2048 --global-batch 128 --out plan.json"
SMALL = "autoshard plan --model llama3-8b --cluster h100-sxm:1x8 --seq 8192 --global-batch 8 --html plan8b.html"
EXPLAIN_A = "autoshard plan --model gpt2-1.5b --cluster a100-80gb:4x8 --global-batch 64 --out plan.json"
EXPLAIN_B = "autoshard plan --model gpt2-1.5b --cluster a100-80gb:4x8 --global-batch 64 --recipe fsdp --out fsdp.json"


@dataclass(frozen=True)
class Image:
    """One screenshot: its file under docs/img, the command whose plan it shows, the page's sections drawn."""

    file: str
    command: str
    views: tuple[str, ...]
    explain: bool = False
    height: int = 1900  # px at most: the top of a long section


IMAGES = (
    Image("plan-overview.png", REPORT, ("header", "recipes", "memory")),
    Image("plan-step.png", REPORT, ("step",), height=2400),
    Image("plan-pipeline.png", REPORT, ("pipeline",)),
    Image("plan-layouts.png", REPORT, ("layouts",), height=1400),
    Image("plan-explain.png", EXPLAIN_B, ("header",), explain=True),
    Image("readme-plan.png", README, ("header", "recipes", "memory")),
    Image("plan-8b.png", SMALL, ("header", "step"), height=2200),
)
DOCS = ("README.md", "docs/guide/plan-report.md")


def _plan(command: str, out: Path) -> tuple[object, float]:
    """Run ``command`` through the CLI (``--out`` to a file of our own, quiet): the plan and its wall time."""
    from autoshard.cli import main
    from autoshard.plans.plan import Plan

    argv = shlex.split(command)[1:]
    argv = [a for i, a in enumerate(argv) if a not in ("--html", "--out") and argv[i - 1] not in ("--html", "--out")]
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = main([*argv, "--out", str(out), "-q"])
    wall = time.perf_counter() - start
    if rc != 0:
        raise SystemExit(f"{command}: exit status {rc}")
    return Plan.from_json(out.read_text()), wall


def _shot(html: str, path: Path, tmp: Path, height: int) -> None:
    """``html`` rendered by headless Chromium at 1150 px wide, cropped to its content (``height`` px at most)."""
    from PIL import Image as PILImage
    from PIL import ImageChops

    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("docs/regen.py needs headless Chromium (apt-get install chromium)")
    page = tmp / f"{path.stem}.html"
    page.write_text(html)
    raw = tmp / f"{path.stem}.raw.png"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1150,9000"]
    subprocess.run([*cmd, f"--screenshot={raw}", page.as_uri()], check=True, capture_output=True, timeout=120)
    im = PILImage.open(raw).convert("RGB")
    box = ImageChops.difference(im, PILImage.new("RGB", im.size, "white")).getbbox() or (0, 0, *im.size)
    im.crop((0, 0, im.size[0], min(im.size[1], box[3] + 16, height))).save(path, optimize=True)


def numbers(plans: dict[str, object], walls: dict[str, float], pages: dict[str, int]) -> dict[str, str]:
    """The marked numbers of the docs, from this run's plans."""
    from autoshard.cluster.calibrate import cpu_name
    from autoshard.notation import format_bytes, format_seconds
    from autoshard.plans.html.schedule import idle_share, simulate
    from autoshard.plans.words import plan_in_words
    from autoshard.solver.inter_op import pipeline_time

    p, a, b = plans[REPORT], plans[EXPLAIN_A], plans[EXPLAIN_B]
    fits = [r for r in p.recipes if r.applies and r.fits]
    best = min(fits, key=lambda r: r.step_time_s) if fits else None
    times = [s.microbatch_time_s for s in p.stages]
    tasks = simulate(p.schedule, times, p.microbatches, p.chunks) if len(p.stages) > 1 else []
    priced = pipeline_time(p.schedule, times, p.microbatches, p.chunks)[0] if tasks else 0.0
    fullest = max(p.stages, key=lambda s: s.memory.total)
    return {
        "report-time": f"{walls[REPORT]:.0f} s on {cpu_name()}",
        "report-page": f"a {pages[REPORT] / 1e6:.2f} MB page",
        "report-words": plan_in_words(p),
        "report-best-recipe": (
            f"{best.name} ({best.note or 'as planned alone'}), takes {best.step_time_s / p.step_time_s:.2f}× the "
            "plan's step"
            if best
            else "no recipe fits the budget"
        ),
        "report-memory": (
            f"activations are {format_bytes(fullest.memory.activations)} of {format_bytes(fullest.memory.total)} "
            f"on stage {fullest.index}, the fullest"
        ),
        "report-bubble": (
            f"{idle_share(tasks, len(times)):.1%} drawn, {p.bubble_fraction:.1%} predicted; the loop is "
            f"{format_seconds(max(t.end for t in tasks))} drawn, {format_seconds(priced)} priced"
            if tasks
            else "no stages"
        ),
        "explain-memory": format_bytes(abs(a.peak_memory.total - b.peak_memory.total)),
        "explain-memory-way": "saves" if b.peak_memory.total < a.peak_memory.total else "costs",
        "explain-time": format_seconds(abs(b.step_time_s - a.step_time_s)),
        "explain-time-way": "costs" if b.step_time_s > a.step_time_s else "saves",
    }


def _substitute(values: dict[str, str], check: bool) -> list[str]:
    """Write ``values`` into the markers of ``DOCS``; the markers that changed (``check``: without writing)."""
    changed = []
    for rel in DOCS:
        path = ROOT / rel
        text = path.read_text()
        for key, old in MARK.findall(text):
            if key not in values:
                raise SystemExit(f"{rel}: marker {key!r} is not made by docs/regen.py")
            if old != values[key] and not (check and key in MEASURED):
                changed.append(f"{rel}: {key}: {old!r} -> {values[key]!r}")
        new = MARK.sub(lambda m: f"<!--n:{m.group(1)}-->{values[m.group(1)]}<!--/n-->", text)
        if not check and new != text:
            path.write_text(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="say which numbers differ; write nothing")
    args = parser.parse_args(argv)
    from autoshard.plans.html.page import render_html

    plans: dict[str, object] = {}
    walls: dict[str, float] = {}
    pages: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for k, command in enumerate(dict.fromkeys([REPORT, README, SMALL, EXPLAIN_A, EXPLAIN_B])):
            plans[command], walls[command] = _plan(command, tmp / f"plan{k}.json")
            pages[command] = len(render_html(plans[command]).encode())
            print(f"planned in {walls[command]:.1f} s: {command}", file=sys.stderr)
        if not args.check:
            for image in IMAGES:
                compare = plans[EXPLAIN_A] if image.explain else None
                html = render_html(plans[image.command], image.views, compare=compare, names=("plan", "fsdp"))
                _shot(html, IMG / image.file, tmp, image.height)
                print(f"wrote docs/img/{image.file}", file=sys.stderr)
    changed = _substitute(numbers(plans, walls, pages), args.check)
    print("\n".join(changed) or "every marked number is current")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
