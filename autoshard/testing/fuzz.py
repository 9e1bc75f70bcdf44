"""A model fuzzer: random small training programs, planned and run on a simulated mesh, compared with one device.

The cases (``autoshard/testing/fuzz_cases.py``) are drawn from ``(seed, index)``, their models and inputs built
from the case alone (``autoshard/testing/fuzz_model.py``). :func:`run_case` trains the model on one device (fp32,
:data:`STEPS` AdamW steps, the same seeded init, ``torch.manual_seed`` before every step so that dropout and
sampled routers draw the same numbers on both sides), then compiles it with ``autoshard.compile`` under
``LocalTensorMode`` (every rank in this process, a fake process group) and trains the same steps; it compares the
loss of every step, every first-step gradient and the final parameters, and returns a :class:`FuzzResult`:
``ok``; ``refused`` (planning raised an ``autoshard`` error that says what it refused: acceptable); or a failure:
``crash-reference`` (the fuzzer's own model failed on one device), ``crash-planning``, ``crash-running`` (a
Python error, or an ``autoshard`` error once the program was compiled) or ``mismatch`` (a wrong loss, gradient or
parameter, or ranks that disagree).

Rounding noise: the first-step gradients are also computed in float64 (:func:`rounding_noise`); a gradient whose
fp32 value is mostly rounding (a parameter whose gradient is zero in exact arithmetic, e.g. a bias that a
following normalization removes) is compared at the size of that rounding, and its parameter, which AdamW moves
by up to ``lr`` a step whatever the sign of the noise, at ``lr`` per step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from autoshard import _torch_compat as tc
from autoshard.cluster.meshes import fake_world, mesh_names
from autoshard.errors import AutoshardError
from autoshard.testing.fuzz_cases import RANDOM_BLOCKS, FuzzCase
from autoshard.testing.fuzz_model import build_model, example_inputs

logger = logging.getLogger(__name__)

STEPS = 3
LR = 1e-3
# as tests/harness.assert_close_to_reference compares: loss and gradients at 1e-4 relative / 1e-5 absolute, the
# parameters after AdamW at lr / 5 absolute (AdamW turns last-bit differences of near-zero gradients into steps)
RTOL, ATOL, PARAM_ATOL = 1e-4, 1e-5, 2e-4
STEP_SEED = 1234  # torch.manual_seed(STEP_SEED + step) before every step, on one device and on the mesh
# a gradient whose fp32 rounding (its distance from float64) is over this fraction of its size is rounding noise
NOISY = 1e-3


@dataclass(frozen=True)
class FuzzResult:
    """What :func:`run_case` found: ``kind`` is "ok", "refused", "crash-planning", "crash-running" or "mismatch";
    ``message`` one line; ``detail`` the traceback or every mismatch."""

    seed: int
    index: int
    kind: str
    message: str
    seconds: float
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.kind not in ("ok", "refused")


def compile_options(case: FuzzCase) -> dict[str, Any]:
    """The keyword arguments ``autoshard.compile`` gets for the case."""
    from torch.distributed.tensor import Shard

    opts: dict[str, Any] = {"random": "exact"}  # (one device's random numbers: compared with one device)
    if case.recipe:
        opts["recipe"] = case.recipe
    if case.constraint:
        opts["constraints"] = {"inputs": {mesh_names(case.mesh)[0]: Shard(0 if case.constraint == "batch" else 1)}}
    if case.budget:
        state = sum(p.numel() for p in build_model(case).parameters()) * 16  # fp32 param, grad, 2 AdamW moments
        opts["memory_budget"] = max(1, int(case.budget * state))
    if case.cluster:
        opts["cluster"] = case.cluster
    if case.autotune:
        opts["autotune"] = case.autotune
    return opts


# ----------------------------------------------------------------------------------------------------- running


@dataclass(frozen=True)
class Trajectory:
    """A training run's loss per step, first-step gradients and final parameters (plain fp32 tensors); for the
    reference, ``noise``: each first-step gradient's fp32 rounding (the max abs distance from its float64 value;
    empty where not known, see :func:`rounding_noise`)."""

    losses: tuple[float, ...]
    grads: dict[str, Tensor]
    params: dict[str, Tensor]
    noise: dict[str, float] = field(default_factory=dict)
    loss_noise: float = 0.0  # the reference's first loss off its float64 value (an ill-conditioned model's is large)


class RanksDisagree(AssertionError):
    """The simulated ranks hold different values of what must be one value (the loss, a gathered tensor)."""


def _one_value(t: Tensor, what: str) -> Tensor:
    """``t`` gathered whole (a DTensor's ``full_tensor``) as one plain tensor, checked equal on every rank."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    full = tc.waited(full)
    per_rank = tc.rank_values(full)
    if per_rank is None:
        return full.detach().to(torch.float32).clone()
    with tc.outside_local_tensor_mode():
        first, *rest = [per_rank[r].detach().to(torch.float32).clone() for r in sorted(per_rank)]
        if any(not torch.equal(first, r) for r in rest):
            raise RanksDisagree(f"the ranks disagree on {what}")
        return first


def train(model: nn.Module, inputs: tuple[Tensor, ...], step: Callable[..., Tensor] | None = None) -> Trajectory:
    """:data:`STEPS` AdamW steps on the same ``inputs``; ``step(*inputs)`` (a compiled module's) runs forward and
    backward and returns the loss, default ``model(*inputs).backward()``. ``torch.manual_seed(STEP_SEED + i)``
    before step ``i`` (the caller's generator state is restored after)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for i in range(STEPS):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(STEP_SEED + i)
            if step is None:
                loss = model(*inputs)
                loss.backward()
            else:
                loss = step(*inputs)
        losses.append(float(_one_value(loss.detach(), f"the loss of step {i}")))
        if i == 0:
            grads = {
                n: _one_value(p.grad, f"{n}'s gradient") for n, p in model.named_parameters() if p.grad is not None
            }
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: _one_value(p.detach(), f"{n} after training") for n, p in model.named_parameters()}
    return Trajectory(tuple(losses), grads, params)


def rounding_noise(case: FuzzCase, inputs: tuple[Tensor, ...], ref: Trajectory) -> tuple[dict[str, float], float]:
    """The fp32 rounding of each of ``ref``'s first-step gradients (its max abs distance from the same step in
    float64: same init, inputs and seed) and of its first loss. Empty (and 0) when the step cannot run in float64,
    or when the model draws random numbers and the float64 step's loss is not ``ref``'s first (it drew others: a
    float64 ``rand_like`` draws other numbers). Without random blocks the float64 step is the exact one however far
    the fp32 loss is from it (a normalization over one element amplifies rounding: seed 7002 case 169)."""
    try:
        model = build_model(case).double().train()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(STEP_SEED)
            loss = model(*(t.double() if t.is_floating_point() else t for t in inputs))
            loss.backward()
    except (RuntimeError, TypeError) as e:
        logger.info(
            "fuzz case %d/%d: no float64 step (%s): gradients compared at fixed tolerances", case.seed, case.index, e
        )
        return {}, 0.0
    draws = any(b.kind in RANDOM_BLOCKS for b in case.blocks)
    if draws and not math.isclose(loss.item(), ref.losses[0], rel_tol=1e-4, abs_tol=ATOL):
        return {}, 0.0
    return (
        {
            n: (p.grad - ref.grads[n].double()).abs().max().item()
            for n, p in model.named_parameters()
            if p.grad is not None and n in ref.grads
        },
        abs(loss.item() - ref.losses[0]),
    )


def _atol(what: str, name: str, ref: Trajectory, atol: float) -> float | Tensor:
    """A gradient is compared at twice the reference's fp32 rounding on either side when that is over ``atol``.
    A parameter whose reference gradient is rounding noise (below 1e-6, or off its float64 value by over
    :data:`NOISY` of its size: a bias that the next normalization removes) steps by that noise, up to lr per step
    in either direction, in any two summation orders: it is held to that bound; so is each element of a parameter
    whose gradient element is within 10 roundings (or 1e-6) of 0, which AdamW near its eps steps by its noise."""
    grad, noise = ref.grads.get(name), ref.noise.get(name, 0.0)
    if what == "grad":
        return max(atol, 4 * noise)
    if grad is None:
        return atol
    if grad.abs().max().item() < 1e-6 or noise > NOISY * grad.abs().max().item():
        return 2 * LR * STEPS
    return torch.where(grad.abs() < max(1e-6, 10 * noise), 2 * LR * STEPS, atol)


def compare(ref: Trajectory, got: Trajectory) -> list[str]:
    """Every difference of ``got`` from ``ref`` beyond the tolerances, one line each (empty: equal)."""
    problems = [
        f"loss step {i}: {g:.8g} != reference {w:.8g}"
        for i, (g, w) in enumerate(zip(got.losses, ref.losses))
        if not math.isclose(g, w, rel_tol=RTOL, abs_tol=max(ATOL, 4 * ref.loss_noise))
    ]
    for what, want, have, atol in (("grad", ref.grads, got.grads, ATOL), ("param", ref.params, got.params, PARAM_ATOL)):
        if set(want) != set(have):
            problems.append(
                f"{what}s: missing {sorted(set(want) - set(have))}, unexpected {sorted(set(have) - set(want))}"
            )
        for name in sorted(set(want) & set(have)):
            w, g = want[name], have[name]
            if w.shape != g.shape:
                problems.append(f"{what} {name}: shape {tuple(g.shape)} != reference {tuple(w.shape)}")
            elif not bool(((g - w).abs() <= _atol(what, name, ref, atol) + RTOL * w.abs()).all()):
                problems.append(
                    f"{what} {name}: max abs diff {(g - w).abs().max().item():.3e} "
                    f"(reference max abs {w.abs().max().item():.3e})"
                )
    return problems


def _accumulated(model: nn.Module, accumulation: Any) -> Callable[..., Tensor]:
    """One device's step as the same micro-batches, each loss weighted as ``ShardedModule.step`` weights it."""

    def step(*inputs: Tensor) -> Tensor:
        micro = accumulation.split([f"input[{i}]" for i in range(len(inputs))], list(inputs))
        total = torch.zeros(())
        for piece, weight in zip(micro, accumulation.weights(micro)):
            loss = model(*piece) * weight
            loss.backward()
            total = total + loss.detach()
        return total

    return step


