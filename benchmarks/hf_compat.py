"""Which stock Hugging Face architectures autoshard captures, plans and trains like one device: one command, one table.

    python benchmarks/hf_compat.py                        # every architecture of autoshard.models.hf.TINY
    python benchmarks/hf_compat.py --only gpt2,t5 --backend eager --json hf_compat.json

Each architecture is the tiny stock ``transformers`` model of ``autoshard/models/hf.py`` (random init, nothing
downloaded) called with keyword arguments and a left-padded attention mask. Per architecture, in forked child
processes (this process does no torch computation, so forking stays safe for OpenMP; a launch that hangs is
stopped after ``--timeout`` seconds and the row says so):

- **captures**: tracing the model into one forward+backward graph (the first stage of planning) succeeded.
- **plans (8×8)**: ``autoshard.plan(model, mesh, batch)`` on a fake process group of 64 ranks, mesh (8, 8) named
  ("dp", "tp"), for the ``--cluster`` profile (default h100-sxm:8x8), model built with its stock dropout, batch
  ``--batch`` (divisible by 8) x ``--seq`` tokens. **plan time**: its wall seconds; **predicted step**: the plan's
  predicted step time.
- **gloo 2×2 equal**: 4 forked gloo ranks, mesh (2, 2) named ("dp", "tp"), dropout off and the same seed on every
  rank, ``autoshard.compile(model, mesh, batch, backend=--backend)`` then 3 steps of ``sharded.step(**batch)`` and
  AdamW (lr 1e-3), against the same model trained for 3 AdamW steps on one device (rank 0 computes it after the
  sharded run). Equal means: every rank's loss at every step within 1e-5 (absolute, plus 1e-5 relative) of the
  reference, every parameter's full gradient at step 1 within the same, every parameter after 3 steps within
  2e-4 (AdamW turns last-bit gradient differences into steps of up to lr). **loss / grad / param err**: the largest
  absolute differences. **compile time**: rank 0's seconds from ``autoshard.compile`` to the end of the first step
  (planning, lowering, and the backend's compilation, which happens on the first call). **params split**: how
  many of the parameters the 2×2 plan shards on some axis (the solver may keep a tiny model whole on 4 CPU
  ranks; ``--recipe fsdp+tp`` trains the manual FSDP x TP recipe instead, which shards them).
- **pp=2 equal** / **max err**: 2 gloo ranks, mesh ("pp",) = (2,): 2 pipeline stages, 4 micro-batches, 1F1B,
  compared like the 2×2 run (each rank on its stage's parameters); the largest loss, gradient or parameter error.
- **note**: why a row failed (the exception's type and first line, or the check that failed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from autoshard.errors import LaunchError
from autoshard.testing.launch import launch

log = logging.getLogger("hf_compat")

LR = 1e-3
STEPS = 3
ATOL, RTOL = 1e-5, 1e-5  # loss and gradients
PARAM_ATOL = 2e-4  # parameters after the AdamW steps
PLAN_MESH, TRAIN_MESH, NAMES = (8, 8), (2, 2), ("dp", "tp")
PP_MESH, PP_NAMES, PP_MICROBATCHES = (2,), ("pp",), 4


@dataclasses.dataclass
class Row:
    """One architecture's results; None where the stage did not run (an earlier one failed) or does not apply."""

    name: str
    cls: str = ""
    task: str = ""
    captures: bool | None = None
    plans: bool | None = None
    plan_s: float | None = None
    predicted_step_s: float | None = None
    equal: bool | None = None
    loss_err: float | None = None
    grad_err: float | None = None
    param_err: float | None = None
    compile_s: float | None = None
    split: str = ""  # parameters the 2x2 plan shards / all parameters
    pp_equal: bool | None = None  # 2 pipeline stages on 2 gloo ranks equal one device
    pp_err: float | None = None  # the largest of its loss, gradient and parameter errors
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.captures and self.plans and self.equal and self.pp_equal)


# ------------------------------------------------------------------------------------------------ the two checks


