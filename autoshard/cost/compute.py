"""Roofline time of one ATen op on one device (docs/design.md, "Compute").

``time = max(flops / (peak[dtype] * flops_efficiency), bytes / (bandwidth * memory_efficiency), kernel_overhead)``

FLOPs come from ``torch.utils.flop_counter``'s public registry, so they agree with what ``FlopCounterMode``
reports (and MFU numbers people quote). Where that registry has no entry and the op matters, we add a formula
here, in our own lookup, never registered into torch: importing autoshard must not change what another
library's ``FlopCounterMode`` counts. Ops with no formula count 0 FLOPs; their time is then memory-bound,
which is right for the elementwise/view/reduction ops that make up that set.

The planner calls this for every candidate strategy of every node, on local (sharded) shapes, so the FLOP
count is cached on ``(op, argument shapes)``: the registry's formulas see only shapes, never data or dtypes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from autoshard import rules
from autoshard.cluster.profile import DeviceSpec

logger = logging.getLogger(__name__)

__all__ = ["op_flops", "op_bytes", "compute_time"]

_Shape = tuple[int, ...]


def op_flops(op: Any, args: tuple, kwargs: dict | None, out: object) -> int:
    """FLOPs of ``op(*args, **kwargs) -> out``; args/out hold (Fake)Tensors, e.g. ``node.meta["val"]``.

    ``op`` is an ``OpOverload`` such as ``torch.ops.aten.mm.default``. Returns 0 for ops without a formula.
    """
    kwargs = kwargs or {}
    formula = rules.flop_formula(op)  # op families with their own rule (autoshard/rules)
    packet = getattr(op, "overloadpacket", op)
    if formula is None and packet not in flop_registry:
        return 0
    if packet is op:  # a higher-order op (flex_attention): its formula wants the real arguments, uncached
        return _count(op, packet, args, kwargs, out)
    try:
        key_args, key_kwargs, key_out = _to_key(args), _to_key(kwargs), _to_key(out)
        hash((key_args, key_kwargs, key_out))
    except TypeError:  # an argument we can't turn into a cache key: count without the cache
        return _count(op, packet, args, kwargs, out)
    return _cached_count(op, key_args, key_kwargs, key_out)


def op_bytes(args: tuple, kwargs: dict | None, out: object) -> int:
    """Bytes read + written: every tensor in the inputs and outputs once. Views and in-place outputs count
    again; for a roofline that bias is small next to the ops that dominate step time."""
    return sum(int(t.numel()) * t.element_size() for t in _tensors((args, kwargs or {}, out)))


def compute_time(flops: float, nbytes: float, device: DeviceSpec, dtype: str | torch.dtype) -> float:
    """Roofline seconds; ``dtype`` is a name such as ``"bfloat16"`` (or a ``torch.dtype``). A dtype the device
    lists no peak for is priced at its ``float32`` peak."""
    name = str(dtype).removeprefix("torch.")
    peak = device.peak_flops.get(name, device.peak_flops["float32"])
    return max(
        flops / (peak * device.flops_efficiency),
        nbytes / (device.memory_bandwidth * device.memory_efficiency),
        device.kernel_overhead,
    )


# --- counting and caching ------------------------------------------------------------------------------------------


def _count(op: Any, packet: Any, args: Any, kwargs: Mapping[str, Any], out: Any) -> int:
    formula = rules.flop_formula(op)  # op families with their own rule (autoshard/rules)
    try:
        if formula is not None:
            return int(formula(*_shapes(args), **_shapes(dict(kwargs))))
        # The registry's formulas are wrapped to take tensors (or shapes) plus out_val=.
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    except Exception as exc:  # a formula that rejects these shapes must not abort planning
        logger.debug("flop formula for %s failed on these arguments (%r); counting 0 FLOPs", op, exc)
        return 0


@functools.lru_cache(maxsize=1 << 15)
def _cached_count(op: Any, args: tuple, kwargs: tuple, out: Hashable) -> int:
    # Shapes stand in for tensors: both the registry's shape_wrapper and our formulas read only .shape.
    return _count(op, getattr(op, "overloadpacket", op), args, dict(kwargs), out)


def _to_key(value: Any) -> Hashable:
    """Hashable stand-in: tensors -> shape tuples of ints, lists -> tuples, dicts -> sorted item tuples."""
    if isinstance(value, torch.Tensor):
        return tuple(int(d) for d in value.shape)
    if isinstance(value, (list, tuple)):
        return tuple(_to_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _to_key(v)) for k, v in value.items()))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return _concrete(value)
    return value


def _concrete(value: Any) -> Any:
    """A symbolic scalar's value under its current hint (shapes are static while planning)."""
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    return bool(value)


def _shapes(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(int(d) for d in value.shape)
    if isinstance(value, (list, tuple)):
        converted = [_shapes(v) for v in value]
        return converted if isinstance(value, list) else tuple(converted)
    if isinstance(value, dict):
        return {k: _shapes(v) for k, v in value.items()}
    return value


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
