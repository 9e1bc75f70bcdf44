"""Warnings about a plan or a run, said by rank 0 only: every rank of a real process group plans and lowers the
same program, so every rank would say the same thing (a 64-rank job printed each warning 64 times).

``warn(log, fmt, *args)`` takes what ``log.warning`` takes. Other ranks log the message at DEBUG, so ``-v``
logging on a rank still shows it. A fake process group (planning for a cluster) and LocalTensorMode run in one
process, which is rank 0. Warnings that are rank-specific (a rank's own input, its own failure) use
``log.warning`` directly.
"""

from __future__ import annotations

import logging

import torch.distributed as dist


def _rank() -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank()


def warn(log: logging.Logger, fmt: str, *args: object) -> bool:
    """Log ``fmt % args`` at WARNING on rank 0 (DEBUG elsewhere); returns whether it was a warning."""
    if _rank() != 0:
        log.debug("(rank 0 warns) " + fmt, *args)
        return False
    log.warning(fmt, *args)
    return True
