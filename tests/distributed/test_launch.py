"""``autoshard.testing.launch``: forked ranks' results in rank order, and a failing, dying or hanging rank reported (its
rank, its traceback), not waited on."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from autoshard.cluster.meshes import fake_world
from autoshard.errors import LaunchError
from autoshard.testing.launch import launch


def _sum_of_ranks(rank: int, world: int, arg: int) -> int:
    t = torch.tensor([rank + arg])
    dist.all_reduce(t)
    return int(t)


def _all_reduce_rank(rank: int, world_size: int, arg: object) -> torch.Tensor:
    t = torch.tensor([float(rank + 1), 10.0 * rank])
    dist.all_reduce(t)
    return t


def _raise_on_rank_1(rank: int, world: int, arg: object) -> int:
    if rank == 1:
        raise ValueError(f"boom {arg}")
    dist.barrier()  # rank 0 would wait here for ever: the launcher must stop it
    return rank


def _killed_on_rank_1(rank: int, world: int, arg: None) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a native death: no Python exception, no error file
    dist.barrier()
    return rank


def _aborts_on_rank_1(rank: int, world: int, arg: None) -> int:
    if rank == 1:
        os.abort()  # what a native abort ("malloc(): ... corrupted", a failed C++ check) does
    dist.barrier()
    return rank


def _sleeps(rank: int, world: int, arg: None) -> None:
    time.sleep(60)


def test_results_come_back_in_rank_order_from_one_gloo_group() -> None:
    assert launch(2, _sum_of_ranks, 10, timeout=60, gloo=True) == [21, 21]


def test_tensors_come_back_and_gloo_is_the_default() -> None:
    out = launch(2, _all_reduce_rank)
    assert len(out) == 2
    for t in out:
        torch.testing.assert_close(t, torch.tensor([3.0, 10.0]))


def test_the_failing_rank_is_named_with_its_traceback_and_its_peers_stopped() -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1: ValueError: boom xyz") as info:
        launch(2, _raise_on_rank_1, "xyz", timeout=60)
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 1
    msg = str(info.value)
    assert "rank 1" in msg and "ValueError" in msg and "boom xyz" in msg and "\n" not in msg  # one line
    assert "Traceback" in info.value.detail
    assert "_raise_on_rank_1" in info.value.detail  # the worker's traceback text is included
    assert "_raise_on_rank_1" in str(info.value.__cause__)  # and shown in a test's failure report


def test_a_rank_that_dies_without_a_python_exception_is_the_cause() -> None:
    with pytest.raises(LaunchError, match=r"rank 1: died without a Python exception \(killed by SIGKILL\)") as info:
        launch(2, _killed_on_rank_1, timeout=60)
    assert info.value.rank == 1


def test_a_native_abort_reports_the_python_stack_it_died_in() -> None:
    with pytest.raises(LaunchError, match=r"rank 1: died without a Python exception \(killed by SIGABRT\)") as info:
        launch(2, _aborts_on_rank_1, timeout=60)
    assert "rank 1's Python stacks" in info.value.detail
    assert "_aborts_on_rank_1" in info.value.detail  # faulthandler's stack names the function it aborted in


def test_a_hung_launch_is_stopped_at_its_timeout() -> None:
    with pytest.raises(LaunchError, match="timed out after 2 s") as info:
        launch(1, _sleeps, None, timeout=2, gloo=False)
    assert info.value.rank is None


def test_gloo_ranks_are_not_forked_from_a_process_with_a_group() -> None:
    with fake_world(2), pytest.raises(RuntimeError, match="has a default process group"):
        launch(2, _sum_of_ranks, 0)
    with pytest.raises(ValueError, match="world must be >= 1"):
        launch(0, _sum_of_ranks, 0)
