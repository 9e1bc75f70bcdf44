"""Activation recomputation (checkpointing) of chosen modules: which forward ops the backward runs again.

``tag_recompute`` marks every forward op that ran inside one of the named modules (``PlanConfig.recompute``:
module paths such as ``"layers.3"``, or a container such as ``"layers"`` for all of its layers) with torch's
``CheckpointPolicy.PREFER_RECOMPUTE`` in ``meta["recompute"]``, as ``torch.utils.checkpoint``'s selective
policies do, except ops that draw random numbers (attention with dropout), which are saved. The tag travels:

- into the costs: ``strategies`` counts a tagged op's outputs as not saved (only what the backward cannot
  recompute, the module's inputs, stays) and its forward compute twice;
- into ``share_layers``: a recomputed layer is not identical to one that is not;
- into this rank's program: ``lower`` traces each op with its global node's metadata, so the lowered ops (the
  collectives a recomputed op needs included) carry the tag, and torch's partitioner saves none of them and
  replays them in the backward (``passes/partition.py``).

Part of capture (not a pass of its own): it runs on the captured graph before ``coarsen``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.fx as fx

from autoshard import _torch_compat as tc

log = logging.getLogger(__name__)


def _inside(module: str, prefixes: Sequence[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def tag_recompute(gm: fx.GraphModule, prefixes: Sequence[str], modules: Sequence[str]) -> int:
    """Tag the forward ops run inside ``prefixes`` (see the module docstring); ``modules`` are the model's module
    paths, to refuse a prefix that names none. Returns how many ops were tagged."""
    if not prefixes:
        return 0
    unknown = [p for p in prefixes if not any(_inside(m, [p]) for m in modules)]
    if unknown:
        raise ValueError(f"recompute={list(prefixes)}: {unknown} name no module of the model; give module paths "
                         f"such as {[m for m in modules if m.count('.') == 1][:3]} or a container of layers")
    tagged = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.meta.get("autoshard_phase") != "forward":
            continue
        if _inside(n.meta.get("autoshard_module", ""), prefixes) and not _seeded(n):
            n.meta["recompute"] = tc.PREFER_RECOMPUTE
            tagged += 1
    log.info("recompute: %d forward ops inside %s run again in the backward", tagged, list(prefixes))
    return tagged


def _seeded(node: fx.Node) -> bool:
    """An op that draws random numbers (dropout, CPU flash attention with its dropout) is saved, not replayed:
    a replay must draw the same numbers, which needs torch's RNG functionalization."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def is_recomputed(node: fx.Node) -> bool:
    return node.meta.get("recompute") == tc.PREFER_RECOMPUTE


__all__ = ["is_recomputed", "tag_recompute"]
