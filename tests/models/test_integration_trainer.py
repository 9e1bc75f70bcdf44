"""The Hugging Face Trainer and TRL's SFTTrainer, unchanged, on a model ``autoshard.compile(model, mesh)`` returned,
against the same job under the Trainer's own DDP on the same ranks (``examples/trainer_hf.py`` under torchrun, gloo):
the loss, gradient norm and evaluation loss per step equal; a checkpoint written by rank, loaded by
``from_pretrained`` and resumed onto another number of ranks; options autoshard cannot honour refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import torchrun_example

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "trainer_hf.py"


def _history(args: list[str], nproc: int = 2, timeout: float = 600) -> list[dict[str, Any]]:
    text, out, _ = torchrun_example(SCRIPT, nproc, args, timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("history ")]
    assert lines, text[-4000:]
    return json.loads(lines[-1][len("history ") :])


def _series(history: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {h["step"]: h[key] for h in history if key in h}


def _assert_same_run(
    got: list[dict[str, Any]],
    want: list[dict[str, Any]],
    rel: float = 1e-4,
    keys: tuple[str, ...] = ("loss", "grad_norm", "eval_loss"),
) -> None:
    for key in keys:
        a, b = _series(got, key), _series(want, key)
        assert a.keys() == b.keys(), (key, a, b)
        for step in b:
            assert a[step] == pytest.approx(b[step], rel=rel), f"{key} at step {step}: {a[step]} vs {b[step]}"


@pytest.fixture(scope="module")
def reference() -> list[dict[str, Any]]:
    """The Trainer's own DDP on 2 ranks: 12 steps, 2 accumulated micro-batches, evaluation every 6."""
    return _history(["--reference", "--steps", "12", "--grad-accum", "2", "--eval-steps", "6"])


def test_trainer_trains_the_solved_plan_as_its_ddp_run_and_checkpoints_by_rank(
    reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Default TrainingArguments (columns pruned by the model's signature, no DDP around the module,
    num_items_in_batch, max_grad_norm=1.0, linear decay, weight decay) with accumulation and evaluation: the
    same losses, gradient norms and eval losses as DDP. Checkpoints every 6 steps hold a from_pretrained folder
    and the shards; resuming from step 6 on ONE rank gives steps 7..12 again."""
    out = tmp_path / "run"
    got = _history(
        [
            "--steps",
            "12",
            "--grad-accum",
            "2",
            "--eval-steps",
            "6",
            "--out",
            str(out),
            "--save-steps",
            "6",
            "--save-model",
        ]
    )
    _assert_same_run(got, reference)
    assert len(_series(got, "loss")) == 12 and len(_series(got, "eval_loss")) == 2
    ck = out / "checkpoint-6"
    assert (ck / "autoshard-state" / ".metadata").exists() and (ck / "scheduler.pt").exists()
    assert (ck / "config.json").exists() and list(ck.glob("*.safetensors"))
    assert not (ck / "optimizer.pt").exists()  # rank 0's pickle of its own shards would resume wrongly

    from transformers import LlamaForCausalLM

    final = LlamaForCausalLM.from_pretrained(out / "final")
    assert sum(p.numel() for p in final.parameters()) > 0 and all(torch.isfinite(p).all() for p in final.parameters())

    resumed = _history(
        [
            "--steps",
            "12",
            "--grad-accum",
            "2",
            "--eval-steps",
            "6",
            "--out",
            str(tmp_path / "again"),
            "--resume",
            str(ck),
        ],
        nproc=1,
    )
    later = {s: v for s, v in _series(resumed, "loss").items() if s > 6}
    assert later.keys() == {7, 8, 9, 10, 11, 12}
    for step, value in later.items():
        assert value == pytest.approx(_series(reference, "loss")[step], rel=1e-4), step


def test_trainer_fsdp_tp_on_a_2x2_mesh_as_its_ddp_run(reference: list[dict[str, Any]]) -> None:
    """fsdp+tp on (dp=2, tp=2): the Trainer gives each of the 4 processes its own rows, which autoshard takes as
    the global batch over both axes (four ranks on two cores: slow, and timed nowhere)."""
    got = _history(
        ["--steps", "12", "--grad-accum", "2", "--eval-steps", "6", "--mesh", "2x2", "--recipe", "fsdp+tp"],
        nproc=4,
        timeout=600,
    )
    _assert_same_run(got, reference)


def test_trl_sft_trainer_on_chats_as_its_ddp_run() -> None:
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    want = _history(["--sft", "--reference", "--steps", "8"])
    got = _history(["--sft", "--steps", "8", "--recipe", "fsdp"])
    _assert_same_run(got, want, keys=("loss", "grad_norm"))


def test_trainer_trains_peft_lora_as_its_ddp_run_and_saves_the_adapters_peft_loads(tmp_path: Path) -> None:
    """A PEFT LoRA model (the base frozen) compiled and trained by the Trainer: its losses equal the Trainer's DDP
    run; save_model writes adapter_config.json and adapter_model.safetensors, equal to DDP's, which
    PeftModel.from_pretrained loads onto the base."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    want = _history(["--lora", "--reference", "--steps", "6", "--out", str(tmp_path / "ddp"), "--save-model"])
    got = _history(["--lora", "--recipe", "fsdp", "--steps", "6", "--out", str(tmp_path / "as"), "--save-model"])
    _assert_same_run(got, want, keys=("loss", "grad_norm"))
    a = load_file(tmp_path / "as" / "final" / "adapter_model.safetensors")
    b = load_file(tmp_path / "ddp" / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    sys.path.insert(0, str(SCRIPT.parent))
    from trainer_hf import build_model

    loaded = peft.PeftModel.from_pretrained(build_model(0, 128), tmp_path / "as" / "final")
    lora = {n: p for n, p in loaded.named_parameters() if "lora_B" in n}
    assert lora and any(p.abs().sum() > 0 for p in lora.values())  # trained (lora_B starts at zero)
