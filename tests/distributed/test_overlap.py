"""The forward/backward split of a rank's program and the communication/computation overlap pass."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from autoshard import _torch_compat as tc
from autoshard.cluster.meshes import fake_world
from autoshard.compiler.overlap import IN_FLIGHT, schedule_overlap


def _names(gm: torch.fx.GraphModule, opname: str) -> list[int]:
    return [i for i, n in enumerate(gm.graph.nodes) if getattr(n.target, "_opname", None) == opname]


def _backward_like(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> list[torch.Tensor]:
    """Two "layers" of gradients, each reduced (as lower traces a bucket: after all the compute)."""
    g2 = (x @ w2).tanh()
    g1 = (g2 @ w1).tanh() @ w1
    group = dist.group.WORLD
    r2 = funcol.all_reduce(g2.reshape(-1), "sum", group)
    r1 = funcol.all_reduce(g1.reshape(-1), "sum", group)
    full = funcol.all_gather_tensor(w1, 0, group)  # of a graph input: stays where it is
    return [r2 * 2, r1 + 1, full @ w2.t()]  # (under tracing, funcol waits right after each collective)


def test_overlap_raises_collectives_and_sinks_waits_keeping_order_and_values():
    with fake_world(2):
        args = [torch.randn(8, 8) for _ in range(3)]
        gm = make_fx(_backward_like)(*args)
        before = [t.clone() for t in gm(*args)]
        reduce_at = _names(gm, "all_reduce")
        stats = schedule_overlap(gm)
        after = gm(*args)
    nodes = list(gm.graph.nodes)
    first, second = _names(gm, "all_reduce")
    # the first reduction now starts before the second layer's matmuls, right after its input exists
    mms = _names(gm, "mm")
    assert first < mms[1], (first, mms)
    assert first < reduce_at[0] and stats["raised"] >= 1
    assert nodes[first].args[0] in (nodes[first - 1],) or nodes[first - 1] in nodes[first].all_input_nodes
    # issue order is kept (every rank issues the same sequence)
    assert first < second
    # the all-gather of an input is not raised to the top (all weights gathered at once)
    gather = _names(gm, "all_gather_into_tensor")[0]
    assert gather > mms[2] and gather > second, (gather, mms, second)
    # each wait sits right before the op that uses its result, or before the collective issued IN_FLIGHT later
    # (the first reduction's wait: before the all-gather), so that at most IN_FLIGHT are outstanding
    colls = sorted(_names(gm, "all_reduce") + _names(gm, "all_gather_into_tensor"))
    for w in _names(gm, "wait_tensor"):
        assert nodes[w + 1] in nodes[w].users or (w + 1 in colls and colls.index(w + 1) >= IN_FLIGHT), w
    assert colls.index(_names(gm, "wait_tensor")[0] + 1) == IN_FLIGHT  # r2's wait before the third collective
    for i in colls:  # outstanding when each collective is issued
        issued = [c for c in colls if c <= i]
        waited = [w for w in _names(gm, "wait_tensor") if w < i]
        assert len(issued) - len(waited) <= IN_FLIGHT, (i, issued, waited)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b)


def test_partition_saves_forward_values_and_runs_no_forward_op_again():
    """The make_fx joint graph carries no phase tags; untagged, the partitioner would save only the inputs and
    the backward would recompute the forward (matmuls and attention twice per step)."""

    def joint(primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> list[torch.Tensor]:
        x, w = primals
        q = (x @ w).view(1, 1, 4, 8)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True)[:2]
        loss = out.sum()
        g_out = tangents[0].expand_as(out)
        gq = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(g_out, q, q, q, out, lse, 0.0, True)
        gh = (gq[0] + gq[1] + gq[2]).view(4, 8)
        return [loss, x.t() @ gh]

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    gm = make_fx(joint)([x, w], [torch.tensor(1.0)])
    names = iter(["primals_1", "primals_2", "tangents_1"])
    for n in gm.graph.find_nodes(op="placeholder"):
        n.name = n.target = next(names)
    gm.recompile()
    fw, bw = tc.partition_joint(gm, num_fwd_outputs=1)

    def count(g: torch.fx.GraphModule, name: str) -> int:
        return sum(1 for n in g.graph.nodes if getattr(n.target, "_opname", None) == name)

    assert count(fw, "mm") == 1 and count(bw, "mm") == 1  # x @ w in the forward only; the weight grad in bw
    assert count(fw, "_scaled_dot_product_flash_attention_for_cpu") == 1
    assert count(bw, "_scaled_dot_product_flash_attention_for_cpu") == 0
    n_saved = len(fw.graph.find_nodes(op="output")[0].args[0]) - 1
    assert n_saved > 2  # activations (attention output, logsumexp, ...) are saved, not only the inputs


def _three_gathered_layers(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """FSDP's forward as lower traces it: each layer gathers a view of its parameter (which other ops read too)."""
    group = dist.group.WORLD
    h = x
    for w in (w1, w2, w3):
        v = w.view(-1)
        h = (h @ funcol.all_gather_tensor(v, 0, group).view(16, 8)[:8]).tanh() + v.sum()
    return h


