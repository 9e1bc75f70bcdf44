"""A step that raises on one rank ends every rank with that error, in bounded time (issue 32 part 3).

Two gloo ranks train the zoo GPT (``autoshard.compile``, data parallel); one of them is made to raise during a step,
the other goes on into the step's collectives. Without ``runtime/rank_failures.py`` the other rank waits there until
gloo's timeout (30 minutes by default) while the failing process lives on (it does here, for longer than the bound),
and then fails with the transport's error, which does not say which rank failed or why. Each rank catches what
its step raised and returns it with the seconds from the failing rank's raise, so that both outcomes are checked
(``launch`` would stop at the first)."""

from __future__ import annotations

import time

import pytest
from numerics_utils import MODELS

from autoshard.testing.launch import launch

BOUND_S = 10.0  # what "bounded" means here: far below gloo's 30-minute timeout, far above a step on 2 cores


def _worker(rank: int, world: int, how: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import autoshard

    make, inputs_fn = MODELS["gpt"]
    ids, labels = inputs_fn()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    sharded = autoshard.compile(make(), mesh, (ids, labels), backend="eager", constraints={"inputs": {"dp": Shard(0)}})
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    raised_at = torch.zeros(1, dtype=torch.float64)
    if how == "hook" and rank == 1:  # raises in the backward of the second step, after its gradients' collectives
        calls = []

        def hook(grad):
            calls.append(1)
            if len(calls) == 2:
                raised_at[0] = time.time()
                raise RuntimeError("injected failure in a gradient hook")
            return grad

        next(iter(sharded.parameters())).register_hook(hook)
    out = {"steps": 0}
    try:
        for step in range(4):
            if how == "dtype" and rank == 1 and step == 1:  # this rank's labels come as int32
                raised_at[0] = time.time()
                sharded.step(ids, labels.int())
            else:
                sharded.step(ids, labels)
            opt.step()
            opt.zero_grad()
            out["steps"] += 1
    except Exception as e:  # noqa: BLE001 - returned for the test to check
        out.update(
            error=type(e).__name__,
            message=str(e),
            at=time.time(),
            failed_rank=getattr(e, "rank", None),
            group_closed=not dist.is_initialized(),
        )
        out["raised_at"] = float(raised_at[0])
        if how == "dtype" and rank == 1:  # the failing process lives on (a notebook, a retry loop): its closed
            time.sleep(BOUND_S + 2)  # connections, not its exit, must end the others' wait
    return out


@pytest.mark.parametrize("how", ["dtype", "hook"])
def test_an_exception_on_one_rank_ends_every_rank_with_it(how: str) -> None:
    results = launch(2, _worker, how, timeout=240)
    failing, other = results[1], results[0]
    # the failing rank raises its own error, unchanged
    if how == "dtype":
        assert failing["error"] == "InputError" and "got i32[4, 16]" in failing["message"], failing
    else:
        assert failing["error"] == "RuntimeError" and "injected failure" in failing["message"], failing
    # the other rank stops with RankFailed, naming rank 1 and its error, soon after it
    assert other["error"] == "RankFailed", other
    assert other["failed_rank"] == 1 and "rank 1 raised" in other["message"], other
    assert failing["error"] in other["message"] and "process group is closed" in other["message"], other
    assert other["at"] - failing["raised_at"] < BOUND_S, (other["at"], failing["raised_at"])
    assert failing["group_closed"] and other["steps"] <= 2
