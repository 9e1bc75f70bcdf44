"""``autoshard calibrate``: the ring fit reproduces what it was given, a quick calibration writes a profile that
loads with plausible figures, and the planner plans with it. No timed assertions: the figures only have to be
in physically plausible ranges."""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import replace

import pytest
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.cli import main
from autoshard.cluster.calibrate import calibrate, write_profile
from autoshard.cluster.calibrate_links import COLLECTIVE_KINDS, _axis_groups, fit_ring
from autoshard.cluster.calibration_config import CalibrationConfig
from autoshard.cluster.meshes import fake_world
from autoshard.cluster.presets import get_cluster
from autoshard.cluster.profile import AxisLayout, Link
from autoshard.cost.collectives import algorithm_time
from autoshard.models.mlp import MLP, mlp_example_inputs


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    result = calibrate(CalibrationConfig.quick(ranks=2), name="test-calibrated")
    path = write_profile(result, tmp_path_factory.mktemp("calibrate") / "profile.json")
    return result, path


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
@pytest.mark.parametrize("n", [2, 4])
def test_fit_ring_reproduces_both_measured_times_through_the_cost_model(kind, n):
    small, t_small, large, t_large = 256, 3e-4, 2**20, 2.5e-3
    latency, bandwidth = fit_ring(kind, n, small, t_small, large, t_large)
    assert latency > 0 and bandwidth > 0
    link = Link("fit", bandwidth, latency, "test")
    layout = AxisLayout(n, n, 1)
    assert algorithm_time(kind, small, layout, link, link, "ring") == pytest.approx(t_small, rel=1e-9)
    assert algorithm_time(kind, large, layout, link, link, "ring") == pytest.approx(t_large, rel=1e-9)


def test_fit_ring_stays_positive_when_noise_makes_the_large_message_faster():
    latency, bandwidth = fit_ring("all_reduce", 2, 256, 1e-3, 2**20, 9e-4)
    assert latency > 0 and math.isfinite(bandwidth) and bandwidth > 0


def test_axis_groups_of_a_2x2_mesh_follow_row_major_layout():
    assert _axis_groups((2, 2), 0) == [[0, 2], [1, 3]]
    assert _axis_groups((2, 2), 1) == [[0, 1], [2, 3]]
    assert _axis_groups((2,), 0) == [[0, 1]]


def test_config_rejects_rank_counts_without_a_mesh():
    with pytest.raises(ValueError, match="2 or 4"):
        CalibrationConfig(ranks=3)


def test_quick_calibration_writes_a_profile_that_loads_with_plausible_figures(calibrated):
    result, path = calibrated
    profile = get_cluster(str(path))
    assert profile == result.profile and profile.name == "test-calibrated"
    assert (profile.nodes, profile.devices_per_node) == (1, 2)
    dev = profile.device
    assert 1e8 < dev.peak_flops["float32"] < 1e13
    assert all(0 < f < 1e14 for f in dev.peak_flops.values())
    assert 1e7 < dev.memory_bandwidth < 1e13 and 0 < dev.memory_efficiency <= 1
    assert 0 < dev.flops_efficiency <= 1 and 1e-8 < dev.kernel_overhead < 1e-2
    for link in (profile.intra_node, profile.inter_node, profile.host_link):
        assert link.bandwidth > 1e7 and 1e-7 < link.latency < 1
    today = str(datetime.datetime.now(datetime.timezone.utc).date())
    stamp = f"measured by autoshard calibrate on {today}"
    assert stamp in profile.intra_node.source
    assert all(stamp in s for s in dev.sources.values())
    assert "256x256" in dev.sources["peak_flops"] and "1 MiB" in profile.intra_node.source
    raw = json.loads(path.read_text())["calibration"]
    assert sorted(c["kind"] for c in raw["collectives"]) == sorted(COLLECTIVE_KINDS)
    assert all(0 < c["small_s"] < 1 and c["large_s"] > 0 and c["group_size"] == 2 for c in raw["collectives"])


def test_plan_with_a_calibrated_profile_is_valid_and_uses_its_figures(calibrated):
    result, path = calibrated
    p = result.profile
    slow_link = replace(p.intra_node, latency=p.intra_node.latency * 100, bandwidth=p.intra_node.bandwidth / 100)
    slower = replace(
        p,
        name="slower",
        intra_node=slow_link,
        inter_node=slow_link,
        device=replace(p.device, peak_flops={k: v / 100 for k, v in p.device.peak_flops.items()}),
    )
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        args = (MLP(64, 256, 64), mesh, mlp_example_inputs(32, 64, 64))
        plan = autoshard.plan(*args, cluster=str(path))
        slow = autoshard.plan(*args, cluster=slower)
    assert plan.cluster == "test-calibrated" and len(plan.stages) == 1
    assert math.isfinite(plan.step_time_s) and plan.step_time_s > 0
    assert slow.step_time_s > plan.step_time_s  # the planner prices with the profile's numbers


def test_cli_calibrate_four_ranks_measures_both_mesh_axes(tmp_path, capsys):
    out = tmp_path / "cpu4.json"
    assert main(["calibrate", "--out", str(out), "--ranks", "4", "--quick"]) == 0
    printed = capsys.readouterr().out
    assert "GFLOP/s" in printed and "axis 1 all_gather" in printed
    profile = get_cluster(str(out))
    assert profile.devices_per_node == 4 and profile.intra_node.bandwidth > 1e7
    fits = json.loads(out.read_text())["calibration"]["collectives"]
    assert {(c["axis"], c["kind"]) for c in fits} == {(a, k) for a in (0, 1) for k in COLLECTIVE_KINDS}


@pytest.mark.slow
def test_autoshard_profile_measures_this_machine_into_the_cache(tmp_path, monkeypatch, capsys) -> None:
    """``autoshard profile``: this machine calibrated into the cache that ``cluster=None`` then prices on."""
    from autoshard.cluster import machine

    monkeypatch.setenv("AUTOSHARD_CACHE", str(tmp_path))
    assert main(["profile", "--quick"]) == 0
    out = capsys.readouterr()
    assert "this machine:" in out.out and f"profile written to {machine.profile_path()}" in out.err
    profile = get_cluster(None)
    assert profile.name == "this-machine" and profile.device.peak_flops["float32"] > 1e9
    assert profile.devices_per_node == (4 if machine.usable_cores() >= 4 else 2)
