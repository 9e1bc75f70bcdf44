"""An index by ``arange`` over the batch, for ``sample_coupling``: each sample's own row, so samples stay apart.

transformers builds its attention masks as ``padding_mask[batch_arange[:, None, None, None], kv_idx]``: an
``aten.index.Tensor`` of the batched padding mask whose batch dim is indexed by ``arange(batch)``. DTensor's
index strategy gathers an indexed dim (its index values are global), which alone would say the op needs the
whole batch; with the identity over the batch as the index, output sample ``b`` reads input sample ``b`` only.
``IotaTracker`` marks the values equal to ``arange(B)`` along one dim (B a batch size) through the shape-only
ops that keep them so, and tells where an index by one puts the batch.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

log = logging.getLogger(__name__)

__all__ = ["IotaTracker"]

aten = torch.ops.aten
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
# ops whose output holds the input's values along the same dim, when every other dim has size 1
_RESHAPES = {
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
}
_COPIES = {
    aten.clone.default,
    aten._to_copy.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
}


class IotaTracker:
    """Values equal to ``arange(B)`` along one dim (broadcast along size-1 ones), B a batch size; fed every
    forward node in order (``visit``)."""

    def __init__(self) -> None:
        self.sizes: set[int] = set()  # the batch sizes of the batched inputs
        self.dims: dict[str, int] = {}  # node name -> the dim along which it counts 0, 1, ..., B - 1

    def add_batch(self, size: int) -> None:
        self.sizes.add(int(size))

    def visit(self, node: fx.Node) -> None:
        """Mark ``node`` when it is such an arange, or a reshape, copy or expand of one, or one plus 0."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or node.op != "call_function":
            return
        t, args = node.target, node.args
        if t in _ARANGES:
            start, end, step = (
                (0, args[0], 1) if t is aten.arange.default else (args[0], args[1], args[2] if len(args) > 2 else 1)
            )
            if start == 0 and step == 1 and end in self.sizes and val.ndim == 1:
                self.dims[node.name] = 0
            return
        src = args[0] if args else None
        if not isinstance(src, fx.Node) or src.name not in self.dims:
            return
        j = self.dims[src.name]
        n = src.meta["val"].shape[j]
        if t in _COPIES or (t is aten.add.Tensor and len(args) == 2 and args[1] == 0):
            self.dims[node.name] = j
        elif t is aten.expand.default:
            out = j + val.ndim - src.meta["val"].ndim
            if val.shape[out] == n:
                self.dims[node.name] = out
        elif t in _RESHAPES:
            big = [d for d, s in enumerate(val.shape) if s != 1]
            if n > 1 and len(big) == 1 and val.shape[big[0]] == n and src.meta["val"].numel() == n:
                self.dims[node.name] = big[0]

    def index_dim(self, node: fx.Node, carried: dict[int, int]) -> int | None:
        """For ``aten.index.Tensor`` of a batched tensor whose batch dim is indexed by an arange over that batch
        (and whose other batched indices carry the batch on the same broadcast dim): the output's batch dim.
        None otherwise. ``carried``: per tensor argument (self, then the indices given), its batch dim."""
        if node.target is not aten.index.Tensor or 0 not in carried:
            return None
        d, indices = carried[0], list(node.args[1])
        pick = indices[d] if d < len(indices) else None
        if not isinstance(pick, fx.Node) or pick.name not in self.dims:
            return None
        if pick.meta["val"].shape[self.dims[pick.name]] != node.args[0].meta["val"].shape[d]:
            return None
        given = [x for x in indices if x is not None]
        rank = max(x.meta["val"].ndim for x in given)
        j = self.dims[pick.name] + rank - pick.meta["val"].ndim  # the batch's dim in the broadcast index shape
        for k, dim in carried.items():
            if k and dim + rank - given[k - 1].meta["val"].ndim != j:
                return None  # another index carries the batch on another dim: sample b would read other samples
        at = [i for i, x in enumerate(indices) if x is not None]
        out = (at[0] if at == list(range(at[0], at[0] + len(at))) else 0) + j
        val = node.meta["val"]
        return out if out < val.ndim and val.shape[out] == node.args[0].meta["val"].shape[d] else None
