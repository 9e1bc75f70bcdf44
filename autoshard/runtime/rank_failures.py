"""A step that raises on one rank ends every rank, with that rank's error, instead of a hang.

The ranks of a step meet in its collectives. When one rank raises (its batch is not the shape the plan was made
for, its device runs out of memory, a user hook throws), the others wait in their next collective for a peer that
never comes: gloo's default timeout is 30 minutes. ``one_fails_all(what, mesh)`` wraps a step on every rank:

- the rank that raises writes its error into the process group's store (``autoshard/failed/<rank>``) and ends its
  process groups (aborted, then destroyed): its connections close, so a peer waiting for it
  fails at once ("Connection closed by peer"), not at the timeout. It then re-raises its own error;
- a rank whose step then fails reads the store and raises :class:`~autoshard.errors.RankFailed`, naming the first
  failing rank and its error, from its own collective's error. autoshard's own refusals (``AutoshardError``: a call
  not shaped as traced, ...) are each rank's own, raised as they are: a misuse on every rank says what is wrong on
  every rank.

The process group cannot be used after that on any rank (a step cut short leaves the ranks' collectives out of
step): re-initialize it to go on. A rank that dies without a Python exception (a signal, a native abort) leaves no
entry; its peers see the transport's error as it is. One process simulating every rank (``LocalTensorMode``) or no
process group: nothing to do.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autoshard import _torch_compat as tc
from autoshard.errors import AutoshardError, RankFailed

log = logging.getLogger(__name__)

__all__ = ["one_fails_all"]

_KEY = "autoshard/failed/"
_MAX_MESSAGE = 800


@contextlib.contextmanager
def one_fails_all(what: str, mesh: DeviceMesh | None) -> Iterator[None]:
    """Run ``what`` (a step, a forward) on ``mesh`` so that an exception on one rank ends every rank (module
    docstring)."""
    if not _shared_world():
        yield
        return
    store = tc.default_store()  # held here: a store hosted by this rank stays up for the peers to read
    try:
        yield
    except RankFailed:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised as it is, after telling the peers
        if getattr(e, "_autoshard_told", False):  # an inner step (a forward inside a step) told them already
            raise
        # autoshard's own refusals (a call not shaped as traced, ...) are this rank's; another error after a peer
        # recorded its failure is that failure's consequence (the transport's "Connection closed by peer")
        failed = None if isinstance(e, AutoshardError) else _first_failure(store)
        if failed is not None:
            rank, message = failed
            raise RankFailed(
                f"rank {rank} raised during {what}, so this rank ({dist.get_rank()}) stopped too: {message}. The "
                "process group is closed; re-initialize it to go on",
                rank=rank,
            ) from e
        _announce(store, e, what, mesh)
        e._autoshard_told = True  # type: ignore[attr-defined]
        raise


def _shared_world() -> bool:
    """Several processes in a real process group (not simulated ranks, not a fake group for planning)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return False
    return dist.get_backend() != "fake" and not tc.in_local_tensor_mode()


def _announce(store: object | None, error: BaseException, what: str, mesh: DeviceMesh | None) -> None:
    """Tell the peers (the store) and close this rank's connections, so that they stop waiting for it."""
    rank = dist.get_rank()
    message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:_MAX_MESSAGE]
    if store is not None:
        try:
            store.set(f"{_KEY}{rank}", message)
        except Exception as e:  # noqa: BLE001 - the store went first; the peers still see the closed connections
            log.debug("could not record rank %d's failure in the store: %s", rank, e)
    log.error("rank %d raised during %s (%s); closing the process group so that every rank stops", rank, what, message)
    tc.abort_process_groups([mesh] if mesh is not None else [])


def _first_failure(store: object | None) -> tuple[int, str] | None:
    """The lowest rank that recorded a failure, and its message (None when none did)."""
    if store is None:
        return None
    try:
        for rank in range(dist.get_world_size()):
            key = f"{_KEY}{rank}"
            if store.check([key]):
                return rank, store.get(key).decode(errors="replace")
    except Exception as e:  # noqa: BLE001 - the store is gone with the failing rank: nothing to name
        log.debug("could not read the failures from the store: %s", e)
    return None
