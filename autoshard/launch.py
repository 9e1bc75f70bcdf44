"""Running a function on several forked processes, optionally joined into one gloo process group.

For scripts that must survive a rank that raises, dies or hangs (benchmarks that report a table row per
case): ``launch(world, fn, arg)`` forks ``world`` children, each runs ``fn(rank, world, arg)``, and the results
come back in rank order. The first failure stops the other ranks (they would wait in a collective) and is
raised as ``LaunchError`` with one line of message and the child's traceback in ``detail``; past ``timeout``
seconds every child is stopped. Fork first, compute afterwards: the parent should do no OpenMP-heavy torch work
before launching.
"""

from __future__ import annotations

import datetime
import multiprocessing
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class LaunchError(RuntimeError):
    """A child process raised, died or timed out; the message is one line, ``detail`` the full traceback."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


def _child(rank: int, world: int, fn: Callable[[int, int, Any], Any], arg: Any, tmpdir: str, timeout: float,
           gloo: bool) -> None:
    import torch.distributed as dist

    if gloo:
        torch.set_num_threads(1)  # 4 ranks on a few cores; ATen runs its parallel loops inline
    code = 0
    try:
        if gloo:
            dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(f"{tmpdir}/store", world),
                                    timeout=datetime.timedelta(seconds=timeout))
        torch.save(fn(rank, world, arg), f"{tmpdir}/result{rank}.pt")
    except BaseException as e:  # noqa: BLE001 - reported to the parent through the file
        first = (str(e).strip().splitlines() or [""])[0]
        Path(tmpdir, f"error{rank}.txt").write_text(f"{time.time_ns()}\n{type(e).__name__}: {first}\n"
                                                    f"{traceback.format_exc()}")
        code = 1
    finally:
        if gloo and dist.is_initialized():
            dist.destroy_process_group()
    if code:
        sys.exit(code)  # the parent sees the failure in the exit code and stops the other ranks


def launch(world: int, fn: Callable[[int, int, Any], Any], arg: Any, *, timeout: float, gloo: bool) -> list[Any]:
    """``fn(rank, world, arg)`` on ``world`` forked processes (joined into one gloo group when ``gloo``); their
    results in rank order. The first failure stops the other ranks; past ``timeout`` seconds all are stopped."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="autoshard_hf_compat_") as tmpdir:
        procs = [ctx.Process(target=_child, args=(r, world, fn, arg, tmpdir, timeout, gloo)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        errors = sorted(Path(tmpdir).glob("error*.txt"), key=lambda f: int(f.read_text().split("\n", 1)[0]))
        if errors:  # the earliest is the cause; peers then fail in a collective
            _, summary, rest = errors[0].read_text().split("\n", 2)
            raise LaunchError(f"rank {errors[0].stem[5:]}: {summary}", rest)
        if hung and time.monotonic() >= deadline:
            raise LaunchError(f"timed out after {timeout:.0f} s (ranks {hung} still running, stopped)")
        if any(p.exitcode != 0 for p in procs):
            raise LaunchError(f"a child died without a Python exception: exit codes {[p.exitcode for p in procs]}")
        return [torch.load(f"{tmpdir}/result{r}.pt", weights_only=False) for r in range(world)]


__all__ = ["LaunchError", "launch"]
