"""Random next-token batches for the language models (no data set is downloaded)."""

from __future__ import annotations

import torch
from torch import Tensor

from autoshard.errors import InputError


def next_token_batch(
    vocab: int, max_seq: int, batch: int, seq: int | None = None, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """Random ``(tokens, targets)`` of shape (batch, seq), int64, drawn from a private generator.

    ``targets`` is ``tokens`` shifted left by one, with a fresh random last column.
    """
    t = max_seq if seq is None else seq
    if t > max_seq:
        raise InputError(f"seq={t} exceeds the model's seq_len={max_seq}")
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (batch, t + 1), generator=g, dtype=torch.long)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()
