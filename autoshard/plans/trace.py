"""A plan's predicted step as a trace users already know how to read: the Chrome trace event format that Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` open, and torch.profiler writes.

One process per pipeline stage (its ranks all run the same program), with a thread for compute, one per mesh axis
for the communication the compute waits for, one for the communication the cost model overlaps, one for the stage
boundary sends, and one for what runs once a step. The events come from the plan's own numbers:

- **without stages**, the step per block (``StagePlan.layer_times``) laid end to end as the cost model adds it up:
  each micro-batch's forward through the blocks, then its backward in reverse order (a recomputed forward first);
  the exposed communication of a block after its compute, on the lanes of the axes its collectives use (in
  proportion to their times); then the once-a-step work; the overlapped communication beside the backward. The
  compute thread ends at the predicted step.
- **with stages**, the schedule the page draws (``plans/html/schedule.py: simulate``: each micro-batch's forward and
  backward per chunk, as a list schedule of the stages' micro-batch times), each task's boundary send at its end,
  then the stage's once-a-step work. The drawing is a check of the prediction, not a measurement: its step is
  given beside the predicted one in the trace's metadata.

``merge`` puts a trace torch.profiler wrote beside the predicted one (``ShardedModule.profile``), so prediction and
measurement open in one viewer; ``check_trace`` holds a trace to the format's rules (the tests use it).
"""

from __future__ import annotations

import gzip
import json
import logging
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autoshard.errors import InputError
from autoshard.plans.html.schedule import simulate
from autoshard.plans.plan import Plan, StagePlan, block_of

log = logging.getLogger(__name__)

US = 1e6  # the format's timestamps are microseconds
PREDICTED_PID = 1_000_000  # predicted processes start here, apart from a profiler's (its pids are the OS's)
SPECIAL = ("stage boundary sends", "optimizer step")
KIND = {"F": "forward", "B": "backward", "I": "input-gradient backward", "W": "weight-gradient backward"}


def _meta(pid: int, tid: int | None, what: str, name: str) -> dict[str, Any]:
    e: dict[str, Any] = {"name": what, "ph": "M", "pid": pid, "args": {"name": name}}
    if tid is not None:
        e["tid"] = tid
    return e


class _Lanes:
    """The events of one stage's process, with its threads named as they are first used."""

    def __init__(self, pid: int, name: str, sort: int) -> None:
        self.pid, self.events = pid, [_meta(pid, None, "process_name", name)]
        self.events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": sort}})
        self.tids: dict[str, int] = {}

    def add(self, lane: str, name: str, start: float, dur: float, cat: str, **args: Any) -> None:
        if dur <= 0:
            return
        if lane not in self.tids:
            self.tids[lane] = tid = len(self.tids)
            self.events.append(_meta(self.pid, tid, "thread_name", lane))
            self.events.append(
                {"name": "thread_sort_index", "ph": "M", "pid": self.pid, "tid": tid, "args": {"sort_index": tid}}
            )
        event = {"name": name, "ph": "X", "ts": start * US, "dur": dur * US, "pid": self.pid}
        self.events.append({**event, "tid": self.tids[lane], "cat": cat, "args": args})


def _axis_shares(s: StagePlan) -> dict[tuple[str, str], dict[str, float]]:
    """(block, phase) -> each mesh axis's share of the activation communication its ops wait for."""
    acc: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for c in s.collectives:
        if c.phase != "optimizer" and c.kind != "send_recv":
            acc[(block_of(c.owner), c.phase)][c.axis] += c.time_s * c.repeat
    out = {}
    for key, by_axis in acc.items():
        total = sum(by_axis.values())
        out[key] = {a: t / total for a, t in by_axis.items()} if total > 0 else {}
    return out


