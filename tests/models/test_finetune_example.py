"""``examples/finetune_hf.py`` under torchrun on CPU: a meta-built stock Llama fine-tuned from a pretrained directory,
checkpointed, resumed on another world size, exported and reloaded with ``from_pretrained``.

    python -m pytest -q tests/models/test_finetune_example.py

Two launches, shared by the tests (a module fixture): 2 gloo ranks train 4 steps from a base checkpoint the example
writes itself (DCP checkpoints after steps 2 and 4, an HF export at the end); then 1 rank resumes from a copy of the
step-2 checkpoint (``--from`` the base the first launch wrote) and trains steps 2 and 3 again. About a minute on
2 CPU cores (torchrun's start and planning, twice; ``--backend eager`` skips Inductor).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from harness import torchrun_example  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "finetune_hf.py"
SEQ, BATCH = 32, 4
TINY = ["--backend", "eager", "--hidden", "64", "--layers", "2", "--seq", str(SEQ), "--batch", str(BATCH)]
EVAL = re.compile(r"^eval loss (\S+)$", re.M)


@dataclass(frozen=True)
class Launch:
    text: str  # stdout and stderr
    losses: dict[int, float]  # rank 0's loss per step
    eval: float  # the final loss on the fixed evaluation batch


@dataclass(frozen=True)
class Runs:
    first: Launch  # 2 ranks, 4 steps from the base the example wrote
    resumed: Launch  # 1 rank, steps 2 and 3 from the first launch's step-2 checkpoint
    root: Path
    base: Path

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpt"

    @property
    def export(self) -> Path:
        return self.root / "export"


def _launch(nproc: int, *args: str, timeout: float = 240) -> Launch:
    """Run the example under torchrun; returns its output, rank 0's loss per step and the final eval loss."""
    text, stdout, losses = torchrun_example(EXAMPLE, nproc, [*TINY, *args], timeout)
    evals = EVAL.findall(stdout)
    assert len(evals) == 1, f"one eval line expected:\n{stdout[-3000:]}"
    return Launch(text, losses, float(evals[0]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("finetune_hf")
    work = root / "work"
    first = _launch(
        2,
        "--steps",
        "4",
        "--ckpt",
        str(root / "ckpt"),
        "--ckpt-every",
        "2",
        "--export",
        str(root / "export"),
        "--work-dir",
        str(work),
    )
    base = next(work.glob("base-*"), None)
    assert base is not None, f"no base checkpoint in {work}:\n{first.text[-3000:]}"
    # the resumed run reads a copy of the step-2 checkpoint only, as if the job had stopped after that save
    assert (root / "ckpt" / "step-000002" / ".metadata").exists(), first.text[-3000:]
    shutil.copytree(root / "ckpt" / "step-000002", root / "resume" / "step-000002")
    resumed = _launch(1, "--steps", "2", "--ckpt", str(root / "resume"), "--resume", "--from", str(base))
    return Runs(first, resumed, root, base)


def test_fine_tunes_from_a_pretrained_directory(runs: Runs) -> None:
    text, losses = runs.first.text, runs.first.losses
    assert "wrote a base checkpoint" in text and (runs.base / "config.json").exists(), text[-3000:]
    assert any(runs.base.glob("*.safetensors")), sorted(os.listdir(runs.base))
    assert "mesh {'dp': 2}" in text, text[-3000:]
    assert sorted(losses) == [0, 1, 2, 3], f"one progress line per step expected:\n{text[-3000:]}"
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert losses[0] > 5.0, f"the base is an untrained byte model, starting near ln(257) = 5.55: {losses}"
    assert losses[3] < losses[0] - 0.1, f"the loss does not go down on real text: {losses}"
    assert (runs.ckpt / "step-000004" / ".metadata").exists(), text[-3000:]


def test_resumes_on_another_world_size_with_the_same_losses(runs: Runs) -> None:
    first, resumed, text = runs.first.losses, runs.resumed.losses, runs.resumed.text
    assert "resumed at step 2" in text and "mesh {'dp': 1}" in text, text[-3000:]
    assert sorted(resumed) == [2, 3], f"one progress line per step, from the saved step on:\n{text[-3000:]}"
    # step 2 reads the restored weights (resharded from 2 ranks to 1), step 3 also the restored AdamW moments
    for step in (2, 3):
        assert resumed[step] == pytest.approx(first[step], rel=1e-5), f"{first=} {resumed=}\n{text[-3000:]}"
    assert runs.resumed.eval == pytest.approx(runs.first.eval, rel=1e-5), (runs.first.eval, runs.resumed.eval)
    assert (runs.root / "resume" / "step-000004" / ".metadata").exists(), text[-3000:]


def test_export_reloads_with_from_pretrained_on_one_process(runs: Runs) -> None:
    import torch
    import transformers

    sys.path.insert(0, str(EXAMPLE.parent))
    import finetune_hf

    model = transformers.AutoModelForCausalLM.from_pretrained(runs.export)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    batch = finetune_hf.eval_batch(finetune_hf.Batches(SEQ, BATCH, 0))
    with torch.no_grad():
        loss = float(model.eval()(**batch).loss)
    assert loss == pytest.approx(runs.first.eval, rel=1e-5), (loss, runs.first.eval)
    base = transformers.AutoModelForCausalLM.from_pretrained(runs.base)  # fine-tuning changed the weights
    with torch.no_grad():
        assert float(base.eval()(**batch).loss) > loss + 0.05
