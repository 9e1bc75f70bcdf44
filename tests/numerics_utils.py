"""Train a model with autoshard for a few AdamW steps and collect what the single-device run is compared on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard import _torch_compat as tc
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.models.llama import Llama, LlamaConfig, llama_example_inputs
from autoshard.models.mlp import MLP, mlp_example_inputs
from autoshard.models.moe import MoEConfig, MoEDecoder, moe_example_inputs

# The small models both numerics layers train: name -> (make model, make global inputs).
GPT_CFG = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, seq_len=16, bias=False)
# AdamW turns last-bit differences in near-zero gradient elements (another summation order) into steps of up
# to lr, so parameters after the optimizer are compared at atol = lr / 5; loss and gradients stay at 1e-5.
LR = 1e-3
PARAM_ATOL = 2e-4


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_CFG)


def make_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(32, 64, 32)


# 4 experts, top-2, capacity 1.25: some choices overflow their expert's slots and are dropped, as Mixtral-style
# capacity routing drops them (the sharded run must drop the same ones)
MOE_CFG = MoEConfig(n_layer=2, d_model=32, n_head=4, n_kv_head=2, ffn=64, n_experts=4, top_k=2, vocab=64, seq_len=16)


def make_moe() -> MoEDecoder:
    torch.manual_seed(0)
    return MoEDecoder(MOE_CFG)


# one 2048-token sequence, one key/value head for four query heads: long enough that a plan with the sequence
# sharded gathers the keys and values for causal attention (context parallelism) rather than the whole layer
LONG_CFG = LlamaConfig(n_layer=2, d_model=256, n_head=4, n_kv_head=1, ffn=512, vocab=256, seq_len=2048)


def make_long_llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LONG_CFG)


# a vocabulary large next to the rest of the model: with the tokens whole on tp, the solver splits the output
# layer's logits over the vocabulary and computes the cross-entropy on the slices (vocabulary-parallel loss)
VOCAB_CFG = GPTConfig(n_layer=1, d_model=128, n_head=4, vocab=32768, seq_len=64, bias=False)


def make_vocab_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB_CFG)


class GroupNormNet(nn.Module):
    """A stock ``nn.GroupNorm`` over 4 channels of a ``[batch, 4, 7]`` input, then a linear head and cross-entropy:
    on 4 ranks its weight and bias are one element a rank when sharded (ZeRO-1/2's masters, FSDP)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.head = nn.GroupNorm(2, 4), nn.Linear(4, 12)
        with torch.no_grad():  # not the identity's ones and zeros: a weight read from the wrong place shows at step 0
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.normal_()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(x).transpose(1, 2))
        return nn.functional.cross_entropy(logits.reshape(-1, 12), target.reshape(-1))


def make_groupnorm() -> GroupNormNet:
    torch.manual_seed(0)
    return GroupNormNet()


def groupnorm_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, 7, generator=g), torch.randint(12, (8, 7), generator=g)


MODELS = {
    "mlp": (make_mlp, lambda: mlp_example_inputs(16, 32, 32)),
    "groupnorm": (make_groupnorm, groupnorm_inputs),
    "gpt": (make_gpt, lambda: gpt_example_inputs(GPT_CFG, 8)),
    "moe": (make_moe, lambda: moe_example_inputs(MOE_CFG, 8)),
    "llama-long": (make_long_llama, lambda: llama_example_inputs(LONG_CFG, 1)),
    "gpt-vocab": (make_vocab_gpt, lambda: gpt_example_inputs(VOCAB_CFG, 4)),
}


def _full(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    if hasattr(full, "trigger_wait"):  # an AsyncCollectiveTensor (a gathered value): the tensor it wraps
        full = full.trigger_wait()
    lt = getattr(full, "_local_tensors", None)  # LocalTensorMode: every rank holds the same full value
    if lt is not None:
        ranks = sorted(lt)
        for r in ranks[1:]:
            assert torch.equal(lt[r], lt[ranks[0]]), "ranks disagree on a replicated value"
        with tc.outside_local_tensor_mode():  # a plain copy (inside the mode a clone is a LocalTensor again)
            return lt[ranks[0]].detach().clone()
    return full.detach().clone()


def _scalar(t: torch.Tensor) -> float:
    lt = getattr(t, "_local_tensors", None)
    if lt is not None:
        vals = {float(v) for v in lt.values()}
        assert len(vals) == 1, f"the loss differs across ranks: {vals}"
        return vals.pop()
    return float(t)


def train_sharded(
    make_model: Callable[[], nn.Module],
    inputs: Any,
    mesh_shape: tuple[int, ...],
    names: tuple[str, ...],
    *,
    steps: int = 3,
    lr: float = 1e-2,
    probe: Callable[[Any], dict[str, Any]] | None = None,
    **compile_kw: Any,
) -> dict[str, Any]:
    """Train ``steps`` AdamW steps on ``autoshard.compile``'s module: losses, first-step gradients, final
    parameters and the plan (``probe(sharded)``'s entries added)."""
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = make_model()
    sharded = autoshard.compile(model, mesh, inputs, **compile_kw)
    opt = torch.optim.AdamW(sharded.parameters(), lr=lr)
    losses, grads = [], {}
    for step in range(steps):
        loss = sharded.step(**inputs) if isinstance(inputs, dict) else sharded.step(*inputs)
        if step == 0:
            grads = {n: _full(p.grad) for n, p in sharded.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(_scalar(loss))
    params = {n: _full(p.data) for n, p in sharded.named_parameters()}
    out = {"losses": losses, "grads": grads, "params": params, "plan": sharded.plan.to_json()}
    return {**out, **(probe(sharded) if probe is not None else {})}
