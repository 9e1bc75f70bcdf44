"""``cluster=None`` prices on this machine's measured profile when ``autoshard profile`` has cached one, else on
the ``"cpu"`` preset with a warning that says so (``autoshard/cluster/machine.py``); the cache is keyed by the
machine, so another machine's profile is never used."""

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
    return tmp_path


def _warned(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == machine.__name__]


def test_without_a_profile_the_cpu_preset_is_used_and_said(cache, capsys, caplog) -> None:
    with caplog.at_level("WARNING"):
        assert get_cluster(None) == get_cluster("cpu")
        get_cluster(None)  # (once per process)
        get_cluster("cpu")  # (named: no warning)
    (said,) = _warned(caplog)
    assert "has no measured profile, so plans are priced on the 'cpu' preset" in said
    assert "run `autoshard profile` once" in said
    assert main(["profile", "--show"]) == 1
    assert "not profiled yet" in capsys.readouterr().out


def test_a_cached_profile_of_this_machine_is_what_cluster_none_prices(cache, capsys, monkeypatch, caplog) -> None:
    mine = dataclasses.replace(get_cluster("cpu"), name="this-machine")
    path = machine.profile_path()
    assert path.parent == cache
    path.write_text(json.dumps(mine.to_dict()))
    with caplog.at_level("WARNING"):
        assert get_cluster(None).name == "this-machine"
    assert not _warned(caplog)
    assert main(["profile", "--show"]) == 0
    assert f"profile {path}: 8 ranks" in capsys.readouterr().out
    # another machine (here: this one with other cores) has another key: it does not read this profile
    other = {**machine.machine_identity(), "cores": 999}
    monkeypatch.setattr(machine, "machine_identity", lambda: other)
    assert machine.profile_path() != path
    with caplog.at_level("WARNING"):
        assert get_cluster(None).name == "cpu"
    assert "has no measured profile" in _warned(caplog)[0]
