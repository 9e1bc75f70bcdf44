"""PyTorch Lightning trains a model with autoshard (``autoshard/integrations/lightning.py``), equal to its own DDP.

``examples/lightning_train.py`` under torchrun, 2 gloo ranks, a tiny stock Llama, 10 AdamW steps over 2 epochs:

- the Trainer with ``strategy=AutoshardStrategy()`` (the one line that differs) gives the losses of
  ``strategy="ddp"``, step by step, within 1e-4 relative, and its validation losses (Lightning's sanity check first,
  so the model's first call is an evaluation under ``inference_mode``); it checkpoints after step 5 and 10;
- the step-10 checkpoint removed, a second launch resumes from step 5 (``ckpt_path``): the model's and AdamW's
  shards read back at its first call (the sanity check's), its losses at steps 5 to 9 are the uninterrupted run's;
- Fabric with Lightning's own ``ModelParallelStrategy(parallelize_fn=parallelizer(...))`` gives DDP's losses too;
- what autoshard cannot honour is refused before the first step with an ``InputError`` naming the option and the
  fix (one process, world size 1: the refusals come before any planning).

About 90 s on 2 CPU cores: 4 launches of torchrun (~10 s each to start and import transformers and Lightning),
the autoshard ones planning on the first call (~10 s, ``--backend eager`` skips Inductor).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

from harness import torchrun_example  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_train.py"
STEPS = 10
RTOL = 1e-4


class Run(NamedTuple):
    text: str  # stdout and stderr
    losses: dict[int, float]  # the global batch's loss per optimizer step
    validation: dict[int, float]  # the validation loss after that many steps (0: Lightning's sanity check)


def _launch(*args: str) -> Run:
    """The example under torchrun on 2 ranks, as rank 0 reports it."""
    text, stdout, losses = torchrun_example(EXAMPLE, 2, ["--steps", str(STEPS), *args], timeout=300)
    final = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
    assert {int(k): v for k, v in final["losses"].items()} == losses, stdout[-3000:]
    return Run(text, losses, {int(k): v for k, v in final.get("validation", {}).items()})


def _max_relative(a: dict[int, float], b: dict[int, float]) -> float:
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in a)


@pytest.fixture(scope="module")
def ddp() -> Run:
    """Lightning's own DDP on the same model, data and seed."""
    run = _launch("--ddp")
    assert sorted(run.losses) == list(range(STEPS)) and sorted(run.validation) == [0, 5, 10], run.text[-3000:]
    return run


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    """The Trainer with AutoshardStrategy, checkpointing every 5 steps."""
    ckpt = tmp_path_factory.mktemp("lightning") / "ckpt"
    return ckpt, _launch("--ckpt", str(ckpt), "--ckpt-every", "5")


def test_trainer_with_autoshard_equals_its_ddp_run(sharded: tuple[Path, Run], ddp: Run) -> None:
    run = sharded[1]
    assert sorted(run.losses) == list(range(STEPS)), f"one line per optimizer step expected:\n{run.text[-3000:]}"
    assert all(math.isfinite(v) for v in run.losses.values()), run.losses
    assert run.losses[STEPS - 1] < run.losses[0] - 0.5, f"the loss does not go down: {run.losses}"
    worst = _max_relative(run.losses, ddp.losses)
    assert worst <= RTOL, f"max relative difference {worst:.2e} from DDP:\n autoshard {run.losses}\n ddp {ddp.losses}"
    # the sanity check's evaluation came first (the model planned under inference_mode), then training, evaluated
    # after each epoch: DDP's validation losses too
    assert sorted(run.validation) == [0, 5, 10], run.text[-3000:]
    worst = _max_relative(run.validation, ddp.validation)
    assert worst <= RTOL, f"validation: autoshard {run.validation}, ddp {ddp.validation}"


def test_checkpoint_resumes_where_it_stopped(sharded: tuple[Path, Run]) -> None:
    ckpt, first = sharded
    assert (ckpt / "step=5.ckpt" / ".metadata").is_file() and (ckpt / "step=5.ckpt" / "meta.pt").is_file(), first.text[
        -3000:
    ]
    shutil.rmtree(ckpt / "step=10.ckpt")  # as if the job had stopped after its step-5 checkpoint
    resumed = _launch("--ckpt", str(ckpt), "--ckpt-every", "5", "--resume")
    assert "resuming from" in resumed.text and "step=5.ckpt" in resumed.text, resumed.text[-3000:]
    assert sorted(resumed.losses) == list(range(5, STEPS)), f"steps 5 to 9 expected:\n{resumed.text[-3000:]}"
    # the sanity check after step 5 and step 5 check the restored weights, the next steps AdamW's restored moments
    # and step count
    worst = max(_max_relative(resumed.losses, first.losses), _max_relative(resumed.validation, first.validation))
    assert worst <= 1e-6, (
        f"resumed {resumed.losses} {resumed.validation} != uninterrupted {first.losses} "
        f"{first.validation} (max relative {worst:.2e})"
    )
    assert (ckpt / "step=10.ckpt" / ".metadata").is_file(), resumed.text[-3000:]


