"""Cluster profiles, collective costs, redistribution plans and the roofline: pure arithmetic, no process group."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.cluster.presets import get_cluster, known_clusters
from autoshard.cluster.profile import ClusterProfile, DeviceSpec, Link
from autoshard.cost.comm import CollectiveStep, collective_time, redistribute_steps, redistribute_time
from autoshard.cost.compute import compute_time, op_bytes, op_flops

S, R, P = Shard, Replicate(), Partial()
aten = torch.ops.aten

LINK = Link(name="test", bandwidth=1e9, latency=1e-5, source="test")


# --- cluster ---------------------------------------------------------------------------------------------------


def test_presets_parse_and_carry_sources() -> None:
    assert {"cpu", "h100-sxm", "a100-80gb", "h200"} <= set(known_clusters())
    for name in known_clusters():
        c = get_cluster(name)
        assert c.name == name and c.nodes == 1
        assert c.device.peak_flops["float32"] > 0
        for field in ("peak_flops", "memory_bytes", "memory_bandwidth", "flops_efficiency", "kernel_overhead"):
            assert c.device.sources[field], (name, field)
        assert c.intra_node.source and c.inter_node.source
    assert get_cluster(None).name == "cpu"
    h100 = get_cluster("h100-sxm")
    assert h100.device.peak_flops["bfloat16"] == 989e12
    assert h100.intra_node.bandwidth == 450e9 and h100.inter_node.bandwidth == 50e9
    assert get_cluster("a100-80gb").inter_node.bandwidth == 25e9
    assert get_cluster("h200").device.memory_bandwidth == 4.8e12


def test_sized_cluster() -> None:
    c = get_cluster("h100-sxm:4x8")
    assert c.num_devices() == 32 and (c.nodes, c.devices_per_node) == (4, 8)
    assert c.name == "h100-sxm:4x8"
    assert c.device == get_cluster("h100-sxm").device
    assert get_cluster(c) is c
    with pytest.raises(ValueError, match="4by8"):
        get_cluster("h100-sxm:4by8")


def test_axis_link_inner_axes_stay_in_node() -> None:
    c = get_cluster("h100-sxm:4x8")
    assert c.axis_link((4, 8), 1) == c.intra_node
    assert c.axis_link((4, 8), 0) == c.inter_node
    assert c.axis_link((2, 8), 1) == c.intra_node
    assert c.axis_link((2, 8), 0) == c.inter_node
    assert c.axis_link((64,), 0) == c.inter_node
    assert c.axis_link((8,), 0) == c.intra_node
    assert c.axis_link((2, 2, 2), 0) == c.intra_node  # 8 devices: one node
    assert c.axis_link((2, 4, 2), 0) == c.inter_node  # 16 devices: axis 0 crosses nodes
    assert c.axis_link((4, 8), -1) == c.intra_node


def test_unknown_cluster_lists_known_names() -> None:
    with pytest.raises(ValueError) as info:
        get_cluster("tpu-v9")
    for name in known_clusters():
        assert name in str(info.value)


def test_json_round_trip(tmp_path) -> None:
    c = get_cluster("a100-80gb:2x8")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(c.to_dict()))
    loaded = get_cluster(str(path))
    assert loaded == c and loaded.device.sources == c.device.sources
    assert hash(loaded) == hash(c)  # usable as a cache key
    with pytest.raises(ValueError, match="devices_per_node"):
        ClusterProfile.from_dict({"name": "x"})


# --- collectives -----------------------------------------------------------------------------------------------


def test_collective_time_ring_formulas() -> None:
    # n = 4, b = 4 MB, alpha = 10 us, beta = 1 GB/s: alpha*3 + 4e6*3/4/1e9 = 30e-6 + 3e-3
    one_pass = 3 * 1e-5 + 4e6 * 3 / 4 / 1e9
    assert collective_time("all_gather", 4_000_000, 4, LINK) == pytest.approx(3.03e-3)
    assert collective_time("reduce_scatter", 4_000_000, 4, LINK) == pytest.approx(one_pass)
    assert collective_time("all_reduce", 4_000_000, 4, LINK) == pytest.approx(6.06e-3)
    # all_to_all: NCCL sends each peer its piece at once (b*(n-1)/n**2 per device); gloo gathers whole
    assert collective_time("all_to_all", 4_000_000, 4, LINK) == pytest.approx(3 * 1e-5 + 4e6 * 3 / 16 / 1e9)
    assert collective_time("all_to_all", 4_000_000, 4, LINK, "ring") == pytest.approx(one_pass)
    assert collective_time("all_reduce", 4_000_000, 1, LINK) == 0.0
    with pytest.raises(ValueError, match="all_gather"):
        collective_time("broadcast", 8, 2, LINK)


def _cpu_step(kind: str, axis: int, nbytes: int) -> CollectiveStep:  # gloo: an all_to_all gathers whole
    link = get_cluster("cpu").intra_node
    return CollectiveStep(kind, axis, nbytes, collective_time(kind, nbytes, 2, link, "ring"))


FULL = 8 * 4 * 4  # f32[8, 4]


def _steps(src, dst, cluster="cpu", mesh=(2, 2), shape=(8, 4)):
    return redistribute_steps(src, dst, shape, 4, mesh, get_cluster(cluster))


def test_redistribute_single_axis_moves() -> None:
    assert _steps([S(0), R], [R, R]) == (_cpu_step("all_gather", 0, FULL),)
    assert _steps([P, R], [S(0), R]) == (_cpu_step("reduce_scatter", 0, FULL),)
    assert _steps([R, P], [R, R]) == (_cpu_step("all_reduce", 1, FULL),)
    assert _steps([S(0), R], [S(1), R]) == (_cpu_step("all_to_all", 0, FULL),)
    # a Shard on the other axis shrinks what this axis moves
    assert _steps([S(1), P], [S(1), R]) == (_cpu_step("all_reduce", 1, FULL // 2),)


def test_redistribute_free_moves() -> None:
    assert _steps([R, R], [S(0), S(1)]) == ()
    assert _steps([R, R], [R, P]) == ()
    assert _steps([S(0), P], [S(0), P]) == ()
    assert _steps([S(-2), R], [S(0), R]) == ()  # negative dims normalize
    assert redistribute_time([R, R], [S(0), R], (8, 4), 4, (2, 2), get_cluster("cpu")) == 0.0


def test_redistribute_gather_order_equal_links() -> None:
    # cpu: both axes on the same link -> outermost first; the first gather sees the tensor still halved
    assert _steps([S(0), S(1)], [R, R]) == (
        _cpu_step("all_gather", 0, FULL // 2),
        _cpu_step("all_gather", 1, FULL),
    )
    # two axes sharding one tensor dim: sizes divide by both
    assert _steps([S(0), S(0)], [R, R]) == (
        _cpu_step("all_gather", 0, FULL // 2),
        _cpu_step("all_gather", 1, FULL),
    )


def test_redistribute_scatter_first_then_reduce_then_gather() -> None:
    # free R -> S(0) on axis 1 happens first, so the all_reduce on axis 0 moves half the bytes
    assert _steps([P, R], [R, S(0)]) == (_cpu_step("all_reduce", 0, FULL // 2),)
    # reduce_scatter on axis 0 while axis 1 still shards dim 0: half size; then the gather sees axis 0 sharded
    assert _steps([P, S(0)], [S(1), R]) == (
        _cpu_step("reduce_scatter", 0, FULL // 2),
        _cpu_step("all_gather", 1, FULL // 2),
    )
    # all_reduce before all_gather: the reduction runs on the still-sharded tensor
    assert _steps([S(0), P], [R, R]) == (
        _cpu_step("all_reduce", 1, FULL // 2),
        _cpu_step("all_gather", 0, FULL),
    )


def test_redistribute_uses_slow_link_for_small_messages() -> None:
    c = get_cluster("h100-sxm:4x8")
    shape = (8192, 8192)
    nbytes = 8192 * 8192 * 2  # bf16[8192, 8192]
    steps = redistribute_steps([S(0), S(1)], [R, R], shape, 2, (4, 8), c)
    # gathers: the inter-node axis 0 first at 1/8 size, then NVLink axis 1 at full size; ~4x faster than the
    # reverse order, which pushes the full tensor over InfiniBand
    assert [(s.kind, s.axis, s.nbytes) for s in steps] == [("all_gather", 0, nbytes // 8), ("all_gather", 1, nbytes)]
    reverse = collective_time("all_gather", nbytes // 4, 8, c.intra_node) + collective_time(
        "all_gather", nbytes, 4, c.inter_node
    )
    assert sum(s.time for s in steps) < reverse / 3
    # reduce-scatters mirror it: NVLink axis 1 first at full size, then IB at 1/8 size
    steps = redistribute_steps([P, P], [S(0), S(1)], shape, 2, (4, 8), c)
    assert [(s.kind, s.axis, s.nbytes) for s in steps] == [
        ("reduce_scatter", 1, nbytes),
        ("reduce_scatter", 0, nbytes // 8),
    ]


def test_redistribute_impossible_moves_raise() -> None:
    with pytest.raises(ValueError, match=r"S\(0\).*P"):
        _steps([S(0), R], [P, R])
    with pytest.raises(ValueError, match=r"P\(avg\)"):
        _steps([P, R], [Partial("avg"), R])
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        _steps([R, R], [R, R], mesh=(2,))
    with pytest.raises(ValueError, match="tensor dim 2"):
        _steps([S(2), R], [R, R])


# --- compute ---------------------------------------------------------------------------------------------------


def test_mm_flops_from_torch_registry() -> None:
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    assert op_flops(aten.mm.default, (a, b), {}, a @ b) == 2 * 64 * 32 * 16
    assert op_flops(aten.add.Tensor, (a, a), {}, a) == 0
    assert op_bytes((a, b), {}, a @ b) == (64 * 32 + 32 * 16 + 64 * 16) * 4


def test_cpu_flash_attention_formula() -> None:
    B, H, L, D = 2, 4, 8, 16
    q = torch.randn(B, H, L, D)
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    out, lse = fwd(q, q, q)
    full = 4 * B * H * L * L * D
    assert op_flops(fwd, (q, q, q), {}, (out, lse)) == full
    assert op_flops(fwd, (q, q, q), {"is_causal": True}, (out, lse)) == full // 2
    assert op_flops(fwd, (q, q, q, 0.0, True), {}, (out, lse)) == full // 2
    grads = (q, q, q)
    assert op_flops(bwd, (out, q, q, q, out, lse, 0.0, False), {}, grads) == full * 5 // 2
    assert op_flops(bwd, (out, q, q, q, out, lse, 0.0, True), {}, grads) == full * 5 // 4
    # not registered into torch: FlopCounterMode's registry is unchanged
    from torch.utils.flop_counter import flop_registry

    assert fwd.overloadpacket not in flop_registry


def test_compute_time_is_the_max_of_three_terms() -> None:
    dev = DeviceSpec(
        name="toy",
        peak_flops={"float32": 1e12, "bfloat16": 4e12},
        memory_bytes=2**30,
        memory_bandwidth=1e11,
        flops_efficiency=0.5,
        memory_efficiency=0.5,
        kernel_overhead=1e-6,
        sources={},
    )
    assert compute_time(1e9, 0, dev, "float32") == pytest.approx(1e9 / 5e11)  # compute-bound: 2 ms
    assert compute_time(1e9, 0, dev, "bfloat16") == pytest.approx(1e9 / 2e12)
    assert compute_time(1e9, 0, dev, "float16") == pytest.approx(1e9 / 5e11)  # unlisted -> float32 peak
    assert compute_time(1e9, 0, dev, torch.bfloat16) == pytest.approx(1e9 / 2e12)
    assert compute_time(1e6, 1e9, dev, "float32") == pytest.approx(1e9 / 5e10)  # memory-bound: 20 ms
    assert compute_time(10, 10, dev, "float32") == 1e-6  # launch floor
