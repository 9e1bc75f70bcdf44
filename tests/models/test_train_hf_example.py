"""``examples/train_hf.py`` launched as clusters launch it: torchrun, 2 gloo ranks, a tiny stock Llama.

    python -m pytest -q tests/models/test_train_hf_example.py

The first launch trains 5 steps, checkpointing after step 3 and at the end. The step-5 checkpoint is then
removed, as if the job had stopped after its step-3 save. The second launch resumes from the latest complete
checkpoint. It must say so, and its losses at steps 3 and 4 must equal the first launch's: step 3 checks the
restored weights, step 4 the restored AdamW state. About a minute on 2 CPU cores
(torchrun's start, ~8 s, and planning on the first call, twice; ``--backend eager`` skips Inductor).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from harness import torchrun_example  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_hf.py"
TINY = ["--backend", "eager", "--hidden", "64", "--seq", "32", "--batch", "4"]


def _launch(*args: str, timeout: float = 240) -> tuple[str, dict[int, float]]:
    """Run the example under torchrun with 2 ranks; returns its output and rank 0's loss per step."""
    text, _, losses = torchrun_example(EXAMPLE, 2, [*TINY, *args], timeout)
    return text, losses


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[int, float]]:
    """5 steps with autoshard.compile on dp=2, checkpointed after step 3 and at the end (both tests use it)."""
    ckpt = tmp_path_factory.mktemp("train_hf") / "ckpt"
    text, losses = _launch("--steps", "5", "--ckpt", str(ckpt), "--ckpt-every", "3")
    return ckpt, text, losses


def test_torchrun_trains_checkpoints_and_resumes(first_run: tuple[Path, str, dict[int, float]]) -> None:
    ckpt, text, first = first_run
    assert sorted(first) == [0, 1, 2, 3, 4], f"one progress line per step expected:\n{text[-4000:]}"
    assert all(math.isfinite(v) for v in first.values()), first
    assert first[0] > 5.0, f"an untrained byte model starts near ln(257) = 5.55: {first}"
    assert first[3] < first[0] - 0.3, f"the loss does not go down on real text: {first}"
    assert (ckpt / "step-000003" / ".metadata").exists() and (ckpt / "step-000005" / ".metadata").exists(), text[-3000:]

    shutil.rmtree(ckpt / "step-000005")  # as if the job stopped after its step-3 checkpoint
    text, resumed = _launch("--steps", "2", "--ckpt", str(ckpt), "--resume")
    assert "resumed at step 3" in text, text[-4000:]
    assert sorted(resumed) == [3, 4], f"one progress line per step, from the saved step on:\n{text[-4000:]}"
    assert all(math.isfinite(v) for v in resumed.values()), resumed
    # the same steps on the same batches from the restored weights (step 3) and AdamW state (step 4)
    for step in (3, 4):
        assert resumed[step] == pytest.approx(first[step], abs=1e-3), f"{first=} {resumed=}\n{text[-3000:]}"
    assert (ckpt / "step-000005" / ".metadata").exists(), text[-3000:]


def test_torchrun_pipeline_stages_and_backend_train_like_the_plain_compile(
    first_run: tuple[Path, str, dict[int, float]],
) -> None:
    """The same stock model and batches through pipeline stages (``--pp 2``: two stages, padded rows weighted by
    their tokens) and through ``torch.compile(backend="autoshard")`` with the config's default KV cache: the
    same losses as ``autoshard.compile`` on a data-parallel mesh (the first run's steps 0-2)."""
    plain = first_run[2]
    text, piped = _launch("--steps", "3", "--pp", "2")
    assert sorted(piped) == [0, 1, 2], text[-4000:]
    text, backend = _launch("--steps", "3", "--torch-compile")
    assert sorted(backend) == [0, 1, 2], text[-4000:]
    for step in range(3):
        assert piped[step] == pytest.approx(plain[step], abs=1e-3), f"{plain=} {piped=}"
        assert backend[step] == pytest.approx(plain[step], abs=1e-3), f"{plain=} {backend=}"
