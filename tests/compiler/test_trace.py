"""The predicted step as a Chrome trace (``autoshard/plans/trace.py``): what ``autoshard plan --trace``,
``compile(trace=)`` and ``sharded.profile`` write holds to the trace event format (Perfetto's trace processor is not
installable here: ``check_trace`` checks the format's rules, and a broken trace is caught), one process per stage,
its compute thread ending at the predicted step; the profile puts torch.profiler's measured steps beside it."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from harness import local_ranks
from numerics_utils import GPT_CFG
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.cli import main
from autoshard.errors import InputError
from autoshard.models.gpt import GPT, gpt_example_inputs
from autoshard.plans.trace import PREDICTED_PID, check_trace, predicted_trace, read_trace

US = 1e6


def _threads(trace: dict) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def _lane(trace: dict, pid: int, name: str) -> list[dict]:
    tid = next(t for (p, t), n in _threads(trace).items() if p == pid and n == name)
    return sorted(
        (e for e in trace["traceEvents"] if e["ph"] == "X" and (e["pid"], e["tid"]) == (pid, tid)),
        key=lambda e: e["ts"],
    )


def test_the_cli_writes_the_flat_step_as_a_trace_ending_at_the_prediction(tmp_path, capsys) -> None:
    """GPT-2 124M on 8 H100s: a gzip trace; forward blocks then backward blocks on one compute thread, each
    block's wait on its axis's lane, the once-a-step work last; the last event ends at the predicted step."""
    out, saved = tmp_path / "plan.json.gz", tmp_path / "plan.json"
    argv = ["plan", "--model", "gpt2-124m", "--cluster", "h100-sxm:1x8", "--global-batch", "16", "--seq", "512"]
    assert main([*argv, "-q", "--trace", str(out), "--out", str(saved)]) == 0
    assert "predicted trace written to" in capsys.readouterr().err
    trace = json.loads(gzip.decompress(out.read_bytes()))
    check_trace(trace)
    step = trace["otherData"]["predicted_step_s"]
    assert trace["otherData"]["drawn_step_s"] == pytest.approx(step, rel=1e-9)
    compute = _lane(trace, PREDICTED_PID, "compute")
    names = [e["name"] for e in compute]
    assert names[0].startswith("forward ") and names[-1].startswith("backward ")
    assert names.index("forward layers.0") < names.index("forward layers.1") < names.index("backward layers.1")
    assert names.index("backward layers.1") < names.index("backward layers.0")
    ends = [e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert max(ends) == pytest.approx(step * US, rel=1e-6)
    assert all(b["ts"] >= a["ts"] + a["dur"] - 1e-6 for a, b in zip(compute, compute[1:]))  # (one thread: in turn)
    assert any(n.startswith("communication") for n in _threads(trace).values())
    from autoshard.plans.plan import Plan

    assert predicted_trace(Plan.from_json(saved.read_text())) == trace  # (the saved plan gives the same trace)


def test_a_pipelined_plan_is_one_process_per_stage_with_its_schedule_and_sends() -> None:
    plan = autoshard.plan(
        "gpt2-124m", cluster="h100-sxm:2x8", seq=512, global_batch=64, mesh={"pp": 2, "dp": 8}, time_limit_s=10
    )
    trace = predicted_trace(plan)
    check_trace(trace)
    processes = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert [p["args"]["name"].split(" (")[0] for p in processes] == ["predicted: stage 0", "predicted: stage 1"]
    b, v = plan.microbatches, plan.chunks
    for s in plan.stages:
        tasks = _lane(trace, PREDICTED_PID + s.index, "compute")
        kinds = {e["name"].split()[0] for e in tasks}
        assert len(tasks) == len(kinds) * b * v and "F" in kinds
        sends = _lane(trace, PREDICTED_PID + s.index, "pp: boundary sends")
        assert len(sends) == b * v * (len(kinds & {"F"}) + len(kinds & {"B", "I"})) - b  # (none off either end)
    # the drawing is a list schedule of the stages' micro-batch times: a check of the prediction
    assert trace["otherData"]["drawn_step_s"] == pytest.approx(plan.step_time_s, rel=0.15)


def test_a_broken_trace_is_named() -> None:
    good = {"traceEvents": [{"name": "x", "ph": "X", "ts": 0, "dur": 1, "pid": 1, "tid": 0}]}
    check_trace(good)
    for bad, needle in [
        ({"events": []}, "'traceEvents' list"),
        ({"traceEvents": [{"name": "x", "ph": "X", "ts": 0, "pid": 1, "tid": 0}]}, "lacks ['dur']"),
        ({"traceEvents": [{"name": "x", "ph": "X", "ts": -1, "dur": 1, "pid": 1, "tid": 0}]}, "ts=-1"),
        ({"traceEvents": [{"name": "x", "ph": "Q", "ts": 0, "pid": 1}]}, "unknown phase 'Q'"),
        ({"traceEvents": [{"name": "thread_name", "ph": "M", "pid": 1, "args": {}}]}, "names nothing"),
    ]:
        with pytest.raises(InputError, match=needle.replace("[", r"\[").replace("(", r"\(")):
            check_trace(bad)


def test_compile_writes_the_trace_and_profile_puts_the_measured_steps_beside_it(tmp_path) -> None:
    """Two simulated ranks (LocalTensorMode) compile the zoo GPT with ``trace=``; ``sharded.profile`` trains 1 + 2
    steps with the optimizer, torch.profiler's events marked per step, and the prediction shifted to the last."""
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    inputs = gpt_example_inputs(GPT_CFG, 4)
    with local_ranks(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        sharded = autoshard.compile(model, mesh, inputs, backend="eager", trace=tmp_path / "compiled.json")
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
        got = sharded.profile(*inputs, steps=2, optimizer=opt, path=tmp_path / "profile.json.gz")
    compiled = read_trace(tmp_path / "compiled.json")
    check_trace(compiled)
    assert compiled == predicted_trace(sharded.plan)
    assert got == tmp_path / "profile.json.gz"
    merged = read_trace(got)
    check_trace(merged)
    marks = sorted(
        (e for e in merged["traceEvents"] if e.get("name", "").startswith("autoshard step")), key=lambda e: e["ts"]
    )
    assert [e["name"] for e in marks] == ["autoshard step 0", "autoshard step 1"]
    predicted = [
        e
        for e in merged["traceEvents"]
        if e["ph"] == "X" and str(e["pid"]).isdigit() and int(e["pid"]) >= PREDICTED_PID
    ]
    assert predicted and min(e["ts"] for e in predicted) == pytest.approx(marks[-1]["ts"])
    assert merged["otherData"]["autoshard"]["predicted_step_s"] == sharded.plan.step_time_s
    with pytest.raises(InputError, match=r"steps=0"):
        sharded.profile(*inputs, steps=0, path=tmp_path / "no.json")