def _plan_case(rank: int, world: int, arg: tuple[str, int, int, str]) -> dict[str, Any]:
    """Plan on a fake (8, 8) world; a failure comes back as data, with whether capture got through."""
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard
    from autoshard.cluster.meshes import fake_world
    from autoshard.models.hf import build

    name, batch, seq, cluster = arg
    model, inputs = build(name, batch=batch, seq=seq, dropout=True)
    with fake_world(PLAN_MESH[0] * PLAN_MESH[1]):
        mesh = init_device_mesh("cpu", PLAN_MESH, mesh_dim_names=NAMES)
        t0 = time.perf_counter()
        try:
            plan = autoshard.plan(model, mesh, inputs, cluster=cluster)
        except Exception as e:  # noqa: BLE001 - a row's result
            frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
            return {
                "error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}",
                "traceback": traceback.format_exc(),
                "captured": "_capture" not in frames,
            }
        return {"plan_s": time.perf_counter() - t0, "step_s": plan.step_time_s, "status": plan.solver.status}


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole value of a (DTensor) tensor; a collective, so every rank calls it in the same order."""
    if t is None:
        return None
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().clone()


def _loss(out: Any) -> torch.Tensor:
    """The loss in a model's output: a ModelOutput's ``loss``, or the tensor a training-step module returns."""
    return out if isinstance(out, torch.Tensor) else out.loss


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss


def _steps(step: Callable[[], torch.Tensor], named: Callable[[], Any], opt: torch.optim.Optimizer) -> tuple:
    """``STEPS`` optimizer steps: each step's loss, every gradient after the first, every parameter at the end."""
    losses, grads = [], {}
    for i in range(STEPS):
        loss = step()
        if i == 0:
            grads = {n: _full(p.grad) for n, p in named()}
        opt.step()
        opt.zero_grad()
        losses.append(float(_full(loss)))
    return losses, grads, {n: _full(p.data) for n, p in named()}


def _train_case(rank: int, world: int, arg: tuple[str, int, int, str, int]) -> dict[str, Any]:
    """3 AdamW steps through ``autoshard.compile`` on this gloo rank; rank 0 then trains one device and compares."""
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard
    from autoshard.models.hf import build

    name, batch, seq, backend, seed, recipe, shape, names = arg
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model, inputs = build(name, batch=batch, seq=seq, seed=seed, dropout=False)
    t0 = time.perf_counter()
    options: dict[str, Any] = {"recipe": recipe} if recipe else {}
    if "pp" in names:
        options.update(microbatches=PP_MICROBATCHES, schedule="1F1B")
    sharded = autoshard.compile(model, mesh, inputs, backend=backend, **options)
    placements = sharded.plan.parameter_placements().values()
    split = f"{sum(any(p.startswith('S') for p in pl) for pl in placements)}/{len(placements)}"
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
    done: list[float] = []  # when the first step ended: planning, lowering and the backend's compilation

    def step() -> torch.Tensor:
        loss = sharded.step(**inputs)
        done.append(time.perf_counter())
        return loss

    losses, grads, params = _steps(step, sharded.named_parameters, opt)
    compile_s = done[0] - t0
    piped = "pp" in names
    if rank != 0 and not piped:
        return {"losses": losses}
    ref_model, _ = build(name, batch=batch, seq=seq, seed=seed, dropout=False)  # after the fork
    ref_losses, ref_grads, ref_params = _steps(
        lambda: _backward(_loss(ref_model(**inputs))),
        ref_model.named_parameters,
        torch.optim.AdamW(ref_model.parameters(), lr=LR),
    )
    everything = sorted(ref_params)
    if piped:  # each rank holds its stage's parameters
        ref_grads = {n: g for n, g in ref_grads.items() if n in params}
        ref_params = {n: p for n, p in ref_params.items() if n in params}
    compared = compare(ref_losses, ref_grads, ref_params, losses, grads, params)
    return {
        "losses": losses,
        "compile_s": compile_s,
        "split": split,
        "held": sorted(params),
        "all": everything,
        **compared,
    }


