"""Evaluation in a training loop: ``sharded.eval()`` runs a forward-only program and returns the model's whole
output (a ``ModelOutput`` with logits), equal to one device's; ``train()`` switches back. Two gloo ranks, the
FSDP recipe, a stock HF Llama (validation logits, then greedy decoding of a few tokens: a new shape per token)
and a stock HF ResNet (BatchNorm reads the running statistics the training steps left)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from numerics_utils import LR
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.testing.launch import launch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, ResNetConfig, ResNetForImageClassification  # noqa: E402


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )


def _resnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return ResNetForImageClassification(
        ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10, layer_type="basic")
    )


def _batches() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (4, 12), generator=g)
    return {
        "ids": ids,
        "prompt": ids[:2, :6],
        "pixels": torch.randn(4, 3, 16, 16, generator=g),
        "labels": torch.randint(0, 10, (4,), generator=g),
    }


def _greedy(call: Any, prompt: torch.Tensor, n: int) -> torch.Tensor:
    seq = prompt
    for _ in range(n):
        nxt = call(seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq


def _run(model: torch.nn.Module, train: Any, evaluate: Any, b: dict[str, Any], cut: Any) -> dict[str, Any]:
    """Two training steps, then evaluation: the same code for the compiled module and the plain model."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(2):
        train().backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        out = evaluate()
    model.train()
    return out


def _worker(rank: int, world: int, arg: None) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    b = _batches()
    llama = autoshard.compile(
        _llama(), mesh, example_inputs=dict(input_ids=b["ids"], labels=b["ids"]), backend="eager", recipe="fsdp"
    )
    res: dict[str, Any] = {}

    def llama_eval() -> dict[str, Any]:
        out = llama(**llama.shard_inputs(input_ids=b["ids"], labels=b["ids"]))
        greedy = _greedy(lambda s: llama(**llama.shard_inputs(input_ids=s)), b["prompt"], 3)
        return {"type": type(out).__name__, "loss": float(out.loss), "logits": out.logits.clone(), "greedy": greedy}

    res["llama"] = _run(
        llama, lambda: llama(**llama.shard_inputs(input_ids=b["ids"], labels=b["ids"])), llama_eval, b, None
    )
    res["train_after"] = float(llama(**llama.shard_inputs(input_ids=b["ids"], labels=b["ids"])))  # train() again
    resnet = autoshard.compile(
        _resnet(),
        mesh,
        example_inputs=dict(pixel_values=b["pixels"], labels=b["labels"]),
        backend="eager",
        recipe="ddp",
    )
    res["resnet"] = _run(
        resnet,
        lambda: resnet(**resnet.shard_inputs(pixel_values=b["pixels"], labels=b["labels"])),
        lambda: {"logits": resnet(**resnet.shard_inputs(pixel_values=b["pixels"])).logits.clone()},
        b,
        None,
    )
    return res


def test_eval_returns_the_models_outputs_equal_to_one_device() -> None:
    results = launch(2, _worker, None, timeout=400)
    b = _batches()
    llama, resnet = _llama(), _resnet()
    want = _run(
        llama,
        lambda: llama(input_ids=b["ids"], labels=b["ids"]).loss,
        lambda: {
            "loss": float(llama(input_ids=b["ids"], labels=b["ids"]).loss),
            "logits": llama(input_ids=b["ids"]).logits,
            "greedy": _greedy(lambda s: llama(input_ids=s), b["prompt"], 3),
        },
        b,
        None,
    )
    train_after = float(llama(input_ids=b["ids"], labels=b["ids"]).loss)
    want_resnet = _run(
        resnet,
        lambda: resnet(pixel_values=b["pixels"], labels=b["labels"]).loss,
        lambda: {"logits": resnet(pixel_values=b["pixels"]).logits},
        b,
        None,
    )
    for got in results:
        assert got["llama"]["type"] == "CausalLMOutputWithPast"
        assert got["llama"]["loss"] == pytest.approx(want["loss"], rel=1e-5)
        torch.testing.assert_close(got["llama"]["logits"], want["logits"], rtol=1e-4, atol=1e-5)
        assert torch.equal(got["llama"]["greedy"], want["greedy"]), (got["llama"]["greedy"], want["greedy"])
        assert got["train_after"] == pytest.approx(train_after, rel=1e-5)  # train() switched back: the loss again
        torch.testing.assert_close(got["resnet"]["logits"], want_resnet["logits"], rtol=1e-4, atol=1e-5)


def _backend_worker(rank: int, world: int, arg: None) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    b = _batches()
    model = _llama()
    compiled = torch.compile(model, backend="autoshard", options={"mesh": mesh, "backend": "eager", "recipe": "fsdp"})
    piece = b["ids"].chunk(2)[rank]  # DDP's convention: each rank its rows
    out = _run(
        model,
        lambda: compiled(input_ids=piece, labels=piece).loss,
        lambda: {"logits": compiled(input_ids=piece, labels=piece).logits.clone()},
        b,
        None,
    )
    out["train_after"] = float(compiled(input_ids=piece, labels=piece).loss)
    return out


def test_eval_through_the_torch_compile_backend() -> None:
    """model.eval() on the compiled model, called as in training (a validation loss loop): this rank's rows of the
    logits, equal to one device's; train() switches back."""
    results = launch(2, _backend_worker, None, timeout=400)
    b = _batches()
    llama = _llama()
    want = _run(
        llama,
        lambda: llama(input_ids=b["ids"], labels=b["ids"]).loss,
        lambda: {"logits": llama(input_ids=b["ids"]).logits},
        b,
        None,
    )
    train_after = float(llama(input_ids=b["ids"], labels=b["ids"]).loss)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["logits"], want["logits"].chunk(2)[rank], rtol=1e-4, atol=1e-5)
        assert got["train_after"] == pytest.approx(train_after, rel=1e-5)
