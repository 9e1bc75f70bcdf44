"""Cluster profiles (host link, axis layout, mesh check) and per-algorithm collective costs: pure arithmetic.

Hand-computed numbers use the h100-sxm preset: NVLink4 a_i = 3 us, B_i = 450 GB/s; NDR InfiniBand a_e = 5 us,
B_e = 50 GB/s per GPU; 8 GPUs per node.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.cluster.presets import get_cluster, known_clusters
from autoshard.cluster.profile import AxisLayout, ClusterProfile, check_mesh
from autoshard.cost.collectives import ALGORITHMS, algorithm_time, applicable_algorithms
from autoshard.cost.comm import (
    CollectiveStep,
    axis_collective,
    axis_collective_time,
    collective_time,
    redistribute_steps,
)

A_I, B_I, A_E, B_E = 3e-6, 450e9, 5e-6, 50e9
MIB = 2**20
H100 = get_cluster("h100-sxm:16x8")


# --- profiles --------------------------------------------------------------------------------------------------


def test_sized_profile_and_preset_links() -> None:
    assert (H100.nodes, H100.devices_per_node, H100.num_devices()) == (16, 8, 128)
    assert (H100.intra_node.latency, H100.intra_node.bandwidth) == (A_I, B_I)
    assert (H100.inter_node.latency, H100.inter_node.bandwidth) == (A_E, B_E)
    assert H100.host_link.name == "pcie-gen5-x16" and H100.host_link.bandwidth == 64e9
    assert get_cluster("h200:2x8").host_link.bandwidth == 64e9
    assert get_cluster("a100-80gb").host_link.bandwidth == 32e9
    cpu = get_cluster("cpu")
    assert cpu.host_link.bandwidth == cpu.device.memory_bandwidth / 2  # a copy reads and writes every byte
    for name in known_clusters():
        link = get_cluster(name).host_link
        assert link is not None and link.source and "host_link" not in link.source  # a real number, not a default


def test_json_round_trip_keeps_host_link(tmp_path) -> None:
    path = tmp_path / "h100.json"
    path.write_text(json.dumps(H100.to_dict()))
    loaded = get_cluster(str(path))
    assert loaded == H100 and loaded.host_link == H100.host_link
    assert json.loads(path.read_text())["host_link"]["bandwidth"] == 64e9


def test_old_dict_without_host_link_loads_with_a_stated_default() -> None:
    old = H100.to_dict()
    del old["host_link"]
    loaded = ClusterProfile.from_dict(old)
    assert loaded.host_link.bandwidth == 32e9 and "default" in loaded.host_link.source
    assert (loaded.intra_node, loaded.inter_node, loaded.device) == (H100.intra_node, H100.inter_node, H100.device)
    # a CPU profile's default is capped at its own memcpy rate
    old_cpu = get_cluster("cpu").to_dict()
    del old_cpu["host_link"]
    cpu = ClusterProfile.from_dict(old_cpu)
    assert cpu.host_link.bandwidth == cpu.device.memory_bandwidth / 2 and "default" in cpu.host_link.source
    # and the constructor still takes the six fields it always took
    six = ClusterProfile("x", H100.device, 8, 2, H100.intra_node, H100.inter_node)
    assert six.host_link == loaded.host_link


# --- axis layout -----------------------------------------------------------------------------------------------


def test_axis_layout_on_16x8() -> None:
    # (16, 8): tp on NVLink inside each node, dp across the 16 nodes one device per node
    assert H100.axis_layout((16, 8), 1) == AxisLayout(size=8, per_node=8, nodes=1)
    assert H100.axis_link((16, 8), 1) == H100.intra_node
    assert H100.axis_layout((16, 8), 0) == AxisLayout(size=16, per_node=1, nodes=16)
    assert H100.axis_link((16, 8), 0) == H100.inter_node
    # (4, 32): the inner axis spans 4 nodes with 8 devices in each -> hierarchical applies
    assert H100.axis_layout((4, 32), 1) == AxisLayout(32, 8, 4)
    assert H100.axis_layout((4, 32), 0) == AxisLayout(4, 1, 4)
    assert "hierarchical" in applicable_algorithms("all_reduce", H100.axis_layout((4, 32), 1))
    assert "hierarchical" not in applicable_algorithms("all_reduce", H100.axis_layout((16, 8), 0))
    # one flat axis over everything
    assert H100.axis_layout((128,), 0) == AxisLayout(128, 8, 16)
    assert H100.axis_layout((128,), -1) == AxisLayout(128, 8, 16)
    # inner axes of 2: (64, 2) puts 4 devices of axis 0 in each node
    assert H100.axis_layout((64, 2), 0) == AxisLayout(64, 4, 16)
    assert H100.axis_layout((8, 2, 8), 1) == AxisLayout(2, 1, 2)
    assert H100.axis_layout((8, 2, 8), 2) == AxisLayout(8, 8, 1)
    # sub-meshes smaller than the cluster are fine (the planner prices them)
    assert H100.axis_layout((2, 2), 0) == AxisLayout(2, 2, 1)
    with pytest.raises(ValueError, match="out of range"):
        H100.axis_layout((16, 8), 2)


def test_check_mesh_names_both_counts_and_the_fix() -> None:
    check_mesh(H100, (16, 8))
    check_mesh(H100, (128,))
    with pytest.raises(ValueError) as info:
        check_mesh(get_cluster("h100-sxm"), (4, 8))
    text = str(info.value)
    assert "32 devices" in text and "has 8" in text and "NAME:NODESxPER_NODE" in text and "'h100-sxm:4x8'" in text
    with pytest.raises(ValueError, match="'h100-sxm:1x3'"):
        check_mesh(H100, (3,))
    with pytest.raises(ValueError, match="every size >= 1"):
        check_mesh(H100, (0, 8))


# --- collective costs, by hand ---------------------------------------------------------------------------------


def test_ring_all_gather_by_hand() -> None:
    b = 64 * MIB
    # intra-node axis (8 devices on NVLink): the plain ring on one link
    intra = 7 * A_I + b * 7 / 8 / B_I
    assert axis_collective("all_gather", b, (16, 8), 1, H100) == ("ring", pytest.approx(intra))
    assert collective_time("all_gather", b, 8, H100.intra_node) == pytest.approx(intra)
    # 16 nodes, one device each: every hop is an IB hop, B_e per device (as before this change)
    inter = 15 * A_E + b * 15 / 16 / B_E
    assert axis_collective_time("all_gather", b, (16, 8), 0, H100, "ring") == pytest.approx(inter)
    assert collective_time("all_gather", b, 16, H100.inter_node) == pytest.approx(inter)


def test_ring_all_reduce_by_hand() -> None:
    b = 256 * MIB
    # (128,): 112 NVLink steps + 15 IB steps per pass; 8 rings leave each node through 8 NICs:
    # min(8 * 50, 8 * 450 / 7) = 400 GB/s
    one_pass = 112 * A_I + 15 * A_E + b * 127 / 128 / 400e9
    assert axis_collective_time("all_reduce", b, (128,), 0, H100, "ring") == pytest.approx(2 * one_pass)
    # A100 (HDR 25 GB/s per GPU): min(8 * 25, 8 * 300 / 7) = 200 GB/s
    a100 = get_cluster("a100-80gb:16x8")
    one_pass = 112 * 3e-6 + 15 * 5e-6 + b * 127 / 128 / 200e9
    assert axis_collective_time("all_reduce", b, (128,), 0, a100, "ring") == pytest.approx(2 * one_pass)


def test_tree_all_reduce_small_message_by_hand() -> None:
    b = 4096
    # latency: chain of 8 inside each node, binary tree over 16 nodes (depth log2 16 = 4), up and back down;
    # up and down; bytes: 2b at 0.9 (NCCL's tree factor) of the 400 GB/s the 8 NICs give
    tree = 2 * (7 * A_I + 4 * A_E) + 2 * b / (0.9 * 400e9)
    assert axis_collective_time("all_reduce", b, (128,), 0, H100, "tree") == pytest.approx(tree)
    # one device per node: no chain, depth 4 over IB at 0.9 * B_e
    tree = 2 * (4 * A_E) + 2 * b / (0.9 * B_E)
    assert axis_collective_time("all_reduce", b, (16, 8), 0, H100, "tree") == pytest.approx(tree)


def test_hierarchical_by_hand() -> None:
    b = 64 * MIB
    # (4, 32) axis 1: m = 8 per node, k = 4 nodes. RS over 8 on NVLink, AR over 4 on IB with b/8, AG over 8.
    local = 7 * A_I + b * 7 / 8 / B_I
    network = 3 * A_E + (b / 8) * 3 / 4 / B_E
    assert axis_collective_time("all_reduce", b, (4, 32), 1, H100, "hierarchical") == pytest.approx(
        2 * local + 2 * network
    )
    assert axis_collective_time("all_gather", b, (4, 32), 1, H100, "hierarchical") == pytest.approx(local + network)
    assert axis_collective_time("reduce_scatter", b, (4, 32), 1, H100, "hierarchical") == pytest.approx(local + network)
    # all_to_all (NCCL): each device sends b/n**2 to each peer at once, 7 over NVLink and 24 through its own NIC
    assert axis_collective("all_to_all", b, (4, 32), 1, H100) == (
        "pairwise",
        pytest.approx(7 * A_I + 24 * A_E + b * max(7 / B_I, 24 / B_E) / 32**2),
    )
    gloo_like = replace(H100, all_to_all="ring")  # gathered whole on the network link
    assert axis_collective("all_to_all", b, (4, 32), 1, gloo_like) == (
        "ring",
        pytest.approx(collective_time("all_to_all", b, 32, H100.inter_node, "ring")),
    )


# --- auto ------------------------------------------------------------------------------------------------------


def test_auto_picks_tree_for_tiny_and_ring_for_big() -> None:
    for mesh, axis in (((128,), 0), ((16, 8), 0), ((4, 32), 1)):
        assert axis_collective("all_reduce", 4096, mesh, axis, H100)[0] == "tree"
        assert axis_collective("all_reduce", 2**32, mesh, axis, H100)[0] in ("ring", "hierarchical")
    # inside one node the chain has the ring's latency and more bytes: never chosen
    for nbytes in (0, 4096, 2**30):
        assert axis_collective("all_reduce", nbytes, (16, 8), 1, H100)[0] == "ring"


def test_auto_hierarchical_all_gather_for_mid_sizes() -> None:
    # (4, 32) axis 1: ring pays 28 NVLink + 3 IB steps, hierarchical 7 + 3; ring has more bandwidth at size
    assert axis_collective("all_gather", 1 * MIB, (4, 32), 1, H100)[0] == "hierarchical"
    assert axis_collective("all_gather", 4 * 2**30, (4, 32), 1, H100)[0] == "ring"


def test_auto_is_the_cheapest_applicable() -> None:
    for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        for mesh, axis in (((128,), 0), ((4, 32), 1), ((4, 32), 0), ((16, 8), 1), ((1, 128), 0)):
            layout = H100.axis_layout(mesh, axis)
            for nbytes in (0, 1000, 10 * MIB, 2**32):
                times = {
                    a: algorithm_time(kind, nbytes, layout, H100.intra_node, H100.inter_node, a)
                    for a in applicable_algorithms(kind, layout)
                }
                name, t = axis_collective(kind, nbytes, mesh, axis, H100)
                assert t == min(times.values()) and times[name] == t
                assert set(times) <= set(ALGORITHMS)
    assert axis_collective("all_reduce", 2**30, (1, 128), 0, H100) == ("ring", 0.0)


def test_bad_algorithms_raise() -> None:
    with pytest.raises(ValueError, match="all_reduce only"):
        axis_collective_time("all_gather", 1024, (128,), 0, H100, "tree")
    with pytest.raises(ValueError, match="applicable: ring, tree"):
        axis_collective_time("all_reduce", 1024, (16, 8), 1, H100, "hierarchical")
    with pytest.raises(ValueError, match="unknown collective algorithm 'nvls'"):
        axis_collective_time("all_reduce", 1024, (16, 8), 1, H100, "nvls")
    with pytest.raises(ValueError, match="unknown collective kind"):
        axis_collective_time("broadcast", 1024, (16, 8), 1, H100)


# --- redistribution uses the per-axis choice -------------------------------------------------------------------


def test_redistribute_steps_use_the_cheapest_algorithm() -> None:
    small = redistribute_steps([Partial()], [Replicate()], (1024,), 4, (128,), H100)
    assert [(s.kind, s.algorithm) for s in small] == [("all_reduce", "tree")]
    assert small[0].time == pytest.approx(2 * (7 * A_I + 4 * A_E) + 2 * 4096 / (0.9 * 400e9))
    big = redistribute_steps([Partial()], [Replicate()], (2**30,), 4, (128,), H100)  # 4 GiB
    assert [(s.kind, s.algorithm) for s in big] == [("all_reduce", "ring")]
    mid = redistribute_steps([Replicate(), Shard(0)], [Replicate(), Replicate()], (2**18,), 4, (4, 32), H100)
    assert mid == (CollectiveStep("all_gather", 1, MIB, mid[0].time, "hierarchical"),)
    # the old four-field constructor still works and means a ring
    assert CollectiveStep("all_gather", 0, 8, 1.0) == CollectiveStep("all_gather", 0, 8, 1.0, "ring")
