"""What CUDA graphs and torch 2.11 hand the planner, checked on CPU: the shapes of DTensor's strategies and of
attention's outputs that once broke ``benchmarks/gpu_single.py`` on an H100 (torch 2.11) before any kernel ran.

- torch 2.11's norm strategies give ONE output spec for ``native_layer_norm``'s (out, mean, rstd), and its
  legacy ``index`` rule lists only ``self`` among the inputs;
- CUDA flash / cudnn attention returns its rng state as tensors DTensor leaves unplaced, ``None`` sequence
  offsets and ``int`` maximum lengths, which its backward takes back; the partitioner saves only tensors.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autoshard._torch_compat.capture import _inline_constant_items
from autoshard._torch_compat.dtensor import op_strategies, tensor_meta
from autoshard.cluster.meshes import fake_world

aten = torch.ops.aten


def test_layer_norm_candidates_place_all_three_outputs() -> None:
    x = torch.empty(4, 8, 16)
    w = torch.empty(16)
    outs = torch.ops.aten.native_layer_norm.default(x, [16], w, None, 1e-5)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        cands = op_strategies(
            aten.native_layer_norm.default,
            (tensor_meta(x), [16], tensor_meta(w), None, 1e-5),
            {},
            mesh,
            (Shard(0),),
            out_val=outs,
        )
    assert cands, "DTensor gave no layer_norm candidate"
    for c in cands:
        assert len(c.outputs) == 3, c
        assert c.outputs[0] == c.outputs[1] == c.outputs[2], c  # out, mean and rstd keep the batch split
    assert any(c.outputs[0] == (Shard(0),) for c in cands)


def test_cuda_flash_attention_outputs_that_are_tensors_are_placed() -> None:
    q = torch.empty(2, 4, 8, 16)
    # what CUDA flash attention returns: out, logsumexp, cum_seq_q/k (None), max_q/k (int), rng seed and
    # offset, debug mask
    out_val = (
        q,
        torch.empty(2, 4, 8),
        None,
        None,
        8,
        8,
        torch.empty(2, dtype=torch.int64),
        torch.empty(0, dtype=torch.int64),
        torch.empty(0),
    )
    m = tensor_meta(q)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        cands = op_strategies(
            aten._scaled_dot_product_flash_attention.default,
            (m, m, m, 0.0, True),
            {},
            mesh,
            (Replicate(),),
            out_val=out_val,
        )
    assert len(cands) >= 2
    for c in cands:
        for i, v in enumerate(out_val):
            if isinstance(v, torch.Tensor):
                assert c.outputs[i] is not None, (i, c)
        assert c.outputs[6] == c.outputs[7] == (Replicate(),), c  # the rng state is the same on every rank
    assert any(c.outputs[0] == (Shard(1),) for c in cands)  # heads split


def _three(x: torch.Tensor) -> tuple:
    return x * 2, 3, x


def test_constant_and_unused_items_leave_the_joint_graph() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(3)
    call = g.call_function(_three, (x,))
    tensor_item = g.call_function(operator.getitem, (call, 0))
    tensor_item.meta["val"] = torch.empty(3)
    int_item = g.call_function(operator.getitem, (call, 1))
    int_item.meta["val"] = 3
    g.call_function(operator.getitem, (call, 2))  # unused, no metadata (as CUDA cudnn attention leaves one)
    total = g.call_function(torch.add, (tensor_item, int_item))
    g.output(total)
    gm = fx.GraphModule(torch.nn.Module(), g)

    _inline_constant_items(gm)

    items = list(gm.graph.find_nodes(op="call_function", target=operator.getitem))
    assert [n.args[1] for n in items] == [0]
    assert total.args == (tensor_item, 3)
    torch.testing.assert_close(gm(torch.ones(3)), torch.full((3,), 5.0))


def test_index_candidates_place_every_index_tensor() -> None:
    # torch 2.11 takes aten.index through its legacy rule, whose schema lists only ``self`` unless asked to
    # look into the list of indices
    x = torch.empty(4, 8)
    i0, i1 = torch.zeros(4, 1, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        for first in ((Replicate(),), (Shard(0),)):
            cands = op_strategies(
                aten.index.Tensor,
                (tensor_meta(x), [tensor_meta(i0), tensor_meta(i1)]),
                {},
                mesh,
                first,
                out_val=x[i0, i1],
            )
            assert cands
            assert all(len(c.inputs) == 3 for c in cands), cands
