"""The plan's HTML page (issue 29): every view present and drawn from the plan's own numbers, for a small solved
plan, an offline plan with pipeline stages and a memory-bound plan; the page rendered in headless Chromium without
errors; the pieces (tiles, pipeline drawing, the plan in words) checked on their own."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.cli import main
from autoshard.cluster.meshes import fake_world
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.notation import describe, format_bytes, format_seconds
from autoshard.plans.html.layouts import tensor_tiles
from autoshard.plans.html.page import VIEWS, render_html, write_html
from autoshard.plans.html.schedule import idle_share, simulate
from autoshard.plans.plan import MeshSpec, Plan
from autoshard.plans.report import report
from autoshard.plans.words import axis_roles, plan_in_words, what_bounds
from autoshard.solver.inter_op import pipeline_time

CFG = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, seq_len=16, bias=False)


class _Page(HTMLParser):
    """Sections by data-view, with their text and how many rects / svgs each holds."""

    def __init__(self) -> None:
        super().__init__()
        self.sections: dict[str, dict] = {}
        self.current: str | None = None
        self.attrs: list[dict] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        self.attrs.append({"tag": tag, **a})
        if tag == "section":
            self.current = a["data-view"]
            self.sections[self.current] = {"text": "", "rect": 0, "svg": 0}
        elif self.current and tag in ("rect", "svg"):
            self.sections[self.current][tag] += 1

    def handle_data(self, data: str) -> None:
        if self.current:
            self.sections[self.current]["text"] += data + " "


def _parse(page: str) -> _Page:
    p = _Page()
    p.feed(page)
    return p


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        small = autoshard.plan(
            GPT(CFG),
            mesh,
            gpt_example_inputs(CFG, 8),
            cluster="a100-80gb",
            constraints={"inputs": {"dp": torch.distributed.tensor.Shard(0)}},
        )
    piped = autoshard.plan("gpt2-124m", {"pp": 2, "dp": 4}, cluster="a100-80gb:2x4", global_batch=16, time_limit_s=5)
    # one micro-batch: left free, the planner fits 5 GB by accumulating instead, and this case must recompute
    tight = autoshard.plan(
        "gpt2-124m", cluster="a100-80gb:1x2", global_batch=16, memory_budget="5GB", microbatches=1, time_limit_s=5
    )
    return {"small": small, "pipelined": piped, "memory-bound": tight}


def test_every_view_is_drawn_from_the_plans_numbers(plans: dict[str, Plan]) -> None:
    assert len(plans["pipelined"].stages) == 2 and plans["memory-bound"].recompute_layers  # the cases asked for
    for name, plan in plans.items():
        page = _parse(render_html(plan))
        assert list(page.sections) == list(VIEWS), name
        for view in ("recipes", "memory", "step", "layouts"):
            assert page.sections[view]["svg"] >= 1 and page.sections[view]["rect"] >= 2, (name, view)
        text = {v: re.sub(r"\s+", " ", s["text"]) for v, s in page.sections.items()}
        assert plan_in_words(plan) in text["header"]
        assert format_seconds(plan.step_time_s) in text["header"]
        assert what_bounds(plan) in text["header"] and what_bounds(plan) in report(plan), name
        for stage in plan.stages:  # each stage's memory bar ends with its total (and the budget)
            assert format_bytes(stage.memory.total) in text["memory"], (name, stage.index)
        budget = plan.memory_budget_bytes
        assert (f"of {format_bytes(budget)}" in text["memory"]) == bool(budget)
        applying = [r for r in plan.recipes if r.applies]
        for r in applying:  # a bar per recipe, its time and ratio to the plan as the plan has them
            assert f"{format_seconds(r.step_time_s)} {r.step_time_s / plan.step_time_s:.2f}×" in text["recipes"], r.name
            assert all(d in text["recipes"] for d in r.differences), r.name  # and what makes the difference
        # a tile per shard: a parameter sharded over both axes of a (2, 2) mesh is drawn as 4 tiles
        tiles = sum(1 for a in page.attrs if a.get("class") == "tile")
        assert tiles >= sum(1 for s in plan.stages for t in s.tensors if t.role == "parameter") // 2
    tight = plans["memory-bound"]  # what bounds it: the plan's own terms, adding up to its step, and the lever
    stage, bounds = tight.stages[0], what_bounds(tight)
    assert stage.compute_s + stage.comm_s == pytest.approx(tight.step_time_s, rel=1e-6)
    for term in (stage.compute_s - tight.recompute_s, tight.recompute_s, stage.comm_s):
        assert f"{format_seconds(term)} ({term / tight.step_time_s:.0%})" in bounds, bounds
    assert (
        f"memory binds: {format_bytes(tight.peak_memory.total)} of {format_bytes(tight.memory_budget_bytes)}" in bounds
    )
    assert "recomputing " + describe(tight.recompute_layers) in bounds
    assert "memory binds" not in what_bounds(plans["small"]) and "pipeline idle" in what_bounds(plans["pipelined"])
    small = plans["small"]  # each recipe's largest terms against the plan, a layout change among them
    assert all(r.differences for r in small.recipes if r.applies and r.step_time_s != small.step_time_s)
    assert any("->" in d for r in small.recipes for d in r.differences)
    piped = _parse(render_html(plans["pipelined"]))
    drawn = [a for a in piped.attrs if a.get("data-view") == "pipeline" and a["tag"] == "div"]
    assert drawn and abs(float(drawn[0]["data-drawn-bubble"]) - plans["pipelined"].bubble_fraction) < 0.05
    tasks = sum(1 for a in piped.attrs if a.get("class") == "task")
    p = plans["pipelined"]
    assert tasks == len(p.stages) * p.microbatches * p.chunks * (3 if p.schedule == "InterleavedZeroBubble" else 2)
    assert "No pipeline stages" in _parse(render_html(plans["small"])).sections["pipeline"]["text"]


def test_views_can_be_chosen_and_unknown_ones_are_named(plans: dict[str, Plan], tmp_path: Path) -> None:
    out = write_html(plans["small"], tmp_path / "p.html", views=("header", "layouts"))
    assert list(_parse(out.read_text()).sections) == ["header", "layouts"]
    with pytest.raises(autoshard.InputError, match="'tiles'.*header, recipes"):
        render_html(plans["small"], views=("tiles",))


def test_tiles_show_which_devices_hold_which_shard() -> None:
    mesh = MeshSpec((2, 2), ("dp", "tp"))

    def labels(placements: tuple[str, ...], shape: tuple[int, ...] = (8, 8)) -> list[str]:
        svg = str(tensor_tiles("w", shape, placements, mesh))
        return re.findall(r'class="tile"><title>shard \d+: held by ([^,<]+)', svg)

    assert labels(("S(0)", "S(1)")) == ["dp0·tp0", "dp0·tp1", "dp1·tp0", "dp1·tp1"]  # a 2 x 2 grid
    assert labels(("S(0)", "S(0)")) == ["dp0·tp0", "dp0·tp1", "dp1·tp0", "dp1·tp1"]  # dim 0 in 4, dp outer
    assert labels(("R", "S(1)")) == ["tp0", "tp1"]  # replicated over dp: said under the drawing
    assert "same on every dp" in str(tensor_tiles("w", (8, 8), ("R", "S(1)"), mesh))
    assert labels(("R", "R"), (8,)) == ["every device"]
    assert "partial sums over dp" in str(tensor_tiles("y", (8, 8), ("P", "R"), mesh))
    assert "each device: [4, 4]" in str(tensor_tiles("w", (8, 8), ("S(0)", "S(1)"), mesh))


@pytest.mark.parametrize("schedule,chunks", [("GPipe", 1), ("1F1B", 1), ("InterleavedZeroBubble", 2)])
def test_the_pipeline_drawing_agrees_with_the_cost_model_on_equal_stages(schedule: str, chunks: int) -> None:
    for stages, mbs in ((4, 8), (2, 4)):
        tasks = simulate(schedule, [1.0] * stages, mbs, chunks)
        total, bubble = pipeline_time(schedule, [1.0] * stages, mbs, chunks)
        assert max(t.end for t in tasks) == pytest.approx(total)
        assert idle_share(tasks, stages) == pytest.approx(bubble)
        for r in range(stages):  # a stage runs one task at a time
            mine = sorted((t.start, t.end) for t in tasks if t.rank == r)
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:]))


def test_the_plan_in_words_names_each_recipe() -> None:
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        words = {}
        for recipe in ("ddp", "fsdp", "zero2", "tp", "fsdp+tp"):
            torch.manual_seed(0)
            plan = autoshard.plan(GPT(CFG), mesh, gpt_example_inputs(CFG, 8), recipe=recipe, solve_recipes=False)
            words[recipe] = {r.axis: r.kind for r in axis_roles(plan.stages[0])}
    assert words["ddp"] == {"dp": "dp", "tp": "dp"}  # the batch split over both axes
    assert words["fsdp"] == {"dp": "fsdp", "tp": "fsdp"}
    assert words["zero2"] == {"dp": "zero2", "tp": "zero2"}
    assert words["tp"]["tp"] == "tp" and words["fsdp+tp"] == {"dp": "fsdp", "tp": "tp"}


def test_the_terminal_report_starts_with_the_plan_in_words(plans: dict[str, Plan]) -> None:
    plan = plans["pipelined"]
    first = report(plan).splitlines()[0]
    assert first == plan_in_words(plan)
    assert "2 pipeline stages" in first and f"{plan.microbatches} micro-batches" in first


def test_cli_writes_the_page(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plan.html"
    assert (
        main(
            [
                "plan",
                "--model",
                "gpt2-124m",
                "--cluster",
                "a100-80gb:1x2",
                "--global-batch",
                "4",
                "--seq",
                "128",
                "--no-recipes",
                "--time-limit",
                "5",
                "-q",
                "--html",
                str(out),
                "--out",
                str(tmp_path / "p.json"),
            ]
        )
        == 0
    )
    plan = Plan.from_json((tmp_path / "p.json").read_text())
    assert list(_parse(out.read_text()).sections) == list(VIEWS)
    assert plan_in_words(plan) in out.read_text() and capsys.readouterr().out.startswith(plan_in_words(plan))


_PROBE = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message)));
const _ce = console.error; console.error = (...a) => { window.__errors.push(a.join(' ')); _ce(...a); };
window.addEventListener('load', () => {
  const views = {};
  document.querySelectorAll('section[data-view]').forEach(s => {
    const svgs = [...s.querySelectorAll('svg')].filter(g => g.getBoundingClientRect().width > 0);
    views[s.dataset.view] = {height: s.getBoundingClientRect().height, svgs: svgs.length,
                             text: s.innerText.length};
  });
  const out = document.createElement('pre'); out.id = '__check';
  out.textContent = JSON.stringify({errors: window.__errors, views});
  document.body.appendChild(out);
});
</script>"""


