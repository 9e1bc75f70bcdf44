"""Running a function on several forked processes, by default joined into one gloo process group.

``launch(world, fn, arg)`` forks ``world`` children; each runs ``fn(rank, world, arg)`` and its result (tensors
and nested containers are fine: ``torch.save``d; return plain tensors, not DTensors) comes back in rank order.
With ``gloo=True`` (the default) every child first sets ``torch.set_num_threads(1)`` and joins a gloo group
through a ``FileStore`` in a fresh temporary directory; the test suite's multi-rank tests and the benchmarks
that report a table row per case both launch this way.

Failures are reported, not waited on. The first failure stops the other ranks (they would wait in a
collective) and is raised as :class:`LaunchError`: its message is one line (the rank, the exception's type and
first line), ``detail`` the child's traceback followed by the first lines of the other ranks' later errors (a
peer's "Connection closed" after the cause), ``rank`` the failing rank; the error is raised ``from`` an
exception whose text is ``detail``, so a test's failure report shows the child's traceback. A rank that dies
without a Python exception (a native abort, a signal) is named as the cause when it died first. Past
``timeout`` seconds every child is stopped (``timeout`` is also the gloo group's collective timeout).

Forking pitfall: do no OpenMP-heavy torch work (large matmuls, training) in the parent before launching
unless its thread count is 1 too: libgomp's thread pool does not survive ``fork``. Fork first, compute
references afterwards (or inside a child). ``fn`` should be a module-level function.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from autoshard.errors import InputError, LaunchError, UsageError


class ChildTraceback(Exception):
    """The failing child's traceback text: the ``__cause__`` of a :class:`LaunchError`, shown in reports."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]) if self.args else ""


def _child(
    rank: int, world: int, fn: Callable[[int, int, Any], Any], arg: Any, tmpdir: str, timeout: float, gloo: bool
) -> None:
    import torch.distributed as dist

    if gloo:
        torch.set_num_threads(1)  # 4 ranks on a few cores; ATen runs its parallel loops inline
    # a native abort (SIGABRT, SIGSEGV) leaves no Python exception: every thread's Python stack goes to this file
    fault = open(f"{tmpdir}/fault{rank}.txt", "w")  # noqa: SIM115 - open until the process exits
    faulthandler.enable(fault, all_threads=True)
    code = 0
    try:
        if gloo:
            dist.init_process_group(
                "gloo",
                rank=rank,
                world_size=world,
                store=dist.FileStore(f"{tmpdir}/store", world),
                timeout=datetime.timedelta(seconds=timeout),
            )
        torch.save(fn(rank, world, arg), f"{tmpdir}/result{rank}.pt")
    except BaseException as e:  # noqa: BLE001 - reported to the parent through the file
        first = (str(e).strip().splitlines() or [""])[0]
        part = Path(tmpdir, f"partial{rank}.tmp")  # renamed whole: the parent never reads half a file
        part.write_text(f"{time.time_ns()}\n{type(e).__name__}: {first}\n{traceback.format_exc()}")
        part.rename(Path(tmpdir, f"error{rank}.txt"))
        code = 1
    finally:
        if gloo and dist.is_initialized():
            dist.destroy_process_group()
    if code:
        sys.exit(code)  # the parent sees the failure in the exit code and stops the other ranks


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _errors(tmpdir: str) -> list[tuple[int, int, str, str]]:
    """(time_ns, rank, one-line summary, traceback) of every child that wrote an error, earliest first."""
    found = []
    for f in Path(tmpdir).glob("error*.txt"):
        stamp, summary, text = (f.read_text().split("\n", 2) + ["", ""])[:3]
        found.append((int(stamp), int(f.stem[5:]), summary, text))
    return sorted(found)


def _stacks(tmpdir: str, rank: int) -> list[str]:
    """The Python stacks ``faulthandler`` wrote when ``rank`` died natively, as lines (none if it wrote none)."""
    f = Path(tmpdir, f"fault{rank}.txt")
    text = f.read_text().strip() if f.exists() else ""
    return [f"rank {rank}'s Python stacks when it died:", text] if text else []


def _failure(
    tmpdir: str, first: dict[int, int], codes: list[int | None], hung: list[int], timed_out: bool, timeout: float
) -> LaunchError | None:
    """The error to raise, if any: a child that died without a Python exception before any was stopped, else the
    earliest Python error, else the time-out, else any non-zero exit."""
    errors = _errors(tmpdir)
    wrote = {rank for _, rank, _, _ in errors}
    later = [f"(later: rank {rank}: {summary})" for _, rank, summary, _ in errors]
    native = [r for r in sorted(first) if r not in wrote]
    if native:
        r = native[0]
        return LaunchError(
            f"rank {r}: died without a Python exception ({_how(first[r])}); exit codes {codes}",
            "\n".join([*_stacks(tmpdir, r), *later]),
            rank=r,
        )
    if errors:  # the earliest is the cause; peers then fail in a collective
        _, rank, summary, text = errors[0]
        return LaunchError(f"rank {rank}: {summary}", "\n".join([text.rstrip(), *later[1:]]), rank=rank)
    if hung and timed_out:
        return LaunchError(f"timed out after {timeout:.0f} s (ranks {hung} still running, stopped)")
    bad = [r for r, c in enumerate(codes) if c != 0]
    if bad:
        return LaunchError(
            f"rank {bad[0]}: died without a Python exception ({_how(codes[bad[0]])}); exit codes {codes}",
            "\n".join(_stacks(tmpdir, bad[0])),
            rank=bad[0],
        )
    return None


def launch(
    world: int, fn: Callable[[int, int, Any], Any], arg: Any = None, *, timeout: float = 300.0, gloo: bool = True
) -> list[Any]:
    """``fn(rank, world, arg)`` on ``world`` forked processes (joined into one gloo group when ``gloo``); their
    results in rank order. The first failure stops the other ranks and is raised as :class:`LaunchError`; past
    ``timeout`` seconds all are stopped. See the module docstring."""
    if world < 1:
        raise InputError(f"world must be >= 1, got {world}")
    if gloo:
        import torch.distributed as dist

        if dist.is_initialized():
            raise UsageError(
                "launch forks gloo ranks: this process has a default process group (a fake world?); "
                "destroy it first, or launch outside it"
            )
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="autoshard_launch_") as tmpdir:
        procs = [ctx.Process(target=_child, args=(r, world, fn, arg, tmpdir, timeout, gloo)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        first: dict[int, int] = {}  # rank -> exit code of the children found failed before any was stopped
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            first = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if first:
                break
            time.sleep(0.05)
        else:
            first = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
        timed_out = time.monotonic() >= deadline
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        error = _failure(tmpdir, first, [p.exitcode for p in procs], hung, timed_out and not first, timeout)
        if error is not None:
            raise error from (ChildTraceback(error.detail) if error.detail else None)
        return [torch.load(f"{tmpdir}/result{r}.pt", weights_only=False) for r in range(world)]


__all__ = ["ChildTraceback", "launch"]
