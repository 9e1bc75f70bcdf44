"""``autoshard.launch``: forked ranks' results in rank order, and a failing or hanging rank reported, not waited on."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from autoshard.launch import LaunchError, launch


def _sum_of_ranks(rank: int, world: int, arg: int) -> int:
    import torch

    t = torch.tensor([rank + arg])
    dist.all_reduce(t)
    return int(t)


def _fails_on_one(rank: int, world: int, arg: None) -> int:
    if rank == 1:
        raise ValueError("boom on the second rank")
    dist.barrier()  # rank 0 would wait here for ever: the launcher must stop it
    return rank


def _sleeps(rank: int, world: int, arg: None) -> None:
    time.sleep(60)


def test_results_come_back_in_rank_order_from_one_gloo_group() -> None:
    assert launch(2, _sum_of_ranks, 10, timeout=60, gloo=True) == [21, 21]


def test_the_failing_rank_is_named_and_its_peers_stopped() -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1: ValueError: boom on the second rank") as e:
        launch(2, _fails_on_one, None, timeout=60, gloo=True)
    assert "Traceback" in e.value.detail and time.monotonic() - t0 < 30


def test_a_hung_launch_is_stopped_at_its_timeout() -> None:
    with pytest.raises(LaunchError, match="timed out after 2 s"):
        launch(1, _sleeps, None, timeout=2, gloo=False)