def test_the_page_renders_in_a_real_browser(plans: dict[str, Plan], tmp_path: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("needs Debian's chromium (apt-get install chromium; the README's test command installs it)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=3000"]
    for name, plan in plans.items():
        page = render_html(plan)
        probe = tmp_path / f"{name}-probe.html"
        probe.write_text(page.replace("<head>", "<head>" + _PROBE, 1))
        dom = subprocess.run(
            [chromium, *flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120
        ).stdout
        found = re.search(r'<pre id="__check">(.*?)</pre>', dom, re.S)
        assert found, f"{name}: the page did not finish loading:\n{dom[-2000:]}"
        check = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
        assert check["errors"] == [], (name, check["errors"])
        assert list(check["views"]) == list(VIEWS)
        for view, seen in check["views"].items():
            assert seen["height"] > 20 and seen["text"] > 10, (name, view, seen)
            drawn = view != "header" and (view != "pipeline" or len(plan.stages) > 1)
            assert seen["svgs"] >= 1 or not drawn, (name, view, seen)
        shot = tmp_path / f"{name}.png"
        plain = tmp_path / f"{name}.html"
        plain.write_text(page)
        subprocess.run(
            [chromium, *flags, "--window-size=1150,1600", f"--screenshot={shot}", plain.as_uri()],
            capture_output=True,
            timeout=120,
            check=True,
        )
        assert shot.stat().st_size > 20_000  # a page of charts, not a blank one


def test_compile_writes_the_page_of_the_plan_it_runs(tmp_path: Path) -> None:
    from harness import local_ranks

    out = tmp_path / "compiled.html"
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        torch.manual_seed(0)
        sharded = autoshard.compile(
            GPT(CFG), mesh, gpt_example_inputs(CFG, 4), backend="eager", recipe="fsdp", report=out
        )
    page = out.read_text()
    assert plan_in_words(sharded.plan) in page and "dp=2 FSDP (ZeRO-3)" in page
    assert list(_parse(page).sections) == list(VIEWS)


def test_explain_prices_every_difference_and_the_terms_add_up(
    plans: dict[str, Plan], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from autoshard.plans.explain import explain

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        ddp, fsdp = (
            autoshard.plan(GPT(CFG), mesh, gpt_example_inputs(CFG, 8), recipe=r, solve_recipes=False)
            for r in ("ddp", "fsdp")
        )
    e = explain(ddp, fsdp)
    assert sum(c.value for c in e.time) == pytest.approx(fsdp.step_time_s - ddp.step_time_s, rel=1e-9, abs=1e-12)
    assert sum(c.value for c in e.memory) == e.memory_delta_bytes == fsdp.peak_memory.total - ddp.peak_memory.total
    whats = {c.what.split(",")[0] for c in e.time}
    assert any(w.startswith("all_gather on") for w in whats)  # FSDP's gathers, DDP's all-reduce: priced
    changed = {c.name for c in e.layouts}
    assert "layers.{i}.attn.wq.weight" in changed and all(c.before == ("R", "R") for c in e.layouts)
    assert {c.layers for c in e.layouts if c.name.startswith("layers.")} == {"0–1"}  # both layers, folded
    assert explain(ddp, ddp).time == () and explain(ddp, ddp).layouts == ()
    piped, flat = plans["pipelined"], plans["memory-bound"]
    e2 = explain(flat, piped)  # a pipelined plan: the schedule is the rest, still summing to the difference
    assert sum(c.value for c in e2.time) == pytest.approx(piped.step_time_s - flat.step_time_s, rel=1e-9)
    a, b = tmp_path / "ddp.json", tmp_path / "fsdp.json"
    a.write_text(ddp.to_json())
    b.write_text(fsdp.to_json())
    assert main(["explain", str(a), str(b), "--html", str(tmp_path / "why.html")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ddp: {plan_in_words(ddp)}") and "parameter layouts that differ (ddp -> fsdp)" in out
    assert format_seconds(fsdp.step_time_s - ddp.step_time_s) in out
    assert "explain" in _parse((tmp_path / "why.html").read_text()).sections
    assert main(["explain", str(tmp_path / "missing.json"), str(b)]) == 2


def test_measured_numbers_are_drawn_next_to_the_predictions(plans: dict[str, Plan]) -> None:
    import dataclasses

    plan = plans["small"]
    recipes = tuple(
        dataclasses.replace(r, measured_s=r.step_time_s * 1.1, measured_peak_bytes=r.peak_memory_bytes + 1)
        for r in plan.recipes
    )
    timed = dataclasses.replace(
        plan, recipes=recipes, measured_s=plan.step_time_s * 0.9, measured_peak_bytes=int(plan.peak_memory.total * 1.05)
    )
    assert Plan.from_json(timed.to_json()) == timed
    page = render_html(timed)
    text = re.sub(r"\s+", " ", _parse(page).sections["memory"]["text"])
    assert f"measured {format_bytes(timed.measured_peak_bytes)}" in text
    ticks = re.findall(r"<line [^>]*><title>measured ([^<]+)</title>", page)
    applying = sum(1 for r in plan.recipes if r.applies)
    # the plan's and every recipe's step and peak (recipes view), the memory and step views' stage bars
    assert len(ticks) == 2 * (1 + applying) + 2, ticks
    assert format_seconds(timed.measured_s) in ticks and "measured step" in _parse(page).sections["header"]["text"]
    assert "measured" not in " ".join(re.findall(r"<title>(measured[^<]*)</title>", render_html(plan)))


def _collective_bars(page: str) -> list[tuple[str, float]]:
    """The collectives view's bars: (label, seconds per step) from each bar's segment tooltips."""
    out = []
    for chart in re.findall(r'data-view="collectives">(.*?)</div>', page, flags=re.S):
        for label, body in re.findall(
            r'text-anchor="end"[^>]*>([^<]+ · [^<]+ · [^<]+)</text>(.*?)(?=text-anchor="end"|$)', chart, flags=re.S
        ):
            secs = [m for m in re.findall(r"(?:exposed|overlapped): ([0-9.]+ (?:s|ms|µs))", body)]
            out.append((label, sum(_seconds(s) for s in secs)))
    return out


def _seconds(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"s": 1.0, "ms": 1e-3, "µs": 1e-6}[unit]


def test_the_collectives_are_added_up_by_kind_axis_and_phase_with_a_time_axis(plans: dict[str, Plan]) -> None:
    """One bar per kind x axis x phase, adding up to the stage's collectives per step (to the shown precision);
    exposed and overlapped apart (the overlapped part is the plan's credit); only drawn series in its legend."""
    for name, plan in plans.items():
        page = render_html(plan)
        bars = _collective_bars(page)
        stage = plan.stages[0]
        want = {(c.kind, c.axis, c.phase) for c in stage.collectives}
        assert {tuple(label.split(" · ")) for label, _ in bars[: len(want)]} == want, name
        total = sum(c.time_s * c.repeat for c in stage.collectives)
        assert sum(t for _, t in bars[: len(want)]) == pytest.approx(total, rel=0.01), name
        hidden = sum(_seconds(s) for s in re.findall(r"overlapped: ([0-9.]+ (?:s|ms|µs))", page))
        assert hidden == pytest.approx(plan.hidden_comm_s, rel=0.01, abs=1e-7), name
        assert "0</text>" in page and "Most expensive collectives" in page and "Largest tensors" in page
        for legend_html in re.findall(r'data-view="collectives">.*?<div class="legend">(.*?)</div>', page, re.S):
            assert ("overlapped" in legend_html) == (plan.hidden_comm_s > 0), name


@pytest.mark.slow
def test_the_70b_pipelined_page_stays_readable_and_under_a_megabyte() -> None:
    """Llama-3-70B in 4 stages of (dp=4, tp=8), 128 micro-batches x 2 chunks: the page is under 1 MB (it was
    3.6 MB of sub-pixel collectives); the schedule draws the warm-up and the cool-down, not every task; the top
    tables add up the copies of a layer."""
    plan = autoshard.plan(
        "llama3-70b", cluster="h100-sxm:16x8", seq=8192, global_batch=512, mesh={"pp": 4, "dp": 4, "tp": 8}
    )
    page = render_html(plan)
    assert len(page.encode()) < 2**20, len(page)
    parsed = _parse(page)
    tasks = sum(1 for a in parsed.attrs if a.get("class") == "task")
    every = len(plan.stages) * plan.microbatches * plan.chunks * 3
    assert plan.microbatches >= 64 and 0 < tasks < every / 4, (tasks, every)
    assert "of steady state not drawn" in parsed.sections["pipeline"]["text"]
    assert "weight-gradient backward" in parsed.sections["pipeline"]["text"]
    assert "layers.*.feed_forward.w1.weight (× " in page