def _sharded_run(case: FuzzCase, inputs: tuple[Tensor, ...], stage: list[str]) -> tuple[Trajectory, Any]:
    import os
    import tempfile
    from unittest import mock

    from torch.distributed.device_mesh import init_device_mesh

    import autoshard
    from autoshard.cluster.machine import CACHE_ENV

    model = build_model(case)
    with (
        tempfile.TemporaryDirectory() as cache,
        mock.patch.dict(os.environ, {CACHE_ENV: cache}),
        fake_world(math.prod(case.mesh)),
        tc.simulated_ranks(math.prod(case.mesh)),
    ):  # (autotune's cache: fresh)
        mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=mesh_names(case.mesh))
        sharded = autoshard.compile(model, mesh, inputs, **compile_options(case))
        stage[0] = "running"
        return train(sharded, inputs, sharded.step), getattr(sharded, "_accumulation", None)


def _line(text: str) -> str:
    return " ".join(text.split())[:300]


def run_case(case: FuzzCase) -> FuzzResult:
    """Train ``case``'s model on one device and on its simulated mesh, and say how they compare (never raises
    for what the case's model or compile does: a crash is a result)."""
    start = time.perf_counter()
    inputs = example_inputs(case)
    stage = ["reference"]

    def result(kind: str, message: str, detail: str = "") -> FuzzResult:
        out = FuzzResult(case.seed, case.index, kind, _line(message), time.perf_counter() - start, detail)
        logger.info("fuzz case %d/%d: %s %s", case.seed, case.index, kind, out.message)
        return out

    try:
        ref = train(build_model(case), inputs)
        noise, loss_noise = rounding_noise(case, inputs, ref)
        ref = dataclasses.replace(ref, noise=noise, loss_noise=loss_noise)
        stage[0] = "planning"
        got, accumulation = _sharded_run(case, inputs, stage)
        if accumulation is not None and any(b.kind in RANDOM_BLOCKS for b in case.blocks):
            # micro-batches draw their own (smaller) random tensors: one device accumulating the same micro-batches
            # draws the same (docs/guide/api.md, "Random numbers")
            model = build_model(case)
            ref = dataclasses.replace(
                train(model, inputs, _accumulated(model, accumulation)), noise=ref.noise, loss_noise=ref.loss_noise
            )
    except RanksDisagree as e:
        return result("mismatch", str(e), traceback.format_exc())
    except AutoshardError as e:
        if stage[0] == "planning" and str(e).strip():
            return result("refused", f"{type(e).__name__}: {e}", f"{type(e).__name__}: {e}")  # (whole, in detail)
        return result(f"crash-{stage[0]}", f"{type(e).__name__}: {e}", traceback.format_exc())
    except Exception as e:  # noqa: BLE001 - a crash is what the fuzzer reports
        return result(f"crash-{stage[0]}", f"{type(e).__name__}: {e}", traceback.format_exc())
    problems = compare(ref, got)
    if problems:
        return result("mismatch", f"{len(problems)} mismatch(es): {problems[0]}", "\n".join(problems))
    return result("ok", "")


__all__ = [
    "FuzzResult",
    "RanksDisagree",
    "Trajectory",
    "compare",
    "compile_options",
    "rounding_noise",
    "run_case",
    "train",
]
