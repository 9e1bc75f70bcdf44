"""``torch.compile(model, backend="autoshard", options={"mesh": mesh})`` on gloo ranks: the ordinary training
loop (optimizer built before the first call, each rank passing its batch shard) trains like one device on the
concatenated batch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from harness import assert_close_to_reference, single_device_reference
from numerics_utils import LR, MODELS, PARAM_ATOL
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.testing.launch import launch


def _full(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter the backend holds as this rank's shard (or of its gradient)."""
    return autoshard.as_dtensor(p, value).full_tensor().detach().clone()


def _worker(rank: int, world: int, arg: tuple) -> dict:
    name, shape, names, options = arg
    make, inputs_fn = MODELS[name]
    x, y = inputs_fn()
    dp = shape[0]
    coord = rank // (world // dp)  # this rank's data-parallel coordinate (dp is the outer axis)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # before the first call, on the plain parameters
    torch._dynamo.utils.counters.clear()  # a forked rank inherits the counts of graphs the test process compiled
    compiled = torch.compile(model, backend="autoshard", options={"mesh": mesh, "backend": "eager", **options})
    shard = (x.chunk(dp)[coord], y.chunk(dp)[coord])
    losses, grads = [], {}
    for step in range(3):
        loss = compiled(*shard)
        loss.backward()
        if step == 0:
            grads = {n: _full(p, p.grad) for n, p in model.named_parameters()}
            norm = float(autoshard.clip_grad_norm_(model.parameters(), 1e9))  # the whole model's, not a shard's
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    params = {n: _full(p, p.data) for n, p in model.named_parameters()}
    sharded = sum(p.numel() < autoshard.as_dtensor(p).numel() for p in model.parameters())
    counts = torch._dynamo.utils.counters["stats"]
    return {
        "losses": losses,
        "grads": grads,
        "params": params,
        "frames": int(counts["unique_graphs"]),
        "sharded": sharded,
        "norm": norm,
    }


def test_backend_trains_like_one_device_on_2x2() -> None:
    """FSDP + TP (parameters sharded on both axes), each rank passing its dp shard of the batch."""
    arg = ("gpt", (2, 2), ("dp", "tp"), {"recipe": "fsdp+tp"})
    results = launch(4, _worker, arg)
    make, inputs_fn = MODELS["gpt"]
    ref = single_device_reference(make, inputs_fn(), steps=3, lr=LR)
    for got in results:
        assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)
        assert got["frames"] == 1, "dynamo recompiled after the parameters became shards"
        assert got["sharded"] > 0
        want = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref.grads.values()]))
        assert abs(got["norm"] - float(want)) < 1e-4 * float(want), (got["norm"], float(want))


def test_backend_is_registered_by_entry_point() -> None:
    """A fresh interpreter that never imports autoshard finds the backend by name."""
    code = "import torch._dynamo as d; print('autoshard' in d.list_backends(exclude_tags=()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


class _Broken(torch.nn.Module):
    """A user model whose forward breaks dynamo's graph between its two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(h).pow(2).mean()


def _graph_break(rank: int, world: int, arg: None) -> str:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    compiled = torch.compile(_Broken(), backend="autoshard", options={"mesh": mesh, "backend": "eager"})
    try:
        compiled(torch.randn(4, 8))
    except Exception as e:  # dynamo wraps the backend's error
        return str(e)
    return "no error"


def test_a_graph_break_is_a_clear_error_naming_it() -> None:
    """Not a wrong result: the first graph must not stand for the whole forward."""
    msg = launch(2, _graph_break, None)[0]
    assert "graph break" in msg and "reads 2 of its 4 parameters" in msg, msg
    assert "fullgraph=True" in msg and "test_torch_compile_backend.py" in msg, msg


def _meta_built(rank: int, world: int, ckpt: str) -> dict:
    """The torch.compile backend on models built on the meta device: values from autoshard.init_weights (our
    GPT) and from a save_pretrained directory (a stock HF Llama), given before the first call."""
    from transformers import AutoConfig, AutoModelForCausalLM

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    out: dict = {}
    make, inputs_fn = MODELS["gpt"]
    x, y = inputs_fn()
    with torch.device("meta"):
        gpt = make()
    autoshard.init_weights(gpt, seed=5)  # recorded; runs on this rank's shards once the backend has planned
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(gpt, backend="autoshard", options={"mesh": mesh, "backend": "eager", "recipe": "fsdp"})
    opt = torch.optim.AdamW(gpt.parameters(), lr=LR)
    out["gpt"] = []
    for _ in range(3):
        loss = compiled(x.chunk(2)[rank], y.chunk(2)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["gpt"].append(float(loss))
    out["frames"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    out["local"] = {n: tuple(p.shape) for n, p in gpt.named_parameters()}
    with torch.device("meta"):
        llama = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))
    autoshard.load_pretrained(llama, ckpt)
    compiled = torch.compile(llama, backend="autoshard", options={"mesh": mesh, "backend": "eager", "recipe": "fsdp"})
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    out["llama"] = float(compiled(input_ids=ids.chunk(2)[rank], labels=ids.chunk(2)[rank]).loss)
    return out


def test_a_meta_built_model_gets_values_and_trains_through_the_backend(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    ckpt = str(tmp_path / "hf")
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt)
    results = launch(2, _meta_built, ckpt, timeout=400)
    make, inputs_fn = MODELS["gpt"]
    ref = make()
    autoshard.init_weights(ref, seed=5)
    whole = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    losses = single_device_reference(lambda: ref, inputs_fn(), steps=3, lr=LR).losses
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    llama = float(AutoModelForCausalLM.from_pretrained(ckpt)(input_ids=ids, labels=ids).loss)
    for got in results:
        assert got["gpt"] == pytest.approx(losses, rel=1e-5), (got["gpt"], losses)
        assert got["frames"] == 1, "dynamo recompiled after the stand-ins became shards"
        assert got["local"]["wte.weight"][0] == whole["wte.weight"][0] // 2  # each rank holds half (fsdp)
        assert got["llama"] == pytest.approx(llama, rel=1e-5), (got["llama"], llama)
