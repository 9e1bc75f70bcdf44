"""Fast checks of the example models, of the test harness (simulated ranks, references) and of the fake world it
uses (``autoshard.cluster.meshes.fake_world``). The gloo launcher is tested in test_launch.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from autoshard.cluster.meshes import fake_world
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.models.mlp import MLP, mlp_example_inputs

try:
    from harness import Reference, assert_close_to_reference, local_ranks, single_device_reference
except ImportError:  # tests/ imported as a package
    from tests.harness import Reference, assert_close_to_reference, local_ranks, single_device_reference

SMALL_GPT = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, seq_len=32)


# --------------------------------------------------------------------------- one process, many ranks


def test_local_ranks_all_reduce() -> None:
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    with local_ranks(4) as ltm:
        mesh = init_device_mesh("cpu", (4,))
        t = ltm.rank_map(lambda r: torch.full((3,), float(r)))
        out = funcol.all_reduce(t, "sum", mesh).wait()
        torch.testing.assert_close(out.reconcile(), torch.full((3,), 6.0))

        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        t = ltm.rank_map(lambda r: torch.full((2,), float(r)))
        out = funcol.all_reduce(t, "sum", (mesh2, 1)).wait()  # groups {0,1} and {2,3}
        got = {r: v[0].item() for r, v in out._local_tensors.items()}
        assert got == {0: 1.0, 1: 1.0, 2: 5.0, 3: 5.0}
    assert not dist.is_initialized()


def test_fake_world_is_destroyed() -> None:
    with fake_world(8):
        assert dist.get_world_size() == 8
    assert not dist.is_initialized()


def test_fake_world_nests_only_in_a_world_of_its_size() -> None:
    """Inside a group of the same size the existing group is used and survives the inner exit; another size
    is refused (torch has one default group: replacing it would break the meshes made on it)."""
    with fake_world(4):
        group = dist.group.WORLD
        with fake_world(4):
            assert dist.group.WORLD is group
        assert dist.is_initialized() and dist.get_world_size() == 4
        with pytest.raises(ValueError, match="a process group of 4 ranks is already initialized"):
            with fake_world(8):
                pass
        assert dist.get_world_size() == 4
        dist.destroy_process_group()  # the body may end the group itself
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- models


def test_gpt_loss_grads_and_tied_head() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL_GPT)
    tokens, targets = gpt_example_inputs(SMALL_GPT, batch=2, seq=16)
    assert tokens.shape == targets.shape == (2, 16) and tokens.dtype == torch.long
    loss = model(tokens, targets)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(SMALL_GPT.vocab)) < 0.5  # near-uniform logits at init
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    big = [n for n, p in model.named_parameters() if p.shape == (SMALL_GPT.vocab, SMALL_GPT.d_model)]
    assert big == ["wte.weight"]  # LM head is tied: no separate output matrix
    names = {n for n, _ in model.named_parameters()}
    assert {"layers.0.attn.wq.weight", "layers.1.mlp.fc2.bias", "ln_f.weight", "wpe.weight"} <= names


def test_gpt_init_is_deterministic() -> None:
    torch.manual_seed(3)
    a = GPT(SMALL_GPT)
    torch.manual_seed(3)
    b = GPT(SMALL_GPT)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert torch.equal(gpt_example_inputs(SMALL_GPT, 2, seed=1)[0], gpt_example_inputs(SMALL_GPT, 2, seed=1)[0])


@pytest.mark.parametrize("depth,activation", [(0, "relu"), (2, "gelu")])
def test_mlp_loss_and_grads(depth: int, activation: str) -> None:
    torch.manual_seed(0)
    model = MLP(16, 32, 8, depth=depth, activation=activation)
    assert len(model.layers) == depth
    x, y = mlp_example_inputs(4, 16, 8)
    loss = model(x, y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_tiny_hf_models_are_seeded_and_padded() -> None:
    pytest.importorskip("transformers")
    from autoshard.models.hf import build

    (a, batch), (b, _), (c, _) = build("llama", seed=1), build("llama", seed=1), build("llama", seed=2)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not all(torch.equal(pa[n], pc[n]) for n in pa)
    mask, labels = batch["attention_mask"], batch["labels"]
    assert (mask == 0).any() and bool((labels[mask == 0] == -100).all())
    assert a.config.use_cache and a.training  # the stock defaults, in train mode


# --------------------------------------------------------------------------- references


def test_single_device_reference_is_reproducible() -> None:
    def make() -> GPT:
        return GPT(SMALL_GPT)

    inputs = gpt_example_inputs(SMALL_GPT, batch=2, seq=16)
    a = single_device_reference(make, inputs, steps=3)
    b = single_device_reference(make, inputs, steps=3)
    assert isinstance(a, Reference) and len(a.losses) == 3
    assert a.losses == b.losses
    assert a.losses[-1] < a.losses[0]
    assert set(a.grads) == set(a.params) == {n for n, _ in make().named_parameters()}
    for n in a.params:
        assert torch.equal(a.params[n], b.params[n]) and torch.equal(a.grads[n], b.grads[n])
    assert_close_to_reference(a, b.losses, b.grads, b.params)

    bad = dict(b.params)
    bad["ln_f.weight"] = bad["ln_f.weight"] + 1e-2
    with pytest.raises(AssertionError, match=r"param ln_f\.weight: max abs diff 1\.000e-02"):
        assert_close_to_reference(a, b.losses, b.grads, bad)