def _comm(lanes: _Lanes, at: float, dur: float, block: str, phase: str, shares: Mapping[str, float]) -> None:
    """A block's exposed communication from ``at``, split over the axes its collectives use."""
    for axis, share in sorted(shares.items()) or [("", 1.0)]:
        lane = f"communication: {axis}" if axis else "communication"
        lanes.add(lane, f"{phase} {block}: wait", at, dur * share, "communication", axis=axis)
        at += dur * share


def _flat(plan: Plan, s: StagePlan, lanes: _Lanes) -> float:
    """The step of a plan without stages laid out as the cost model adds it (see the module docstring)."""
    rows = [r for r in s.layer_times if r.name not in SPECIAL]
    k = max(1, plan.microbatches)
    shares = _axis_shares(s)
    t = 0.0
    for mb in range(k):
        for r in rows:
            n = r.runs / k
            stands = {"runs": round(n, 3)} if abs(n - 1) > 1e-9 else {}
            compute = n * (r.forward_s - r.forward_comm_s)
            lanes.add("compute", f"forward {r.name}", t, compute, "forward", microbatch=mb, **stands)
            t += compute
            _comm(lanes, t, n * r.forward_comm_s, r.name, "forward", shares.get((r.name, "forward"), {}))
            t += n * r.forward_comm_s
        back = t
        for r in reversed(rows):
            n = r.runs / k
            lanes.add("compute", f"recompute {r.name}", t, n * r.recompute_s, "recompute", microbatch=mb)
            t += n * r.recompute_s
            compute = n * (r.backward_s - r.backward_comm_s)
            lanes.add("compute", f"backward {r.name}", t, compute, "backward", microbatch=mb)
            t += compute
            _comm(lanes, t, n * r.backward_comm_s, r.name, "backward", shares.get((r.name, "backward"), {}))
            t += n * r.backward_comm_s
        hidden = plan.hidden_comm_s / k
        lanes.add("communication: overlapped", "gradient reductions (overlapped)", back, hidden, "overlapped")
    for r in s.layer_times:
        lanes.add("once a step", f"{r.name}: once a step", t, r.step_s, "once a step")
        t += r.step_s
    return t


def _pipelined(plan: Plan, all_lanes: list[_Lanes]) -> float:
    """Each stage's tasks of the page's schedule, its boundary sends, then its once-a-step work."""
    stages, v = len(plan.stages), max(1, plan.chunks)
    tasks = simulate(plan.schedule or "1F1B", [s.microbatch_time_s for s in plan.stages], plan.microbatches, v)
    for t in tasks:
        s, lanes = plan.stages[t.rank], all_lanes[t.rank]
        name = f"{t.kind} mb{t.mb}" + (f" chunk{t.chunk}" if v > 1 else "")
        lanes.add("compute", name, t.start, t.end - t.start, KIND[t.kind], microbatch=t.mb, chunk=t.chunk)
        # one send a task (a chunk's activations forward, or its input gradient back), in the task's time
        send = next((r.forward_s / v for r in s.layer_times if r.name == SPECIAL[0]), 0.0)
        first, final = t.rank == 0 and t.chunk == 0, t.rank == stages - 1 and t.chunk == v - 1
        if send and ((t.kind == "F" and not final) or (t.kind in ("B", "I") and not first)):
            to = "next stage" if t.kind == "F" else "previous stage"
            dur = min(send, t.end - t.start)
            lanes.add("pp: boundary sends", f"send to the {to}", t.end - dur, dur, "send_recv", microbatch=t.mb)
    ends = []
    for s, lanes in zip(plan.stages, all_lanes):
        at = max((t.end for t in tasks if t.rank == s.index), default=0.0)
        for r in s.layer_times:
            lanes.add("once a step", f"{r.name}: once a step", at, r.step_s, "once a step")
            at += r.step_s
        ends.append(at)
    return max(ends, default=0.0)


