"""The single-device benchmark (benchmarks/gpu_single.py): on CPU its code path (a smoke run, always), on CUDA the
Triton path (skipped where CUDA is absent). Run as subprocesses: the benchmark owns its process group and
thread settings, which must not leak into this process (later tests fork gloo workers). The CPU run is started in
the background when the session begins (tests/conftest.py) and runs while other tests do: it is mostly one busy
process on a 2-core machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu_single.py")


CPU_ARGS = ("--device", "cpu", "--size", "tiny", "--steps", "2", "--warmup", "1", "--dtype", "float32")
_started: dict[tuple[str, ...], tuple[subprocess.Popen, object, object]] = {}


def _start(*args: str) -> None:
    """Start the benchmark in the background (stdout and stderr to temporary files); ``_run`` collects it."""
    if args in _started:
        return
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    env = {k: v for k, v in env.items() if v}
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    _started[args] = (
        subprocess.Popen([sys.executable, SCRIPT, *args], stdout=out, stderr=err, text=True, env=env),
        out,
        err,
    )


def stop_all() -> None:
    """Stop what was started and never collected (an interrupted session)."""
    for proc, _, _ in _started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _run(*args: str) -> dict[str, list[str]]:
    _start(*args)  # unless conftest started it when the session began (it is one process: the other core is free)
    proc, out, err = _started.pop(args)
    try:
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read(), err.read()
    assert proc.returncode == 0, stderr[-3000:]
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ("torch.compile", "autoshard"):
            rows[cells[0]] = cells
    rows["_tail"] = [stdout]
    return rows


def _check(rows: dict[str, list[str]], loss_tol: float) -> None:
    assert set(rows) >= {"torch.compile", "autoshard"}
    tc_loss, as_loss = float(rows["torch.compile"][5]), float(rows["autoshard"][5])
    assert abs(tc_loss - as_loss) <= loss_tol * abs(tc_loss), (tc_loss, as_loss)  # same model, same batch
    for name in ("torch.compile", "autoshard"):
        assert float(rows[name][1]) > 0.0
    assert float(rows["torch.compile"][3]) == 1.0


def test_gpu_single_code_path_runs_on_cpu() -> None:
    rows = _run(*CPU_ARGS)
    _check(rows, 1e-5)
    assert "Triton kernels in autoshard's program: 0" in rows["_tail"][0]  # C++ kernels on CPU


test_gpu_single_code_path_runs_on_cpu.start_early = lambda: _start(*CPU_ARGS)  # type: ignore[attr-defined]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton path)")
def test_gpu_single_compiles_triton_kernels() -> None:
    rows = _run("--device", "cuda", "--size", "tiny", "--steps", "3", "--warmup", "1")
    _check(rows, 2e-2)  # bf16
    n = int(re.search(r"Triton kernels in autoshard's program: (\d+)", rows["_tail"][0]).group(1))
    assert n > 0
