"""Pipeline stages over a main sequence of blocks of several classes (issue 43 part 6).

Stages go between consecutive blocks of the model's main sequence (``autoshard/pipeline/blocks.py``), whatever
the blocks' classes: a stock ``JambaForCausalLM`` (Mamba and attention decoder layers alternating in one
``nn.ModuleList``) and a stock ConvNeXt (stages of different widths) train in 2 stages on gloo ranks equal to
one device; blocks of different cost are balanced by their priced costs; a model with no sequence of blocks gets
an error naming its containers and the structure that would allow a cut.

Dropout: pipeline stages draw their random masks per stage, which does not yet equal one device's draws, so
every run here has no dropout: Jamba's stock config has none (``attention_dropout=0.0``), and ConvNeXt is
built with ``dropout=False`` (its stock drop-path rate is 0 too).
"""

from __future__ import annotations

import pytest
import torch
from harness import assert_close_to_reference, single_device_reference
from numerics_utils import LR, PARAM_ATOL, _full
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.errors import InputError
from autoshard.models import hf
from autoshard.pipeline.blocks import main_sequence
from autoshard.testing.launch import launch

transformers = pytest.importorskip("transformers")

BATCH, SEQ, STEPS = 8, 4, 2  # (Jamba's Mamba scan is unrolled over the sequence: a short one keeps it fast)


def make_jamba(device: str | None = None) -> nn.Module:
    """A stock JambaForCausalLM, 4 layers: Mamba at 0 and 2, attention at 1 and 3 (attn_layer_period=2,
    offset 1), dense MLPs (one expert per layer), default dropout (none)."""
    config = transformers.JambaConfig(
        vocab_size=hf.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=1,
        mamba_d_state=8,
        pad_token_id=hf.PAD,
        bos_token_id=hf.BOS,
        eos_token_id=hf.EOS,
    )
    with torch.random.fork_rng(devices=[]), torch.device(device or "cpu"):
        torch.manual_seed(0)
        model = transformers.JambaForCausalLM(config)
    return model.train()


def _make(name: str) -> nn.Module:
    return make_jamba() if name == "jamba" else hf.build(name, batch=BATCH, dropout=False)[0]


def _batch(name: str) -> dict[str, torch.Tensor]:
    return hf.lm_batch(BATCH, SEQ, 1) if name == "jamba" else hf.build(name, batch=BATCH, dropout=False)[1]


def _train(rank: int, world: int, name: str) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    batch = _batch(name)
    sharded = autoshard.compile(_make(name), mesh, batch, backend="eager", microbatches=2, schedule="1F1B")
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        losses.append(float(sharded.step(**batch)))
        if step == 0:
            grads = {n: _full(p.grad) for n, p in sharded.named_parameters()}
        opt.step()
        opt.zero_grad()
    params = {n: _full(p.data) for n, p in sharded.named_parameters()}
    return {
        "losses": losses,
        "grads": grads,
        "params": params,
        "kind": type(sharded).__name__,
        "layers": [list(s.layers) for s in sharded.plan.stages],
    }


def _check(name: str, container: str) -> list[list[str]]:
    """Train ``name`` in 2 stages on 2 gloo ranks; every rank's loss, gradients and parameters equal one
    device's, and every block of ``container`` is in exactly one stage. Returns what each stage lists."""
    results = launch(2, _train, name)
    ref = single_device_reference(lambda: _make(name), _batch(name), steps=STEPS, lr=LR)
    held: set[str] = set()
    for got in results:
        assert got["kind"] == "PipelinedModule"
        held |= set(got["params"])
        own = {n: ref.grads[n] for n in got["params"]}
        assert_close_to_reference(
            type(ref)(ref.losses, own, {n: ref.params[n] for n in got["params"]}),
            got["losses"],
            got["grads"],
            got["params"],
            param_atol=PARAM_ATOL,
        )
    assert held == set(ref.params), sorted(set(ref.params) - held)
    stages = [[n for n in s if n.startswith(container + ".")] for s in results[0]["layers"]]
    depth = main_sequence(_make(name))[1]
    assert sorted(n for s in stages for n in s) == sorted(f"{container}.{i}" for i in range(depth))
    assert len(stages) == 2 and all(stages), stages
    return results[0]["layers"]


def test_stock_jamba_trains_in_two_stages_like_one_device() -> None:
    """Mamba and attention layers of one list, cut between two of them (refused before: "no nn.ModuleList of
    blocks of one class"); each stage holds blocks of both classes or not, as the priced costs split them."""
    classes = [type(b).__name__ for b in make_jamba("meta").model.layers]
    assert classes == ["JambaMambaDecoderLayer", "JambaAttentionDecoderLayer"] * 2
    stages = _check("jamba", "model.layers")
    assert stages[0][0] == "model.embed_tokens" and stages[1][-2:] == ["model.final_layernorm", "lm_head"], stages


