"""Test harness: many ranks on CPU (gloo processes, LocalTensorMode, fake PG) and references.

Imported by test modules (``from harness import ...`` or ``from tests.harness import ...``);
it is not itself a test file.

Forking pitfall: :func:`run_gloo` forks. Do no OpenMP-heavy torch work (large matmuls,
model training) in the parent *before* forking unless thread count is 1 there too: libgomp's
thread pool does not survive ``fork``. Workers call ``torch.set_num_threads(1)`` first thing,
which makes ATen run its parallel loops inline, but the safest order is still
"fork first, compute references afterwards" (or compute them inside a worker).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from autoshard import _torch_compat as tc

if TYPE_CHECKING:
    from torch.distributed._local_tensor import LocalTensorMode

__all__ = [
    "WorkerError",
    "run_gloo",
    "local_ranks",
    "fake_world",
    "Reference",
    "single_device_reference",
    "call_loss",
    "assert_close_to_reference",
]



class WorkerError(RuntimeError):
    """A gloo worker raised; the message carries its rank and full traceback text."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


# --------------------------------------------------------------------------- gloo processes


def _worker(
    rank: int, world_size: int, fn: Callable[[int, int, Any], Any], arg: Any, tmpdir: str, timeout: float
) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            store=store,
            timeout=datetime.timedelta(seconds=timeout),
        )
        result = fn(rank, world_size, arg)
        torch.save(result, os.path.join(tmpdir, f"result_{rank}.pt"))
    except BaseException as e:
        text = f"rank {rank} failed with {type(e).__name__}: {e}\n{traceback.format_exc()}"
        with open(os.path.join(tmpdir, f"error_{rank}.txt"), "w") as f:
            f.write(f"{time.time_ns()}\n{text}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_errors(tmpdir: str, world_size: int) -> list[tuple[int, int, str]]:
    """(time_ns, rank, text) of every worker that wrote an error, earliest first."""
    found = []
    for r in range(world_size):
        path = os.path.join(tmpdir, f"error_{r}.txt")
        if os.path.exists(path):
            with open(path) as f:
                stamp, _, text = f.read().partition("\n")
            found.append((int(stamp), r, text))
    return sorted(found)


def run_gloo(
    world_size: int, fn: Callable[[int, int, Any], Any], arg: Any = None, timeout: float = 300
) -> list[Any]:
    """Run ``fn(rank, world_size, arg)`` on ``world_size`` forked gloo ranks; return their results.

    Each worker sets ``torch.set_num_threads(1)``, joins a gloo process group through a
    ``FileStore`` in a fresh temporary directory, runs ``fn`` and ``torch.save``s its result
    (tensors and nested containers are fine; return plain tensors, not DTensors). Results come
    back as ``[rank0, rank1, ...]``. If any worker raises, the others are terminated and a
    :class:`WorkerError` naming the rank with the worker's traceback text is raised (the
    earliest failure: peers' follow-on collective errors are only listed after it). ``fn``
    should be a module-level function. See the module docstring about forking.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if dist.is_initialized():
        raise RuntimeError("run_gloo forks workers: destroy the parent's process group first")
    tmpdir = tempfile.mkdtemp(prefix="autoshard_gloo_")
    try:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, fn, arg, tmpdir, timeout),
            nprocs=world_size,
            join=False,
            start_method="fork",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.terminate()
                    for p in ctx.processes:
                        p.join(5)
                    raise TimeoutError(f"run_gloo: {world_size} workers did not finish in {timeout} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            errors = _worker_errors(tmpdir, world_size)
            if not errors:
                idx = getattr(e, "error_index", -1)
                raise WorkerError(idx, f"rank {idx}: gloo worker died without a Python exception: {e}") from e
            # The earliest error is the root cause; peers typically fail afterwards in a
            # collective ("Connection closed by peer") or are terminated.
            _, rank, text = errors[0]
            also = "".join(
                f"\n(later: {t.splitlines()[0] if t else ''})" for _, _, t in errors[1:]
            )
            raise WorkerError(rank, text + also) from None
        results = []
        for r in range(world_size):
            path = os.path.join(tmpdir, f"result_{r}.pt")
            results.append(torch.load(path, weights_only=False))
        return results
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


# --------------------------------------------------------------------------- one process, many ranks


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A ``fake`` default process group of ``world_size`` ranks (this process is rank 0).

    For planning tests: DeviceMesh construction and collective *shapes* work, nothing is
    communicated. Build meshes outside ``FakeTensorMode``. Destroyed on exit.
    """
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists; nested worlds are not supported")
    tc.fake_process_group(world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        tc.clear_dtensor_caches()


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


# --------------------------------------------------------------------------- references


@dataclass(frozen=True)
class Reference:
    """Single-device fp32 training trajectory to compare distributed runs against."""

    losses: list[float]  # loss at each step (before the optimizer step)
    grads: dict[str, Tensor]  # gradients of the FIRST step, by parameter name
    params: dict[str, Tensor]  # parameters after all steps


def call_loss(model: Any, inputs: Any) -> Tensor:
    """The loss of ``model`` called with positional ``inputs`` (a tuple) or keyword ``inputs`` (a dict); a
    ModelOutput's ``loss`` when the model returns one."""
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return out if isinstance(out, Tensor) else out.loss


def single_device_reference(
    make_model: Callable[[], nn.Module],
    inputs: Any,
    steps: int = 3,
    lr: float = 1e-2,
    seed: int = 0,
) -> Reference:
    """Train ``make_model()`` for ``steps`` AdamW steps on the same ``inputs`` each step (fp32).

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
        loss = call_loss(model, inputs)
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return Reference(losses=losses, grads=grads, params=params)


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
    problems += _compare("param", ref.params, params, rtol, atol if param_atol is None else param_atol, ref_grads=ref.grads)
    if problems:
        shown = "\n  ".join(problems[:40])
        more = f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else ""
        raise AssertionError(f"{len(problems)} mismatch(es) against the single-device reference:\n  {shown}{more}")