def _max_err(
    kind: str,
    want: dict[str, torch.Tensor | None],
    got: dict[str, torch.Tensor | None],
    atol: float,
    rtol: float,
    problems: list[str],
) -> float:
    if set(want) != set(got):
        problems.append(
            f"{kind} names differ: missing {sorted(set(want) - set(got))[:3]}, "
            f"unexpected {sorted(set(got) - set(want))[:3]}"
        )
    worst = 0.0
    for n in sorted(set(want) & set(got)):
        w, g = want[n], got[n]
        if w is None and g is None:
            continue
        if w is not None and g is not None and w.shape != g.shape:
            problems.append(f"{kind} {n}: shape {tuple(g.shape)} != one device's {tuple(w.shape)}")
            continue
        w = torch.zeros_like(g) if w is None else w.float()  # a missing gradient is a zero one
        g = torch.zeros_like(w) if g is None else g.float()
        diff = (g - w).abs()
        err = float(diff.max()) if diff.numel() else 0.0
        worst = max(worst, err)
        if bool((diff > atol + rtol * w.abs()).any()):
            problems.append(f"{kind} {n}: max |diff| {err:.2e} (one device's max |{kind}| {float(w.abs().max()):.2e})")
    return worst


Grads = dict[str, torch.Tensor | None]


