"""Regenerate the plan guide's screenshots and numbers from the commands the docs show, so they cannot go stale.

    python docs/regen.py              # plans the guide's commands, writes docs/img/*.png and the marked numbers
    python docs/regen.py --check      # only says which marked numbers differ from a fresh run (no images)

Every image under docs/img is made here (``IMAGES``: its file, the command it shows, the page sections drawn),
rendered by headless Chromium from the page of that command's plan and cropped to its content. Every number in
the docs written as ``<!--n:key-->value<!--/n-->`` is replaced by this run's value of ``key`` (``numbers``); a
marker whose key this script does not make is an error, so none is left behind. A command's printed output in
the docs sits between ``<!--out:key-->`` and ``<!--/out-->`` and is rewritten from this run (``OUTPUTS``: the
command and the lines kept of what it prints). Planning times are measured here, on the machine this runs on, and
written with its CPU named. ``tests/unit/test_structure.py`` checks that
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
BLOCK = re.compile(r"<!--out:([a-z0-9_-]+)-->\n(.*?)<!--/out-->", re.S)
ELAPSED = re.compile(r"^\[ *[0-9.]+ s\]", re.M)  # (the progress lines' wall clock: --check does not hold it)

# the guide's commands, as the docs show them
REPORT = (
    "autoshard plan --model llama3-70b --cluster h100-sxm:16x8 --seq 8192 --global-batch 512 "
    "--mesh pp=4,dp=4,tp=8 --html plan.html"
)
README = "autoshard plan --model llama3-70b --cluster h100-sxm:16x8 --seq 2048 --global-batch 128 --out plan.json"
SMALL = "autoshard plan --model llama3-8b --cluster h100-sxm:1x8 --seq 8192 --global-batch 8 --html plan8b.html"
EXPLAIN_A = "autoshard plan --model gpt2-1.5b --cluster a100-80gb:4x8 --global-batch 64 --out plan.json"
EXPLAIN_B = "autoshard plan --model gpt2-1.5b --cluster a100-80gb:4x8 --global-batch 64 --recipe fsdp --out fsdp.json"
REFUSED = "autoshard plan --model llama3-70b --cluster h100-sxm:2x8 --global-batch 64 --memory-per-device 5GB"
FLOOR = re.compile(r"needs ([0-9.]+ [KMGT]i?B) per device .*Use at least (\d+) devices \(e\.g\. cluster '([^']+)'")


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


@dataclass(frozen=True)
class Output:
    """A command's output as a doc shows it: the lines matching ``keep`` (in order; ``...`` where lines are left
    out), and the first of them only for the patterns in ``first``."""

    key: str
    command: str
    keep: tuple[str, ...]
    first: tuple[str, ...] = ()
    fails: bool = False  # (the command ends in an error, and the doc shows it)


OUTPUTS = (
    Output(
        "pipeline-auto",
        "autoshard plan --model gpt2-1.5b --cluster a100-80gb:4x8 --seq 1024 --global-batch 64 --pipeline auto",
        keep=(
            r"\] pipeline +done",
            r"; step .* the best recipe's",
            r"^autoshard plan ",
            r"^  pp\+tp\+dp ",
            r"^best recipe",
        ),
    ),
    Output(
        "pipeline-pp4",
        "autoshard plan --model gpt2-1.5b --cluster a100-80gb:4x8 --seq 1024 --global-batch 64 --mesh pp=4,dp=8",
        keep=(
            r"^autoshard plan ",
            r"^  1 stage \(no pipeline\)",
            r"^pipeline: ",
            r"^  stage  ranks",
            r"^  \d+ +\d+–\d+ ",
            r"^stage balance",
        ),
        first=(r"^== stage 0 ",),
    ),
    *(
        Output(
            f"offload-{way}",
            "autoshard plan --model llama3-70b --cluster a100-80gb:1x8 --seq 2048 --global-batch 8"
            + (f" --offload {way}" if way != "auto" else ""),
            keep=(r"; step ", r"^peak memory / device", r"^offload: ", r"^activation recomputation", r"error: "),
            fails=way == "none",
        )
        for way in ("auto", "none", "optimizer")
    ),
)
DOCS = (
    "README.md",
    "docs/guide/plan-report.md",
    "docs/guide/pipelines.md",
    "docs/guide/offline-planning.md",
    "docs/guide/offload.md",
)


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


def _printed(command: str, fails: bool = False) -> str:
    """What ``command`` prints through the CLI (stdout and stderr); ``fails``: it must end in an error."""
    from autoshard.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(shlex.split(command)[1:])
    if (rc != 0) != fails:
        raise SystemExit(f"{command}: exit status {rc}\n{buf.getvalue()[-2000:]}")
    return buf.getvalue()


def _output(out: Output) -> str:
    """Run ``out.command`` through the CLI and keep its lines as the doc shows them (see :class:`Output`)."""
    from autoshard.cluster.calibrate import cpu_name

    kept, gap, firsts = [], False, set(out.first)
    for line in _printed(out.command, out.fails).splitlines():
        once = next((f for f in firsts if re.search(f, line)), None)
        if once or any(re.search(k, line) for k in out.keep):
            firsts.discard(once)
            if gap and kept:
                kept.append("...")
            kept.append(line.rstrip())
            gap = False
        else:
            gap = True
    if not kept:
        raise SystemExit(f"{out.command}: none of its output lines is kept; update OUTPUTS")
    day = time.strftime("%Y-%m-%d")
    return f"Output ({day}, {cpu_name()}, by docs/regen.py; predictions):\n\n```\n" + "\n".join(kept) + "\n```\n"


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


def numbers(plans: dict[str, object], walls: dict[str, float], pages: dict[str, int], refusal: str) -> dict[str, str]:
    """The marked numbers of the docs, from this run's plans and the floor's refusal of ``REFUSED``."""
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
    floor = FLOOR.search(refusal)
    if floor is None:
        raise SystemExit(f"{REFUSED}: its refusal no longer reads as docs/regen.py expects:\n{refusal[-1000:]}")
    return {
        "floor-need": floor.group(1),
        "floor-devices": f"{floor.group(2)} devices (`{floor.group(3)}`)",
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


def _substitute(values: dict[str, str], blocks: dict[str, str], check: bool) -> list[str]:
    """Write ``values`` and ``blocks`` into the markers of ``DOCS``; the markers that changed (``check``: without
    writing; a block's date, machine and wall clocks are not held to a fresh run)."""

    def bare(block: str) -> str:
        return ELAPSED.sub("[t]", block.split("\n", 1)[-1])

    changed = []
    for rel in DOCS:
        path = ROOT / rel
        text = path.read_text()
        for key, old in MARK.findall(text):
            if key not in values:
                raise SystemExit(f"{rel}: marker {key!r} is not made by docs/regen.py")
            if old != values[key] and not (check and key in MEASURED):
                changed.append(f"{rel}: {key}: {old!r} -> {values[key]!r}")
        for key, old in BLOCK.findall(text):
            if key not in blocks:
                raise SystemExit(f"{rel}: output block {key!r} is not made by docs/regen.py")
            if bare(old) != bare(blocks[key]):
                changed.append(f"{rel}: output of {key!r} changed:\n{blocks[key]}")
        new = MARK.sub(lambda m: f"<!--n:{m.group(1)}-->{values[m.group(1)]}<!--/n-->", text)
        new = BLOCK.sub(lambda m: f"<!--out:{m.group(1)}-->\n{blocks[m.group(1)]}<!--/out-->", new)
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
    blocks = {}
    for out in OUTPUTS:
        start = time.perf_counter()
        blocks[out.key] = _output(out)
        print(f"ran in {time.perf_counter() - start:.1f} s: {out.command}", file=sys.stderr)
    refusal = _printed(REFUSED, fails=True)
    changed = _substitute(numbers(plans, walls, pages, refusal), blocks, args.check)
    print("\n".join(changed) or "every marked number is current")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
