"""The CLI's numeric flags: a bad value ends in one line naming the flag and the valid range, exit status 2, no
traceback and nothing planned (``autoshard/cli.py``)."""

from __future__ import annotations

import pytest

from autoshard.cli import main

PLAN = ["plan", "--model", "llama3-8b", "--cluster", "h100-sxm:1x8", "--global-batch", "8"]

BAD = [
    (["--seq", "-5"], "argument --seq: -5 is out of range: give a whole number >= 1"),
    (["--seq", "0"], "argument --seq: 0 is out of range: give a whole number >= 1"),  # (was planned at 8192)
    (["--seq", "8k"], "argument --seq: '8k' is not a whole number >= 1"),
    (["--global-batch", "0"], "argument --global-batch: 0 is out of range: give a whole number >= 1"),
    (["--microbatches", "-2"], "argument --microbatches: -2 is out of range: give a whole number >= 1"),
    (["--time-limit", "0"], "argument --time-limit: 0 is out of range: give a number > 0.0"),
    (["--time-limit", "nan"], "argument --time-limit: nan is out of range: give a number > 0.0"),
    (["--sample-layers", "-1"], "argument --sample-layers: -1 is out of range: give a whole number >= 0"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[" ".join(e) for e, _ in BAD])
def test_a_bad_number_is_refused_naming_the_flag_and_its_range(extra, message, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main([*PLAN, *extra])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"autoshard plan: error: {message}"
    assert "Traceback" not in err


def test_calibrate_threads_are_checked_too(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["calibrate", "--out", "x.json", "--threads", "0"])
    assert stop.value.code == 2
    assert "argument --threads: 0 is out of range: give a whole number >= 1" in capsys.readouterr().err


@pytest.fixture
def no_capture(monkeypatch):
    """Fail the test if anything is captured: a budget below the state floor is refused before."""

    def refuse(*a, **k):
        raise AssertionError("captured a model whose budget the state floor refuses")

    monkeypatch.setattr("autoshard.compiler.runner.capture_model", refuse)


FLOOR = ["plan", "--model", "llama3-70b", "--cluster", "h100-sxm:2x8", "--global-batch", "64", "-q"]


def test_a_budget_under_the_state_floor_is_refused_before_any_capture_naming_only_fixes_that_help(
    no_capture, capsys
) -> None:
    """70B on 16 H100s at 5 GB: even its parameters alone (131 GiB over 16 devices, 8.2 GiB each) exceed it, so
    the fixes are devices (29, in whole nodes of 8) or a bigger budget, never a smaller batch or offload."""
    assert main([*FLOOR, "--memory-per-device", "5GB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "llama3-70b cannot train on 16 x 4.66 GiB: even with its gradients and optimizer state in host memory" in err
    assert "needs 8.21 GiB per device before any activation" in err
    assert "Use at least 29 devices (e.g. cluster 'h100-sxm:4x8', 32), or raise the budget" in err
    assert "offload=" not in err and "a smaller batch, a shorter sequence" in err and "cannot help" in err


def test_without_offload_the_floor_is_the_whole_state_and_offload_is_named_when_it_would_hold_it(
    no_capture, capsys
) -> None:
    """--offload none at 20 GB: the whole state (526 GiB) over 16 is 32.9 GiB; offloading leaves 8.2 GiB, under the
    budget, so offload is one of the fixes. On a CPU cluster (host memory is the device's) it is not."""
    assert main([*FLOOR, "--memory-per-device", "20GB", "--offload", "none"]) == 2
    err = capsys.readouterr().err
    assert "its training state (131.4 GiB of parameters; 525.7 GiB with gradients and adamw state)" in err
    assert "needs 32.9 GiB per device" in err and "at least 29 devices" in err
    assert "or offload='params' (--offload params)" in err and "8.21 GiB of parameters per device" in err
    cpu = ["plan", "--model", "gpt2-124m", "--cluster", "cpu", "--global-batch", "8", "-q"]
    assert main([*cpu, "--memory-per-device", "100MB"]) == 2
    err = capsys.readouterr().err
    assert "gpt2-124m cannot train on 8 x 95.4 MiB: its training state" in err and "offload" not in err
