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