def predicted_trace(plan: Plan) -> dict[str, Any]:
    """The plan's predicted step in the trace event format (see the module docstring)."""
    if not all(s.layer_times for s in plan.stages):
        raise InputError(
            "this plan has no per-layer times (a plan saved before they were recorded): plan it again with this "
            "autoshard to write its trace"
        )
    all_lanes = []
    for s in plan.stages:
        ranks = f"ranks {s.ranks[0]}-{s.ranks[-1]}" if len(s.ranks) > 1 else f"rank {s.ranks[0]}" if s.ranks else ""
        what = f"stage {s.index}" if len(plan.stages) > 1 else "every rank"
        all_lanes.append(_Lanes(PREDICTED_PID + s.index, f"predicted: {what} ({ranks}, mesh {s.mesh})", s.index))
    drawn = _pipelined(plan, all_lanes) if len(plan.stages) > 1 else _flat(plan, plan.stages[0], all_lanes[0])
    return {
        "traceEvents": [e for lanes in all_lanes for e in lanes.events],
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "autoshard predicted step",
            "model": plan.model,
            "cluster": plan.cluster,
            "mesh": str(plan.mesh),
            "predicted_step_s": plan.step_time_s,
            "drawn_step_s": drawn,
            "microbatches": plan.microbatches,
            "schedule": plan.schedule or "",
        },
    }


def merge(measured: Mapping[str, Any], predicted: Mapping[str, Any], at_us: float = 0.0) -> dict[str, Any]:
    """A profiler's trace with the predicted one beside it, the predicted events shifted to start at ``at_us``."""
    events = list(measured.get("traceEvents", ()))
    for e in predicted["traceEvents"]:
        events.append({**e, "ts": e["ts"] + at_us} if "ts" in e else dict(e))
    other = {**dict(measured.get("otherData", {}) or {}), "autoshard": predicted.get("otherData", {})}
    return {**dict(measured), "traceEvents": events, "otherData": other}


def write_trace(trace: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``trace`` as JSON, gzip-compressed when ``path`` ends in ``.gz`` (both viewers open either)."""
    path = Path(path)
    data = json.dumps(trace).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    log.info("trace: %d events written to %s", len(trace.get("traceEvents", ())), path)
    return path


def read_trace(path: str | Path) -> dict[str, Any]:
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


# the trace event format's phases this module and torch.profiler write, and the fields each must have
_REQUIRED = {"X": ("name", "ts", "dur", "pid", "tid"), "M": ("name", "pid", "args"), "i": ("name", "ts", "pid")}
_OTHER_PHASES = set("BEbensftPCOND") | {"(", ")"}


def check_trace(trace: Any) -> None:
    """Raise :class:`InputError` naming the first event that breaks the trace event format's rules: a JSON object
    with a ``traceEvents`` list; every event an object with a known phase and that phase's fields, numeric
    timestamps and durations >= 0, and metadata events that name a process or thread."""
    if not isinstance(trace, Mapping) or not isinstance(trace.get("traceEvents"), list):
        raise InputError("a trace is a JSON object with a 'traceEvents' list")
    for i, e in enumerate(trace["traceEvents"]):
        if not isinstance(e, Mapping) or not isinstance(e.get("ph"), str):
            raise InputError(f"trace event {i} is not an object with a phase 'ph': {e!r}")
        ph = e["ph"]
        if ph not in _REQUIRED and ph not in _OTHER_PHASES:
            raise InputError(f"trace event {i} has an unknown phase {ph!r}")
        missing = [k for k in _REQUIRED.get(ph, ("ph",)) if k not in e]
        if missing:
            raise InputError(f"trace event {i} ({ph}) lacks {missing}: {e!r}")
        for k in ("ts", "dur"):
            if k in e and (not isinstance(e[k], (int, float)) or e[k] < 0):
                raise InputError(f"trace event {i}: {k}={e[k]!r} is not a number >= 0")
        if ph == "M" and e["name"] in ("process_name", "thread_name") and not isinstance(e["args"].get("name"), str):
            raise InputError(f"trace event {i}: a {e['name']} event names nothing: {e!r}")


__all__ = ["check_trace", "merge", "predicted_trace", "read_trace", "write_trace"]
