"""Distributed checkpoint internals: consolidating a sharded Hugging Face safetensors checkpoint."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch.distributed as dist

log = logging.getLogger(__name__)


def consolidate_safetensors(input_dir: str, output_dir: str, fqn_to_index: Mapping[str, int]) -> None:
    """Whole-tensor safetensors files (``model-0000k-of-0000n.safetensors``, by ``fqn_to_index``) and their
    ``model.safetensors.index.json`` from the per-rank shard files DCP's ``HuggingFaceStorageWriter`` wrote with
    ``save_distributed=True``. Every rank takes part (each writes its own output files) where torch has
    ``consolidate_safetensors_files_on_every_rank``; otherwise rank 0 writes them all."""
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as cons

    every = getattr(cons, "consolidate_safetensors_files_on_every_rank", None)
    if every is not None and dist.is_initialized():
        every(input_dir, output_dir, dict(fqn_to_index))
        return
    if dist.is_initialized():
        dist.barrier()
        if dist.get_rank() != 0:
            return
    cons.consolidate_safetensors_files(input_dir, output_dir, fqn_to_index_mapping=dict(fqn_to_index))