def compare(
    ref_losses: list[float],
    ref_grads: Grads,
    ref_params: dict[str, torch.Tensor],
    losses: list[float],
    grads: Grads,
    params: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """Largest differences from the single-device run and the checks that failed (first three of each kind)."""
    problems: list[str] = []
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        if abs(a - b) > ATOL + RTOL * abs(b):
            problems.append(f"loss step {step + 1}: {a:.7g} != one device's {b:.7g}")
    grad_problems: list[str] = []
    grad_err = _max_err("grad", ref_grads, grads, ATOL, RTOL, grad_problems)
    param_problems: list[str] = []
    param_err = _max_err("param", dict(ref_params), dict(params), PARAM_ATOL, RTOL, param_problems)
    for kind, found in (("grad", grad_problems), ("param", param_problems)):
        problems += found[:3] + ([f"... {len(found) - 3} more {kind} mismatches"] if len(found) > 3 else [])
    return {"loss_err": loss_err, "grad_err": grad_err, "param_err": param_err, "problems": problems}


# ------------------------------------------------------------------------------------------------ rows and table


def check_architecture(
    name: str,
    *,
    batch: int = 8,
    seq: int = 16,
    backend: str = "inductor",
    cluster: str = "h100-sxm:8x8",
    timeout: float = 600.0,
    seed: int = 0,
    recipe: str | None = None,
) -> Row:
    """One row: plan on a fake (8, 8) world, then train on 4 gloo ranks and compare with one device."""
    from autoshard.models.hf import TINY

    spec = TINY[name]
    row = Row(name, spec.cls, spec.task)
    try:
        planned = launch(1, _plan_case, (name, batch, seq, cluster), timeout=timeout, gloo=False)[0]
    except LaunchError as e:
        row.notes.append(f"planning: {e}")
        log.warning("%s planning failed: %s\n%s", name, e, e.detail)
    else:
        row.captures = planned.get("captured", True)
        row.plans = "error" not in planned
        if row.plans:
            row.plan_s, row.predicted_step_s = planned["plan_s"], planned["step_s"]
        else:
            row.notes.append(f"{'planning' if row.captures else 'capture'}: {planned['error']}")
            log.warning("%s planning failed:\n%s", name, planned["traceback"])
    _pipeline_row(row, name, batch, seq, backend, seed, timeout)
    try:
        ranks = launch(
            4, _train_case, (name, batch, seq, backend, seed, recipe, TRAIN_MESH, NAMES), timeout=timeout, gloo=True
        )
    except LaunchError as e:
        row.notes.append(f"gloo 2x2: {e}")
        log.warning("%s gloo 2x2 failed: %s\n%s", name, e, e.detail)
        return row
    got = ranks[0]
    row.loss_err, row.grad_err, row.param_err = got["loss_err"], got["grad_err"], got["param_err"]
    row.compile_s, row.split = got["compile_s"], got["split"]
    problems = list(got["problems"])
    for r, other in enumerate(ranks[1:], start=1):
        if other["losses"] != got["losses"]:
            problems.insert(0, f"rank {r}'s losses {other['losses']} != rank 0's {got['losses']}")
    row.equal = not problems
    if row.captures is None:  # planning's child died; compile captured the model all the same
        row.captures = True
    row.notes += problems
    return row


def _pipeline_row(row: Row, name: str, batch: int, seq: int, backend: str, seed: int, timeout: float) -> None:
    """The pipeline column: 2 stages on 2 gloo ranks, 4 micro-batches, 1F1B, against one device."""
    try:
        ranks = launch(
            2, _train_case, (name, batch, seq, backend, seed, None, PP_MESH, PP_NAMES), timeout=timeout, gloo=True
        )
    except LaunchError as e:
        row.pp_equal = False
        row.notes.append(f"pp=2: {e}")
        log.warning("%s pp=2 failed: %s\n%s", name, e, e.detail)
        return
    row.pp_err = max(max(r["loss_err"], r["grad_err"], r["param_err"]) for r in ranks)
    problems = [f"rank {k}: {p}" for k, r in enumerate(ranks) for p in r["problems"]]
    orphans = sorted(set(ranks[0]["all"]) - {n for r in ranks for n in r["held"]})
    if orphans:
        problems.append(f"parameters held by no stage: {orphans[:3]}")
    row.pp_equal = not problems
    row.notes += [f"pp=2: {p}" for p in problems]


def _mark(ok: bool | None) -> str:
    return "—" if ok is None else ("yes" if ok else "**no**")


def _num(x: float | None, fmt: str, unit: str = "") -> str:
    return "—" if x is None else f"{x:{fmt}}{unit}"


def table(rows: list[Row], backend: str) -> str:
    head = (
        "| architecture | class | task | captures | plans (8×8) | plan time | predicted step | "
        f"gloo 2×2 equal ({backend}) | params split | max loss err | max grad err | max param err | "
        "compile time | pp=2 equal | pp=2 max err | note |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        note = "; ".join(r.notes).replace("|", "\\|") or "ok"
        lines.append(
            f"| {r.name} | {r.cls} | {r.task} | {_mark(r.captures)} | {_mark(r.plans)} | "
            f"{_num(r.plan_s, '.1f', ' s')} | "
            f"{_num(None if r.predicted_step_s is None else r.predicted_step_s * 1e3, '.3f', ' ms')} | "
            f"{_mark(r.equal)} | {r.split or '—'} | {_num(r.loss_err, '.1e')} | {_num(r.grad_err, '.1e')} | "
            f"{_num(r.param_err, '.1e')} | {_num(r.compile_s, '.1f', ' s')} | {_mark(r.pp_equal)} | "
            f"{_num(r.pp_err, '.1e')} | {note} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated architectures (default: all of models/hf.py's TINY)")
    p.add_argument("--backend", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--batch", type=int, default=8, help="global batch (divisible by 8 for the 8x8 plan)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--cluster", default="h100-sxm:8x8", help="cluster profile the 8x8 plan is costed for")
    p.add_argument(
        "--recipe",
        default=None,
        help="train the 2x2 run with this manual recipe (e.g. fsdp+tp) instead of the solved plan",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch before its processes are stopped")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    from autoshard.models.hf import TINY

    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(TINY)
    unknown = [n for n in names if n not in TINY]
    if unknown:
        p.error(f"unknown architectures {unknown}; known: {', '.join(TINY)}")
    if a.batch % 8:
        p.error(f"--batch {a.batch} must divide by 8 (the 8x8 plan splits it over dp)")
    t0 = time.perf_counter()
    rows = []
    for n in names:
        t = time.perf_counter()
        rows.append(
            check_architecture(
                n, batch=a.batch, seq=a.seq, backend=a.backend, cluster=a.cluster, timeout=a.timeout, recipe=a.recipe
            )
        )
        print(f"{n}: {'pass' if rows[-1].passed else 'FAIL'} ({time.perf_counter() - t:.0f} s)", flush=True)
    total = time.perf_counter() - t0
    print(
        f"\nautoshard on tiny stock transformers models (batch {a.batch} x seq {a.seq}; plan: fake 8x8 world, "
        f"{a.cluster}; train: 4 gloo ranks, 2x2, {a.backend}, {a.recipe or 'solved plan'}, {STEPS} AdamW steps "
        "vs one device)\n"
    )
    print(table(rows, a.backend))
    print(f"\n{sum(r.passed for r in rows)}/{len(rows)} pass; {total:.0f} s in all")
    if a.json:
        a.json.write_text(json.dumps([{**dataclasses.asdict(r), "passed": r.passed} for r in rows], indent=1))
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