def test_convnext_splits_into_two_stages() -> None:
    """ConvNeXt's two stages (16 and 32 channels) in two pipeline stages. Each ConvNeXt layer ends in a permute
    back from channels-last: a stage's output is sent contiguous and its gradient comes back contiguous, so the
    stage graph makes its outputs contiguous (``pipeline/wiring.py``); before, the traced backward viewed the
    received gradient in strides it did not have."""
    stages = _check("convnext", "convnext.encoder.stages")
    assert stages == [
        ["convnext.embeddings", "convnext.encoder.stages.0"],
        ["convnext.encoder.stages.1", "convnext.layernorm", "classifier"],
    ], stages


class _Light(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _Heavy(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 8 * d), nn.Linear(8 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Hybrid(nn.Module):
    """One heavy block (16x a light block's matmul work) then 7 light ones, in one list."""

    def __init__(self, d: int = 1024) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Heavy(d)] + [_Light(d) for _ in range(7)])
        self.head = nn.Linear(d, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return nn.functional.cross_entropy(self.head(x), y)


def test_blocks_of_different_classes_are_balanced_by_their_priced_costs() -> None:
    """An even split by count (4 + 4 blocks) would give the heavy block's stage several times the other's
    work; the split by priced costs puts fewer blocks with the heavy one, and the stages' predicted times per
    micro-batch are within 25% of each other."""
    with torch.device("meta"):
        model = _Hybrid()
    inputs = (torch.randn(4096, 1024, device="meta"), torch.randint(0, 16, (4096,), device="meta"))
    plan = autoshard.plan(
        model, {"pp": 2, "dp": 2}, example_inputs=inputs, cluster="a100-80gb:2x2", solve_recipes=False
    )
    blocks = [[n for n in s.layers if n.startswith("blocks.")] for s in plan.stages]
    assert len(blocks) == 2 and blocks[0][0] == "blocks.0" and blocks[-1][-1] == "blocks.7", blocks
    assert len(blocks[0]) < len(blocks[1]), blocks
    times = [s.microbatch_time_s for s in plan.stages]
    assert max(times) <= 1.25 * min(times), times


class _Prelude(nn.Module):
    """Five small identical layers before the main sequence (more numbered layers, a fiftieth of its
    parameters), then one heavy and two light blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.ModuleList([nn.Linear(64, 64) for _ in range(5)])
        self.embed = nn.Linear(64, 256)
        self.blocks = nn.ModuleList([_Heavy(256), _Light(256), _Light(256)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for p in self.pre:
            x = p(x)
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def test_an_offline_plan_lists_the_sequence_it_split() -> None:
    """The offline plan's stages are cut from the main sequence the search priced (not from the list with the
    most numbered layers), and the modules around it are listed by their top part."""
    with torch.device("meta"):
        model = _Prelude()
    assert main_sequence(model) == ("blocks", 3)
    plan = autoshard.plan(
        model,
        {"pp": 2, "dp": 2},
        example_inputs=(torch.randn(256, 64, device="meta"),),
        cluster="a100-80gb:2x2",
        solve_recipes=False,
    )
    listed = [list(s.layers) for s in plan.stages]
    assert listed[0][:2] == ["pre", "embed"] and "pre" not in listed[1], listed
    assert sorted(n for s in listed for n in s if n.startswith("blocks.")) == ["blocks.0", "blocks.1", "blocks.2"]


class _Nested(nn.Module):
    """Two different blocks in a list, each holding a longer list of identical blocks inside."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)]), nn.Linear(4, 4)])


def test_the_main_sequence_is_the_outermost_list_holding_the_model() -> None:
    """Blocks of any classes (Jamba); not a longer list nested inside a block; a list or nn.Sequential holding
    at least half the largest sequence's parameters (UNet: its up-sampling blocks, not the two identical ResNet
    blocks of its middle); among those, identical blocks first, as before (T5: its encoder's blocks)."""
    assert main_sequence(make_jamba("meta")) == ("model.layers", 4)
    assert main_sequence(_Nested()) == ("blocks", 2)
    assert main_sequence(hf.build("unet2d", device="meta")[0]) == ("unet.up_blocks", 2)
    assert main_sequence(hf.build("t5", device="meta")[0]) == ("encoder.block", 2)
    assert main_sequence(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))) is None  # the root has no path to cut


class _NoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](self.fc2(torch.relu(self.fc1(x)))).square().mean()


def test_a_model_with_no_sequence_of_blocks_is_told_which_structure_allows_a_cut() -> None:
    with torch.device("meta"):
        model = _NoBlocks()
    with pytest.raises(InputError) as err:
        autoshard.plan(
            model,
            {"pp": 2, "dp": 2},
            example_inputs=(torch.randn(16, 64, device="meta"),),
            cluster="a100-80gb:2x2",
            solve_recipes=False,
        )
    msg = str(err.value)
    assert "_NoBlocks has none" in msg and "layers (nn.ModuleList of 1: nothing to cut between)" in msg, msg
    assert "self.blocks = nn.ModuleList([...])" in msg and "without a pp axis" in msg, msg
