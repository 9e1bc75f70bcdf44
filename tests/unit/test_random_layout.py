"""A draw fills its tensor in the memory order one device does (issue 43, found by the fuzzer: seed 7001 cases 26
and 30, ``python benchmarks/fuzz.py --seed 7001 --only 26 30``).

On the CPU, ``F.dropout``'s mask is ``bernoulli_`` of ``empty_like(x)``, and ``rand_like``, ``uniform_``,
``normal_``, ``exponential_`` fill the tensor they are given: all in its memory order. After a transpose (a conv or
norm over ``x.transpose(1, 2)``, transposed back) that is not the order of the dims, and ``autoshard::draw`` filled
a contiguous tensor: the sharded run dropped other elements than one device. The draw now fills a tensor of the
same layout (``rules/random_draws.py``: ``order``), and batch norm's capture decomposition returns ATen's layout
(contiguous), as the CPU kernel does, so that what follows it draws in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from autoshard import _torch_compat as tc
from autoshard.rules.random_draws import DECOMPOSITIONS, DRAW

aten = torch.ops.aten


def _transposed() -> torch.Tensor:
    """A [4, 8, 9] activation laid out as [4, 9, 8] (a conv's output transposed back), values in [1, 2)."""
    return (torch.rand(4, 9, 8) + 1).transpose(1, 2)


# (what, the capture decomposition's call, one device's call): the values, or dropout's kept elements
FILLS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
    "dropout": (
        lambda x: DECOMPOSITIONS[aten.native_dropout.default](x, 0.1, True)[0] != 0,
        lambda x: F.dropout(x, 0.1) != 0,
    ),
    # bernoulli.p is also what capture makes of the in-place form (F.dropout's ``empty_like(x).bernoulli_(1 - p)``);
    # the out-of-place torch.bernoulli(x, p) of a transposed x fills contiguous on one device: the one form drawn
    # in another order, as the captured graph cannot tell the two apart
    "bernoulli": (lambda x: DECOMPOSITIONS[aten.bernoulli.p](x, 0.9), lambda x: torch.empty_like(x).bernoulli_(0.9)),
    "uniform": (lambda x: DECOMPOSITIONS[aten.uniform.default](x, 0.0, 1.0), lambda x: x.clone().uniform_()),
    "normal": (lambda x: DECOMPOSITIONS[aten.normal_functional.default](x, 0.0, 1.0), lambda x: x.clone().normal_()),
    "exponential": (lambda x: DECOMPOSITIONS[aten.exponential.default](x, 1.0), lambda x: x.clone().exponential_()),
    "rand_like": (lambda x: DECOMPOSITIONS[aten.rand_like.default](x), torch.rand_like),
}


@pytest.mark.parametrize("what", list(FILLS))
def test_a_draw_into_a_transposed_tensor_is_one_devices(what: str) -> None:
    decomposed, eager = FILLS[what]
    x = _transposed()
    assert not x.is_contiguous()
    torch.manual_seed(3)
    want = eager(x)
    torch.manual_seed(3)
    got = decomposed(x)
    assert torch.equal(got, want)
    torch.manual_seed(3)  # the same fill in the dims' order is other numbers: the layout is what made them equal
    assert not torch.equal(decomposed(x.contiguous()), want)


def test_a_draw_given_its_layout_returns_it_contiguous() -> None:
    torch.manual_seed(0)
    want = torch.empty(2, 5, 3).transpose(1, 2).uniform_()
    torch.manual_seed(0)
    got = DRAW("uniform", [2, 3, 5], [0.0, 1.0], torch.float32, torch.device("cpu"), order=[0, 2, 1])
    assert got.is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_batch_norm_decomposition_returns_atens_layout(layout: str) -> None:
    x = _transposed() if layout == "transposed" else torch.rand(2, 8, 3, 5).to(memory_format=torch.channels_last)
    c = x.shape[1]
    weight, bias, mean, var = torch.rand(c), torch.rand(c), torch.zeros(c), torch.ones(c)
    decomposed = tc.planning_decompositions()[aten._native_batch_norm_legit_functional.default]
    out = decomposed(x, weight, bias, mean.clone(), var.clone(), True, 0.1, 1e-5)[0]
    want = F.batch_norm(x, mean.clone(), var.clone(), weight, bias, training=True)
    assert out.stride() == want.stride(), (out.stride(), want.stride())
    assert torch.allclose(out, want, atol=1e-5)
