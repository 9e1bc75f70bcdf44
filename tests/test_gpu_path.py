"""The single-device benchmark (benchmarks/gpu_single.py): on CPU its code path (a smoke run, always), on CUDA the
Triton path (skipped where CUDA is absent). Run as subprocesses: the benchmark owns its process group and
thread settings, which must not leak into this process (later tests fork gloo workers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_single.py")


def _run(*args: str) -> dict[str, list[str]]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    env = {k: v for k, v in env.items() if v}
    proc = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ("torch.compile", "autoshard"):
            rows[cells[0]] = cells
    rows["_tail"] = [proc.stdout]
    return rows


def _check(rows: dict[str, list[str]], loss_tol: float) -> None:
    assert set(rows) >= {"torch.compile", "autoshard"}
    tc_loss, as_loss = float(rows["torch.compile"][5]), float(rows["autoshard"][5])
    assert abs(tc_loss - as_loss) <= loss_tol * abs(tc_loss), (tc_loss, as_loss)  # same model, same batch
    for name in ("torch.compile", "autoshard"):
        assert float(rows[name][1]) > 0.0
    assert float(rows["torch.compile"][3]) == 1.0


def test_gpu_single_code_path_runs_on_cpu() -> None:
    rows = _run("--device", "cpu", "--size", "tiny", "--steps", "2", "--warmup", "1", "--dtype", "float32")
    _check(rows, 1e-5)
    assert "Triton kernels in autoshard's program: 0" in rows["_tail"][0]  # C++ kernels on CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton path)")
def test_gpu_single_compiles_triton_kernels() -> None:
    rows = _run("--device", "cuda", "--size", "tiny", "--steps", "3", "--warmup", "1")
    _check(rows, 2e-2)  # bf16
    n = int(re.search(r"Triton kernels in autoshard's program: (\d+)", rows["_tail"][0]).group(1))
    assert n > 0
