"""Models bigger than one device: built on the meta device, given values on each rank's shards (the model's own
init, or a ``save_pretrained`` checkpoint read slice by slice), checkpointed with torch's state-dict API and
resumed on another mesh (``autoshard/weights/``).

- init: the same seed gives bit-identical whole tensors on one device, on (2,) fsdp and on (2, 2) fsdp+tp
  (LocalTensorMode), for a stock HF Llama (``_init_weights``, rotary buffers recomputed) and a plain module with
  its own ``init_weights()``; the statistics match ``from_config``'s;
- pretrained: a bf16 checkpoint loaded into fp32 shards of a meta-built model on 2 gloo ranks trains equal to
  ``from_pretrained`` on one device (loss, gradients, parameters after 3 AdamW steps); ``get_state_dict`` +
  ``dcp.save`` there, ``set_state_dict`` + ``dcp.load`` on 4 ranks under dp x tp, and the next steps equal the
  uninterrupted run; the HF export reloads with ``from_pretrained``; a full state dict on rank 0 broadcast into
  the shards (``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``);
- pipeline stages of a meta model (tied embedding and head in different stages): init equal to one device's,
  a checkpoint read into the stages trains like ``from_pretrained``, and ``get_state_dict`` of the stages (model
  and AdamW) resumes without stages;
- bad input: a step before any values, a checkpoint of another model, a checkpoint missing a key, a checkpoint
  cut short, missing a file its index names, or not safetensors.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from harness import local_ranks
from torch import nn

import autoshard
from autoshard.testing.launch import launch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

LR = 1e-2


def _cfg(**kw: Any) -> LlamaConfig:
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaConfig(**{**base, **kw})


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    return dict(input_ids=ids, labels=ids)


def _meta_llama(**kw: Any) -> nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_cfg(**kw))


class UserNet(nn.Module):
    """Plain user code: its own init_weights() (torchtitan's convention), a parameter no torch module owns."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.w1 = nn.Linear(32, 128)
        self.w2 = nn.Linear(128, 32, bias=False)
        self.scale = nn.Parameter(torch.ones(32))
        self.head = nn.Linear(32, 64, bias=False)

    def init_weights(self) -> None:
        nn.init.normal_(self.emb.weight, std=0.5)
        for lin in (self.w1, self.w2):
            nn.init.trunc_normal_(lin.weight, std=0.02)
        nn.init.zeros_(self.w1.bias)
        nn.init.ones_(self.scale)
        self.head.weight.data.normal_(0.0, 0.1)
        self.head.weight.data.mul_(0.5)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.w2(torch.relu(self.w1(self.emb(ids)))) * self.scale
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _whole(t: torch.Tensor) -> list[torch.Tensor]:
    """Every simulated rank's view of the whole tensor."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    ranks = getattr(full, "_local_tensors", None)
    return list(ranks.values()) if ranks is not None else [full]


def test_init_is_the_same_model_on_every_mesh_and_on_one_device() -> None:
    ref = AutoModelForCausalLM.from_config(_cfg())
    autoshard.init_weights(ref, seed=7)
    user_ref = UserNet()
    autoshard.init_weights(user_ref, seed=7)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    batch = _batch()  # made outside LocalTensorMode: the same on every simulated rank
    placements: dict[str, set[str]] = {}
    for shape, names, recipe in (((2,), ("dp",), "fsdp"), ((2, 2), ("dp", "tp"), "fsdp+tp")):
        with local_ranks(2 * len(shape)):
            mesh = torch.distributed.device_mesh.init_device_mesh("cpu", shape, mesh_dim_names=names)
            sharded = autoshard.compile(_meta_llama(), mesh, example_inputs=batch, backend="eager", recipe=recipe)
            with pytest.raises(RuntimeError, match=r"built on the meta device and still have no values.*init_weights"):
                sharded.step(**batch)  # no values yet: refused, naming the calls that give them
            sharded.init_weights(seed=7)
            for name, value in sharded.state_dict().items():
                placements.setdefault(name, set()).add(str(getattr(value, "placements", "whole")))
                for r, full in enumerate(_whole(value)):
                    assert torch.equal(full, ref.state_dict()[name]), f"{recipe} rank {r}: {name} differs"
            rope = sharded.module.model.rotary_emb
            assert torch.equal(rope.inv_freq, ref.model.rotary_emb.inv_freq)  # non-persistent buffer recomputed
            with torch.device("meta"):
                user = UserNet()
            us = autoshard.compile(user, mesh, example_inputs=(ids, ids), backend="eager", recipe=recipe)
            us.init_weights(seed=7)
            for name, value in us.state_dict().items():
                for full in _whole(value):
                    assert torch.equal(full, user_ref.state_dict()[name]), f"UserNet {recipe}: {name} differs"
    sharded_somewhere = [n for n, ps in placements.items() if any("Shard" in p for p in ps)]
    assert len(sharded_somewhere) >= 10, placements  # the meshes really cut the tensors differently


def test_init_statistics_match_from_config() -> None:
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(_cfg(hidden_size=256, intermediate_size=512))
    ours = _meta_llama(hidden_size=256, intermediate_size=512)
    ours.to_empty(device="cpu")
    autoshard.init_weights(ours, seed=0)
    for (name, a), b in zip(stock.state_dict().items(), ours.state_dict().values()):
        assert a.shape == b.shape
        assert abs(a.float().mean() - b.float().mean()) < 0.01, name
        assert abs(a.float().std() - b.float().std()) < 0.1 * a.float().std() + 1e-6, name


def _train(
    model: Any, batch: dict[str, torch.Tensor], steps: int, opt: torch.optim.Optimizer
) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses, grads = [], {}
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        if hasattr(model, "step"):
            loss = model.step(**batch)
        else:
            loss = model(**batch).loss
            loss.backward()
        losses.append(float(loss.detach()))
        if s == 0:
            grads = {n: _whole(p.grad)[0].detach().clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads


def _pretrained_then_resumed(rank: int, world: int, arg: tuple[str, str, str]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    ckpt, saved, export = arg
    names = ("dp",) if world == 2 else ("dp", "tp")
    mesh = init_device_mesh("cpu", (2,) if world == 2 else (2, 2), mesh_dim_names=names)
    # ZeRO-2 on 2 ranks (masters and AdamW state sharded, compute copies whole: a load must refresh the copies),
    # resumed under fsdp + tp on 4 (every parameter and its state laid out otherwise)
    recipe = "zero2" if world == 2 else "fsdp+tp"
    sharded = autoshard.compile(_meta_llama(), mesh, example_inputs=_batch(), backend="eager", recipe=recipe)
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
    out: dict[str, Any] = {}
    if world == 2:
        sharded.load_pretrained(ckpt)
        out["losses"], out["grads"] = _train(sharded, _batch(), 3, opt)
        out["params"] = {n: _whole(p)[0].clone() for n, p in sharded.named_parameters()}
        model_sd, optim_sd = get_state_dict(sharded, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=saved)
        sharded.save_pretrained(export)
        # the full state dict on rank 0 only, broadcast into the shards of another meta-built model (FSDP2's way)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        fresh = autoshard.compile(_meta_llama(), mesh, example_inputs=_batch(), backend="eager", recipe=recipe)
        full = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict() if rank == 0 else {}
        set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        out["broadcast"] = {n: _whole(p)[0].clone() for n, p in fresh.named_parameters()}
    else:  # another world size and layout: zero2 on 2 ranks -> fsdp + tp on 4
        model_sd, optim_sd = get_state_dict(sharded, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=saved)
        set_state_dict(sharded, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["later"], _ = _train(sharded, _batch(), 2, opt)
    out["placements"] = {n: str(p.placements) for n, p in sharded.named_parameters()}
    return out


def test_pretrained_into_shards_trains_like_from_pretrained_and_resumes_on_another_mesh(tmp_path: Any) -> None:
    ckpt, saved, export = str(tmp_path / "hf"), str(tmp_path / "dcp"), str(tmp_path / "export")
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(_cfg()).to(torch.bfloat16).save_pretrained(ckpt)  # bf16 into fp32 masters
    two = launch(2, _pretrained_then_resumed, (ckpt, saved, export), timeout=400)[0]
    four = launch(4, _pretrained_then_resumed, (ckpt, saved, export), timeout=400)[0]

    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, grads = _train(ref, _batch(), 3, opt)
    params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    later, _ = _train(ref, _batch(), 2, opt)
    assert two["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"grad of {name}")
    for name, p in two["params"].items():
        torch.testing.assert_close(p, params[name], rtol=1e-4, atol=1e-5, msg=f"{name} after 3 steps")
    start = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).state_dict()
    assert all(torch.equal(v, start[n]) for n, v in two["broadcast"].items()) and len(two["broadcast"]) == len(params)
    # the uninterrupted run continues, and the run resumed on 4 ranks under other placements matches it
    assert two["later"] == pytest.approx(later, rel=1e-5, abs=1e-6)
    assert four["later"] == pytest.approx(later, rel=1e-5, abs=1e-6)
    assert four["placements"] != two["placements"]

    back = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)  # the export, on one process
    assert float(back(**_batch()).loss) == pytest.approx(later[0], rel=1e-5)
    assert any(f.endswith(".safetensors") for f in os.listdir(export))


def test_a_checkpoint_of_another_model_is_refused_naming_the_key(tmp_path: Any) -> None:
    AutoModelForCausalLM.from_config(_cfg(hidden_size=32, intermediate_size=64)).save_pretrained(tmp_path / "small")
    model = AutoModelForCausalLM.from_config(_cfg())
    with pytest.raises(
        ValueError,
        match=r"model\.embed_tokens\.weight has shape \(256, 32\) in the checkpoint but "
        r"\(256, 64\) in the model",
    ):
        autoshard.load_pretrained(model, tmp_path / "small")
    AutoModelForCausalLM.from_config(_cfg(num_hidden_layers=1)).save_pretrained(tmp_path / "short")
    with pytest.raises(ValueError, match=r"missing from the checkpoint: model\.layers\.1\.\S+ \(\d+, \d+\) and "):
        autoshard.load_pretrained(model, tmp_path / "short")
    with pytest.raises(FileNotFoundError, match="no safetensors files"):
        autoshard.load_pretrained(model, tmp_path)


def test_a_truncated_or_incomplete_checkpoint_is_refused_naming_the_file(tmp_path: Any) -> None:
    """A save that did not finish (a safetensors file cut short), a directory copied without one of the files its
    index names, a file that is not safetensors: each is refused before any read, naming the file and what is
    missing (the safetensors library's own error named neither: "incomplete metadata, file not fully covered")."""
    import shutil

    model = AutoModelForCausalLM.from_config(_cfg())
    AutoModelForCausalLM.from_config(_cfg()).save_pretrained(tmp_path / "good", max_shard_size="60KB")
    files = sorted(f for f in os.listdir(tmp_path / "good") if f.endswith(".safetensors"))
    assert len(files) > 2
    autoshard.load_pretrained(model, tmp_path / "good")  # the whole checkpoint loads

    cut = shutil.copytree(tmp_path / "good", tmp_path / "cut")
    with open(cut / files[-1], "r+b") as f:
        f.truncate(os.path.getsize(cut / files[-1]) - 1000)
    with pytest.raises(
        ValueError,
        match=rf"{files[-1]} is truncated: \d+ bytes where its header describes \d+; "
        r"\S+ (and \d+ more tensors )?end past its end",
    ):
        autoshard.load_pretrained(model, cut)

    partial = shutil.copytree(tmp_path / "good", tmp_path / "partial")
    os.remove(partial / files[1])
    with pytest.raises(
        ValueError,
        match=rf"index model.safetensors.index.json puts \d+ tensors \(\S+, ...\) in "
        rf"{files[1]}, which is not there",
    ):
        autoshard.load_pretrained(model, partial)

    foreign = shutil.copytree(tmp_path / "good", tmp_path / "foreign")
    (foreign / files[0]).write_bytes(b"PK\x03\x04 a zip archive, not safetensors" * 8)
    with pytest.raises(ValueError, match=rf"{files[0]} is not a complete safetensors file"):
        autoshard.load_pretrained(model, foreign)


def _pipelined_then_plain(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, Any] = {}
    pp = autoshard.compile(
        _meta_llama(tie_word_embeddings=True, num_hidden_layers=4),
        init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)),
        example_inputs=_batch(),
        backend="eager",
    )
    pp.init_weights(seed=7)
    out["init"] = {n: _whole(p)[0].clone() for n, p in pp.state_dict().items()}
    pp.load_pretrained(ckpt)  # the stage holding the LM head reads the tied embedding's key
    opt = torch.optim.AdamW(pp.parameters(), lr=LR)
    out["losses"], _ = _train(pp, _batch(), 2, opt)
    model_sd, optim_sd = get_state_dict(pp, opt)  # each stage's ranks write their part
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt + "-dcp")
    plain = autoshard.compile(
        _meta_llama(tie_word_embeddings=True, num_hidden_layers=4),
        init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)),
        example_inputs=_batch(),
        backend="eager",
        recipe="fsdp",
    )
    opt2 = torch.optim.AdamW(plain.parameters(), lr=LR)
    model_sd, optim_sd = get_state_dict(plain, opt2)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt + "-dcp")
    set_state_dict(plain, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["resumed"], _ = _train(plain, _batch(), 2, opt2)  # weights and AdamW state of 2 pipelined steps, no stages
    return out


def test_pipeline_stages_of_a_meta_model_init_load_and_hand_over(tmp_path: Any) -> None:
    cfg = _cfg(tie_word_embeddings=True, num_hidden_layers=4)
    ref = AutoModelForCausalLM.from_config(cfg)
    autoshard.init_weights(ref, seed=7)
    init = ref.state_dict()
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "hf")
    results = launch(2, _pipelined_then_plain, str(tmp_path / "hf"), timeout=400)
    held = {n: v for r in results for n, v in r["init"].items()}
    assert set(held) == set(init) - {"lm_head.weight"} | ({"lm_head.weight"} & set(held))
    for n, v in held.items():
        assert torch.equal(v, init[n]), f"pipeline stage init of {n} differs from one device's"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, _ = _train(model, _batch(), 4, opt)
    for r in results:
        assert r["losses"] == pytest.approx(losses[:2], rel=1e-5, abs=1e-6)
        assert r["resumed"] == pytest.approx(losses[2:], rel=1e-5, abs=1e-6)  # step 4 reads the AdamW moments
