"""A loop written with Accelerate (``accelerator.prepare`` / ``backward`` / ``clip_grad_norm_``) on a model
``autoshard.compile(model, mesh)`` returned, launched by ``accelerate launch`` and by torchrun
(``examples/accelerate_train.py``, 2 CPU processes over gloo): the losses of 10 steps equal Accelerate's own DDP run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import torchrun_example

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "accelerate_train.py"


def _losses(text: str) -> list[float]:
    lines = [ln for ln in text.splitlines() if ln.startswith("losses ")]
    assert lines, text[-4000:]
    return json.loads(lines[-1][len("losses ") :])


def _accelerate_launch(*args: str) -> list[float]:
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(SCRIPT),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return _losses(out.stdout)


def test_accelerate_loop_equals_its_ddp_run_under_accelerate_launch_and_torchrun() -> None:
    want = _accelerate_launch("--reference")
    got = _accelerate_launch()  # the solved plan
    assert got == pytest.approx(want, rel=1e-5)
    _, out, _ = torchrun_example(SCRIPT, 2, ["--recipe", "fsdp"], timeout=400)
    assert _losses(out) == pytest.approx(want, rel=1e-5)
