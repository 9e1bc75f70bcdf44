"""Test harness: many ranks in one process (LocalTensorMode) and the single-device reference runs.

Imported by test modules (``from harness import ...`` or ``from tests.harness import ...``);
it is not itself a test file. The library provides the rest: gloo ranks in forked processes are
``autoshard.testing.launch.launch`` (mind its forking pitfall: fork first, compute references afterwards),
a fake process group is ``autoshard.cluster.meshes.fake_world``, planning on one is ``autoshard.plan``
(or ``autoshard.search.recompute.plan_graph`` for the traced graph and pass context too).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map_only

from autoshard.cluster.meshes import fake_world
from autoshard.testing.bench import call_loss

if TYPE_CHECKING:
    from torch.distributed._local_tensor import LocalTensorMode

__all__ = [
    "torchrun_example",
    "local_ranks",
    "Reference",
    "single_device_reference",
    "assert_close_to_reference",
]


# --------------------------------------------------------------------------- one process, many ranks


@contextlib.contextmanager
def local_ranks(world_size: int) -> Iterator[LocalTensorMode]:
    """A fake process group plus an entered ``LocalTensorMode(world_size)``, which is yielded.

    Inside, tensors made with ``ltm.rank_map(lambda r: ...)`` hold one value per rank and
    functional collectives compute real results across the simulated ranks.
    """
    from torch.distributed._local_tensor import LocalTensorMode

    with fake_world(world_size):
        with LocalTensorMode(world_size) as ltm:
            yield ltm


def refused_at_floor(plan_at: Callable[[int], Any]) -> Any:
    """The solver's refusal at the lowest budget it weighs: ``plan_at(budget)`` plans under ``budget`` bytes per
    device; 1 byte is refused by the training state's floor before any solve (``autoshard/search/floor.py``), so it
    is called again at the floor, which only the solver (the whole batch's activations) refuses."""
    from autoshard.errors import InfeasibleBudget

    try:
        plan_at(1)
    except InfeasibleBudget as floor:
        try:
            plan_at(floor.least_bytes)
        except InfeasibleBudget as e:
            return e
        raise AssertionError(f"a plan fits the state floor {floor.least_bytes} B: nothing left to refuse") from None
    raise AssertionError("a 1-byte budget was not refused")


# --------------------------------------------------------------------------- references


@dataclass(frozen=True)
class Reference:
    """Single-device fp32 training trajectory to compare distributed runs against."""

    losses: list[float]  # loss at each step (before the optimizer step)
    grads: dict[str, Tensor]  # gradients of the FIRST step, by parameter name
    params: dict[str, Tensor]  # parameters after all steps


def single_device_reference(
    make_model: Callable[[], nn.Module],
    inputs: Any,
    steps: int = 3,
    lr: float = 1e-2,
    seed: int = 0,
    autocast: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
) -> Reference:
    """Train ``make_model()`` for ``steps`` AdamW steps on the same ``inputs`` each step (fp32 parameters; the
    forward under ``torch.autocast("cpu", autocast)`` when given, as mixed-precision users run it).

    ``param_dtype`` (FSDP2's ``MixedPrecisionPolicy(param_dtype=...)`` on one device): each step runs forward and
    backward on a copy of the model whose parameters (not buffers) are cast to it, with floating inputs cast too;
    its gradients, cast to fp32, are the fp32 masters' the optimizer steps.

    ``torch.manual_seed(seed)`` is applied before ``make_model()`` inside a forked RNG state,
    so two calls agree and the caller's RNG is untouched.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make_model().float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses: list[float] = []
    grads: dict[str, Tensor] = {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if param_dtype is not None:
            loss = _low_precision_step(model, inputs, param_dtype)
        else:
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = call_loss(model, inputs)
            loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return Reference(losses=losses, grads=grads, params=params)


def _low_precision_step(model: nn.Module, inputs: Any, dtype: torch.dtype) -> Tensor:
    """Forward and backward on a copy of ``model`` with its floating parameters in ``dtype``; the copy's
    gradients land on ``model``'s parameters in fp32. Returns the loss."""
    low = copy.deepcopy(model)
    for p in low.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    cast = tree_map_only(Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, inputs)
    loss = call_loss(low, cast)
    loss.backward()
    masters = dict(model.named_parameters())
    for name, p in low.named_parameters():
        if p.grad is not None:
            masters[name].grad = p.grad.float()
    return loss


def _plain(t: Any) -> Tensor:
    full = getattr(t, "full_tensor", None)  # DTensor -> global tensor (collective on gloo)
    if callable(full):
        t = full()
    return torch.as_tensor(t).detach().to("cpu", torch.float32)


def _noise_hint(grad: Tensor | None) -> str:
    if grad is None:
        return ""
    gmax = _plain(grad).abs().max().item()
    if gmax < 1e-8:  # below AdamW's eps: the update direction is pure rounding noise
        return (
            f"; its reference gradient is ~0 (max {gmax:.1e}) so AdamW turns rounding noise into "
            "lr-sized steps (e.g. attention key biases): use bias=False or compare grads instead"
        )
    return ""


def _compare(
    kind: str,
    want: dict[str, Tensor],
    got: dict[str, Tensor],
    rtol: float,
    atol: float,
    ref_grads: dict[str, Tensor] | None = None,
) -> list[str]:
    problems: list[str] = []
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing:
        problems.append(f"{kind}: missing {missing}")
    if extra:
        problems.append(f"{kind}: unexpected {extra}")
    for name in sorted(set(want) & set(got)):
        w, g = _plain(want[name]), _plain(got[name])
        if w.shape != g.shape:
            problems.append(f"{kind} {name}: shape {tuple(g.shape)} != reference {tuple(w.shape)}")
            continue
        if not torch.allclose(g, w, rtol=rtol, atol=atol):
            diff = (g - w).abs()
            problems.append(
                f"{kind} {name}: max abs diff {diff.max().item():.3e} "
                f"(reference max abs {w.abs().max().item():.3e}, {int((diff > atol + rtol * w.abs()).sum())}"
                f"/{w.numel()} elements off)" + _noise_hint((ref_grads or {}).get(name))
            )
    return problems


def assert_close_to_reference(
    ref: Reference,
    losses: Sequence[float] | Tensor,
    grads: dict[str, Tensor],
    params: dict[str, Tensor],
    rtol: float = 1e-4,
    atol: float = 1e-5,
    param_atol: float | None = None,
) -> None:
    """Assert a distributed run matches ``ref``; the message lists every mismatch by name.

    ``param_atol`` (default ``atol``) is the absolute tolerance for parameters after the optimizer steps.

    ``losses`` / ``grads`` / ``params`` are what the run under test produced (DTensors are
    gathered with ``full_tensor()``). Beware parameters whose true gradient is zero, such
    as the key-projection bias of attention (softmax is invariant to it): AdamW normalises
    their rounding-noise gradients into lr-sized updates, so their values after a step
    differ between any two summation orders. Use ``GPTConfig(bias=False)`` for
    trajectory comparisons; the failure message flags such parameters.
    """
    problems: list[str] = []
    got_losses = [float(x) for x in losses]
    if len(got_losses) != len(ref.losses):
        problems.append(f"losses: {len(got_losses)} steps, reference has {len(ref.losses)}")
    for i, (g, w) in enumerate(zip(got_losses, ref.losses)):
        if not math.isclose(g, w, rel_tol=rtol, abs_tol=atol):
            problems.append(f"loss step {i}: {g:.8g} != reference {w:.8g} (abs diff {abs(g - w):.3e})")
    problems += _compare("grad", ref.grads, grads, rtol, atol)
    problems += _compare(
        "param", ref.params, params, rtol, atol if param_atol is None else param_atol, ref_grads=ref.grads
    )
    if problems:
        shown = "\n  ".join(problems[:40])
        more = f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else ""
        raise AssertionError(f"{len(problems)} mismatch(es) against the single-device reference:\n  {shown}{more}")


# --------------------------------------------------------------------------- two at a time


def selected_cases(request: Any, test_name: str, param: str) -> list[Any]:
    """The values of ``param`` of ``test_name``'s items in the calling module that this session runs (``-k`` aware)."""
    return [
        item.callspec.params[param]
        for item in request.session.items
        if item.module is request.module and item.originalname == test_name
    ]


def _run_share(rank: int, world: int, arg: tuple) -> dict:
    import traceback

    run, shares = arg
    if world > 1:
        torch.set_num_threads(1)  # a forked child per core
    out = {}
    for case in shares[rank]:
        try:
            out[case] = {"result": run(case)}
        except Exception:  # noqa: BLE001 - reported by the case's own test
            out[case] = {"error": traceback.format_exc()}
    return out


def run_two_at_a_time(
    run: Callable[[Any], Any], cases: Sequence[Any], cost: dict[Any, float] | None = None, timeout: float = 900.0
) -> dict[Any, dict]:
    """``run(case)`` for every case, in two forked processes (no process group: ``launch(gloo=False)``), each
    child at one thread: for single-threaded work (planning, LocalTensorMode's simulated ranks) on a 2-core
    machine. Cases go longest first (by ``cost``, seconds; 1 where not given) to the child with less work so far.
    Returns ``{case: {"result": ...}}`` or ``{case: {"error": traceback}}``; :func:`case_result` turns the latter
    into the case's test failure. ``run`` must be a module-level function and its results plain
    (``torch.save``-able)."""
    from autoshard.testing.launch import launch

    cases = sorted(dict.fromkeys(cases), key=lambda c: -(cost or {}).get(c, 1.0))
    if len(cases) < 2:
        return _run_share(0, 1, (run, [cases])) if cases else {}
    shares: list[list[Any]] = [[], []]
    load = [0.0, 0.0]
    for case in cases:
        i = 0 if load[0] <= load[1] else 1
        shares[i].append(case)
        load[i] += (cost or {}).get(case, 1.0)
    out: dict[Any, dict] = {}
    for part in launch(2, _run_share, (run, shares), gloo=False, timeout=timeout):
        out.update(part)
    return out


def case_result(results: dict[Any, dict], case: Any) -> Any:
    """The case's result, or its test fails with the traceback its forked run raised."""
    import pytest

    r = results[case]
    if "error" in r:
        pytest.fail(f"{case!r} raised in its forked run:\n{r['error']}")
    return r["result"]


# --------------------------------------------------------------------------- examples under torchrun

STEP_LINE = re.compile(r"^step +(\d+) +loss +(\S+) +tokens/s +(\S+) +step time +(\S+) ms", re.M)


def torchrun_example(
    script: Any, nproc: int, args: Sequence[str], timeout: float = 240
) -> tuple[str, str, dict[int, float]]:
    """Run an example under torchrun on CPU (one thread per rank); returns (stdout + stderr, stdout, rank 0's loss
    per step from its ``step N loss L tokens/s ... step time ... ms`` lines). A failed launch fails the test."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(script),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # its own session: on a timeout the ranks are killed with torchrun (else they linger, holding their cores)
    proc = subprocess.Popen(
        cmd,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{' '.join(cmd[3:])} ran past {timeout} s:\n{(stdout + stderr)[-6000:]}") from None
    out = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"{' '.join(cmd[3:])} exited {out.returncode}:\n{text[-6000:]}"
    losses: dict[int, float] = {}
    for m in STEP_LINE.finditer(out.stdout):
        step = int(m.group(1))
        assert step not in losses, f"step {step} reported twice:\n{out.stdout[-3000:]}"
        losses[step] = float(m.group(2))
    return text, out.stdout, losses