def test_fabric_with_autoshard_parallelize_fn_equals_ddp(ddp: Run) -> None:
    """Fabric's sampler over the ``data_parallel`` axis gives the ranks DDP's rows (the same seed and shuffle)."""
    run = _launch("--fabric")
    assert sorted(run.losses) == list(range(STEPS)), run.text[-3000:]
    worst = _max_relative(run.losses, ddp.losses)
    assert worst <= RTOL, f"max relative difference {worst:.2e} from DDP:\n fabric {run.losses}\n ddp {ddp.losses}"


REFUSALS = r"""
import json, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning as L
from lightning.fabric.strategies import ModelParallelStrategy
from autoshard.errors import InputError
from autoshard.integrations.lightning import AutoshardStrategy, parallelize


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).pow(2).mean()


class Lit(L.LightningModule):
    def __init__(self, two_children=False, two_optimizers=False):
        super().__init__()
        self.model = Net()
        if two_children:
            self.other = nn.Linear(2, 2)
        self.two_optimizers = two_optimizers
        self.automatic_optimization = not two_optimizers

    def training_step(self, batch, i):
        return self.model(batch[0])

    def configure_optimizers(self):
        make = lambda: torch.optim.SGD(self.model.parameters(), lr=0.1)
        return [make(), make()] if self.two_optimizers else make()


def fit(lit=None, ckpt_path=None, **options):
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=AutoshardStrategy(backend="eager"), max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **options)
    trainer.fit(lit or Lit(), DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=4), ckpt_path=ckpt_path)


def fabric_bf16():
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed",
                      strategy=ModelParallelStrategy(parallelize_fn=parallelize))
    fabric.launch()
    fabric.setup_module(Net())(torch.randn(4, 8))


cases = {
    "precision": lambda: fit(precision="16-true"),
    "two_children": lambda: fit(Lit(two_children=True)),
    "two_optimizers": lambda: fit(Lit(two_optimizers=True)),
    "ckpt_path": lambda: fit(ckpt_path=sys.argv[2]),
    "batch_axes": lambda: AutoshardStrategy(batch_axes="all"),
    "no_mesh": lambda: parallelize(Net(), None),
    "lightning_module": lambda: parallelize(Lit(), object()),
    "fabric_bf16": fabric_bf16,
}
out = {}
for name, case in cases.items():
    try:
        case()
        out[name] = "no error"
    except InputError as e:
        out[name] = "InputError: " + str(e)
    except BaseException as e:  # reported by the test, naming the case
        out[name] = f"{type(e).__name__}: {e}"
json.dump(out, open(sys.argv[1], "w"))
"""

EXPECTED = {  # case -> words its message must hold: the option, and the fix
    "precision": ("precision='16-true'", "'32-true'", "'bf16-mixed'"),
    "two_children": ("['model', 'other']", "AutoshardStrategy(module='model')"),
    "two_optimizers": ("2 optimizers", "one optimizer with several param groups"),
    "ckpt_path": ("ckpt_path=", "not a checkpoint AutoshardStrategy wrote", "pass no ckpt_path"),
    "batch_axes": ("batch_axes", "drop batch_axes"),
    "no_mesh": ("device mesh", "AutoshardStrategy()"),
    "lightning_module": ("LightningModule Lit", "self.model = parallelize(self.model, self.device_mesh)"),
    "fabric_bf16": ("torch.autocast", "precision='32-true'", "parallelizer(mixed_precision='bf16')"),
}


def test_what_autoshard_cannot_honour_is_refused_before_the_first_step(tmp_path: Path) -> None:
    script, result, bogus = tmp_path / "refusals.py", tmp_path / "out.json", tmp_path / "bogus.ckpt"
    script.write_text(REFUSALS)
    bogus.write_text("not a checkpoint")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, str(script), str(result), str(bogus)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0 and result.is_file(), run.stdout[-2000:] + run.stderr[-4000:]
    got = json.loads(result.read_text())
    for case, words in EXPECTED.items():
        message = got[case]
        assert message.startswith("InputError: "), f"{case}: {message}"
        missing = [w for w in words if w not in message]
        assert not missing, f"{case}: {missing} not in: {message}"