def test_parameter_gathers_stay_at_their_layers_prefetched_one_ahead():
    with fake_world(2):
        args = [torch.randn(8, 8) for _ in range(4)]
        gm = make_fx(_three_gathered_layers)(*args)
        before = gm(*args).clone()
        schedule_overlap(gm)
        after = gm(*args)
    nodes = list(gm.graph.nodes)
    g1, g2, g3 = _names(gm, "all_gather_into_tensor")
    w1, w2 = (next(u for u in nodes[g].users if getattr(u.target, "_opname", "") == "wait_tensor") for g in (g1, g2))
    mms = _names(gm, "mm")
    # the layers' gathers (of views of parameters that other ops read too) are not all raised to the top: the
    # second is issued before the first is waited on (FSDP's prefetch: it runs while the first layer computes)
    assert g1 < g2 < nodes.index(w1) < mms[0], (g1, g2, mms)
    # and the third not before the second layer's wait, so at most two layers' gathered weights are alive
    assert mms[0] < g3 and nodes.index(w2) < mms[1], (g3, mms)
    torch.testing.assert_close(before, after)


def _most_in_flight(gm: torch.fx.GraphModule) -> int:
    outstanding, most = set(), 0
    for n in gm.graph.nodes:
        name = getattr(n.target, "_opname", None)
        if name == "wait_tensor":
            outstanding.discard(n.args[0])
        elif getattr(n.target, "namespace", None) == "_c10d_functional":
            outstanding.add(n)
            most = max(most, len(outstanding))
    return most


def test_one_collective_in_flight_keeps_values_and_the_overlap():
    with fake_world(2):
        args = [torch.randn(8, 8) for _ in range(3)]
        gm = make_fx(_backward_like)(*args)
        before = [t.clone() for t in gm(*args)]
        schedule_overlap(gm, in_flight=1)
        after = gm(*args)
    assert _most_in_flight(gm) == 1
    first = _names(gm, "all_reduce")[0]
    assert first < _names(gm, "mm")[1]  # still issued before the next layer's compute, which overlaps it
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b)


def _compiled_fsdp_in_flight(rank: int, world: int, arg: None) -> tuple[int, int, int]:
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard
    from autoshard.compiler.overlap import in_flight_for
    from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs

    cfg = GPTConfig(n_layer=3, d_model=32, n_head=2, vocab=64, seq_len=8, bias=False)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sharded = autoshard.compile(GPT(cfg), mesh, gpt_example_inputs(cfg, 4), recipe="fsdp", backend="eager")
    program = sharded._program
    return in_flight_for(mesh), _most_in_flight(program.fw_gm), _most_in_flight(program.bw_gm)


def test_gloo_programs_keep_one_collective_in_flight():
    """Two concurrent gloo all-gathers corrupt the heap (overlap's docstring has the measurement): on gloo an FSDP
    program (whose prefetch would issue a layer's gather before the previous one is waited on) keeps one in
    flight; elsewhere (the fake group a plan is made on) ``IN_FLIGHT``."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.compiler.overlap import in_flight_for
    from autoshard.testing.launch import launch

    for got in launch(2, _compiled_fsdp_in_flight):
        assert got == (1, 1, 1), got
    with fake_world(2):
        assert in_flight_for(init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))) == IN_FLIGHT == 2
