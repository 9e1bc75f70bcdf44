"""``cluster=None`` prices on this machine's measured profile when ``autoshard profile`` has cached one, else on
this machine's memory at the ``"cpu"`` preset's rates, with a warning that says so (``autoshard/cluster/machine.py``);
the cache is keyed by the machine, so another machine's profile is never used."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autoshard.cli import main
from autoshard.cluster import machine
from autoshard.cluster.presets import get_cluster


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSHARD_CACHE", str(tmp_path))
    machine._warn_reference.cache_clear()
    yield tmp_path
    machine._warn_reference.cache_clear()


@pytest.fixture
def said(monkeypatch) -> list[str]:
    """What ``cluster/machine.py`` warns (through ``messages.warn``, whatever the logging set-up and rank)."""
    out: list[str] = []
    monkeypatch.setattr(machine, "warn", lambda log, fmt, *args: out.append(fmt % args))
    return out


def test_without_a_profile_this_machines_memory_at_the_cpu_presets_rates_is_used_and_said(
    cache, said, capsys, monkeypatch
) -> None:
    big = {**machine.machine_identity(), "memory": 512 * 2**30}  # a machine unlike the one the preset measured
    monkeypatch.setattr(machine, "machine_identity", lambda: big)
    preset, got = get_cluster("cpu"), get_cluster(None)
    assert got.device.memory_bytes == 512 * 2**30 // preset.devices_per_node != preset.device.memory_bytes
    assert big["cpu"] in got.device.name and "512.0 GiB" in got.device.sources["memory_bytes"]
    same = ("peak_flops", "memory_bandwidth", "flops_efficiency", "memory_efficiency", "kernel_overhead")
    assert all(getattr(got.device, f) == getattr(preset.device, f) for f in same)
    assert (got.intra_node, got.inter_node, got.host_link) == (preset.intra_node, preset.inter_node, preset.host_link)
    get_cluster(None)  # (once per process)
    get_cluster("cpu")  # (named: no warning)
    (message,) = said
    assert "has no measured profile, so plans are priced on its memory at the 'cpu' preset's rates" in message
    assert "512 GiB" in message and preset.device.name in message
    assert "run `autoshard profile` once" in message
    assert main(["profile", "--show"]) == 1
    assert "not profiled yet" in capsys.readouterr().out


def test_a_cached_profile_of_this_machine_is_what_cluster_none_prices(cache, said, capsys, monkeypatch) -> None:
    mine = dataclasses.replace(get_cluster("cpu"), name="this-machine")
    path = machine.profile_path()
    assert path.parent == cache
    path.write_text(json.dumps(mine.to_dict()))
    assert get_cluster(None).name == "this-machine"
    assert not said
    assert main(["profile", "--show"]) == 0
    assert f"profile {path}: 8 ranks" in capsys.readouterr().out
    # another machine (here: this one with other cores) has another key: it does not read this profile
    other = {**machine.machine_identity(), "cores": 999}
    monkeypatch.setattr(machine, "machine_identity", lambda: other)
    assert machine.profile_path() != path
    assert get_cluster(None).name == "cpu" and "at the rates of" in get_cluster(None).device.name
    assert "has no measured profile" in said[0]
