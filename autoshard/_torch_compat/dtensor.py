"""DTensor's sharding-strategy registries, redistribution and caches (private torch APIs)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, TupleStrategy
from torch.distributed.tensor.placement_types import Placement

from autoshard._torch_compat.collectives import all_gather_dim0, flat_mesh

log = logging.getLogger(__name__)

Placements = tuple[Placement, ...]
OpOverload = torch._ops.OpOverload


# ------------------------------------------------------------------------------------- DTensor strategies
def is_strided_shard(p: Placement) -> bool:
    """DTensor's ``_StridedShard`` (a Shard subclass on torch 2.11, not on 2.13)."""
    return type(p).__name__ == "_StridedShard"


def _prop():
    return DTensor._op_dispatcher.sharding_propagator


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(shape=t.shape, stride=t.stride(), dtype=t.dtype)


def output_meta(val: object) -> object:
    """The output ``TensorMeta`` (or tuple/list of them, None for non-tensors) DTensor's meta propagation would
    compute, from a captured node's ``meta["val"]``: lets the planner skip running each op on fake tensors."""
    if isinstance(val, torch.Tensor):
        return tensor_meta(val)
    if isinstance(val, (tuple, list)):
        metas = [tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in val]
        return tuple(metas) if isinstance(val, tuple) else metas
    return None


_UNKNOWN = object()


@contextlib.contextmanager
def _known_output_meta(prop: Any, meta: object) -> Iterator[None]:
    """Within: DTensor's propagator takes ``meta`` as the op's output metadata instead of running the op."""
    if meta is _UNKNOWN:
        yield
        return
    prop._propagate_tensor_meta_non_cached = lambda schema: meta
    try:
        yield
    finally:
        del prop._propagate_tensor_meta_non_cached


def _specs(a: object, spec: Callable[[TensorMeta], object]) -> object:
    """``a`` with each TensorMeta in it (lists and tuples walked, in order) replaced by ``spec(meta)``. (A module-level
    recursion: a recursive closure is a reference cycle per call, garbage the cycle collector walks after a plan.)"""
    if isinstance(a, TensorMeta):
        return spec(a)
    if isinstance(a, (list, tuple)) and any(isinstance(x, TensorMeta) for x in a):
        return type(a)(_specs(x, spec) for x in a)
    return a


def make_spec(mesh: DeviceMesh, placements: Sequence[Placement], meta: TensorMeta | None) -> DTensorSpec:
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def _schema(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> OpSchema:
    prop = _prop()
    info = prop.op_to_schema_info.get(op) or prop.op_to_schema_info_for_single_dim_strategy.get(op)
    return OpSchema(op, args, kwargs, schema_info=info)


def _arg_specs(schema: OpSchema) -> tuple[DTensorSpec, ...]:
    """Every tensor argument's spec, lists of tensors (``index``'s indices) included: ``OpSchema.args_spec``
    looks into lists only when the op's schema info says so, which torch 2.11's redistribute schema does not."""
    from torch.utils._pytree import tree_leaves

    return tuple(x for x in tree_leaves(schema.args_schema) if isinstance(x, DTensorSpec))


def _specs_of(x: object) -> list[DTensorSpec | None]:
    """Flatten an OpSpec.output_specs/input_specs value into a list."""
    if x is None:
        return [None]
    if isinstance(x, DTensorSpec):
        return [x]
    return list(x)


@dataclass(frozen=True)
class RawStrategy:
    """One candidate of an op: placements required of its tensor inputs and produced for its outputs."""

    inputs: tuple[Placements | None, ...]
    outputs: tuple[Placements | None, ...]


def _collect(strategy: object, n_inputs: int, n_returns: int = 1) -> list[RawStrategy]:
    """``n_returns``: the op's tuple of returns; one spec for all of them stands for each (as DTensor reads it:
    torch 2.11's norm strategies give one spec for layer_norm's (out, mean, rstd))."""
    out: list[RawStrategy] = []
    if isinstance(strategy, TupleStrategy):
        # foreach-like ops: not used by the planner (joint graphs are functional, single output lists)
        return out
    if not isinstance(strategy, OpStrategy):
        return out
    for spec in strategy.strategies:
        outs = tuple(None if s is None else tuple(s.placements) for s in _specs_of(spec.output_specs))
        if isinstance(spec.output_specs, DTensorSpec) and n_returns > 1:
            outs = outs * n_returns
        if spec.input_specs is None:
            ins = tuple(outs[0] for _ in range(n_inputs))
        else:
            ins = tuple(None if s is None else tuple(s.placements) for s in spec.input_specs)
        out.append(RawStrategy(ins, outs))
    return out


def _over_the_mesh(raws: list[RawStrategy], ndim: int) -> list[RawStrategy]:
    """Strategies whose placements cover every mesh axis: torch 2.11's ``constant_pad_nd`` strategy gives one
    ``Replicate`` on a 2-D mesh (a stock Hugging Face loss pads its labels), which is whole on every axis; a
    shorter placement that shards is dropped."""

    def short(pl: Placements | None) -> bool:
        return pl is not None and len(pl) != ndim

    def full(pl: Placements | None) -> Placements | None:
        return (Replicate(),) * ndim if short(pl) else pl

    out = []
    for r in raws:
        bad = [pl for pl in r.inputs + r.outputs if short(pl)]
        if any(not all(isinstance(p, Replicate) for p in pl) for pl in bad):
            continue
        out.append(RawStrategy(tuple(map(full, r.inputs)), tuple(map(full, r.outputs))) if bad else r)
    return out


def _place_unplaced(raws: list[RawStrategy], out_val: object, ndim: int) -> list[RawStrategy]:
    """Outputs DTensor leaves unplaced (None) that are tensors all the same are Replicate: on CUDA, flash
    attention returns its rng state and unused sequence offsets that way, and its backward takes them back."""
    if not isinstance(out_val, (tuple, list)):
        return raws
    tensor_at = [isinstance(v, torch.Tensor) for v in out_val]
    rep = tuple(Replicate() for _ in range(ndim))
    fixed = []
    for r in raws:
        outs = tuple(rep if o is None and i < len(tensor_at) and tensor_at[i] else o for i, o in enumerate(r.outputs))
        fixed.append(r if outs == r.outputs else RawStrategy(r.inputs, outs))
    return fixed


def op_strategies(
    op: torch._ops.OpOverload,
    args: tuple,
    kwargs: dict,
    mesh: DeviceMesh,
    first_input: Placements,
    other_inputs: Sequence[Placements] | None = None,
    out_val: object = _UNKNOWN,
) -> list[RawStrategy]:
    """DTensor's candidate strategies for ``op`` when its first tensor input is placed ``first_input``.

    ``args``/``kwargs`` carry ``TensorMeta`` where the op takes a tensor. Strategy functions that enumerate
    every candidate (einsum-like ops) ignore the input placement; the ones that follow their input (views,
    pointwise, reductions) return the strategies compatible with it. Raises whatever DTensor raises when the
    op cannot take that placement; the caller skips such combinations.
    """
    prop = _prop()
    n_tensor = [0]
    others = list(other_inputs or [])

    def spec(a: TensorMeta) -> object:
        i = n_tensor[0]
        n_tensor[0] += 1
        if i == 0:
            pl = first_input
        elif i - 1 < len(others) and others[i - 1] is not None:
            pl = others[i - 1]
        else:
            pl = tuple(Replicate() for _ in range(mesh.ndim))
        return make_spec(mesh, pl, a)

    sargs = tuple(_specs(a, spec) for a in args)
    skw = {k: _specs(v, spec) for k, v in kwargs.items()}
    n_inputs = n_tensor[0]
    schema = _schema(op, sargs, skw)
    single = prop.op_single_dim_strategy_funcs.get(op)
    func = prop.op_strategy_funcs.get(op)
    if single is not None or func is not None:
        out_meta = output_meta(out_val) if out_val is not _UNKNOWN else prop._propagate_tensor_meta_non_cached(schema)
        wrapped = prop._wrap_with_op_strategy(schema)
        if single is not None:
            from torch.distributed.tensor._sharding_prop import _expand_single_dim_strategy_to_mesh

            fn = _expand_single_dim_strategy_to_mesh(mesh, wrapped, single, out_meta)
            strat = fn(op, wrapped.args_meta, wrapped.kwargs_meta)
        else:
            strat = func(wrapped)
        raws = _collect(strat, n_inputs, len(op._schema.returns) if schema.return_type_tuple_tensor_like() else 1)
        return _place_unplaced(_over_the_mesh(raws, mesh.ndim), out_val, mesh.ndim)
    # decomposition path / legacy rules: only the min-cost choice for this input placement is available
    with _known_output_meta(prop, output_meta(out_val) if out_val is not _UNKNOWN else _UNKNOWN):
        sharding = prop.propagate_op_sharding_non_cached(schema)
    out_spec = sharding.output_spec
    outs = tuple(None if s is None else tuple(s.placements) for s in _specs_of(out_spec))
    red = sharding.redistribute_schema
    in_specs = _arg_specs(red if red is not None else schema)
    ins = tuple(tuple(s.placements) for s in in_specs)
    return [RawStrategy(ins, outs)]


@dataclass(frozen=True)
class AxisRules:
    """The placements an op accepts on ONE mesh axis (DTensor's "single-dim strategy"), placeholders filled.

    Each rule is ``outputs + inputs`` (one placement per tensor output, then per flattened tensor input; None
    for a masked-off output). DTensor combines them independently per mesh axis, so the candidates on a mesh
    of ``k`` axes are the ``k``-fold product of the rules — enumerating that product directly is what keeps
    planning fast on 3-D meshes, where DTensor's own expansion also prices every combination.
    """

    num_outputs: int
    rules: tuple[tuple[Placement | None, ...], ...]


def single_dim_rules(
    op: torch._ops.OpOverload, args: tuple, kwargs: dict, mesh: DeviceMesh, out_val: object = _UNKNOWN
) -> AxisRules | None:
    """Per-axis rules of ``op`` at these argument shapes, or None when the op has no single-dim strategy (or
    this torch lays the registry out differently: callers then use :func:`op_strategies`/:func:`propagate`)."""
    prop = _prop()
    info = getattr(prop, "op_single_dim_strategy_funcs", {}).get(op)
    if info is None:
        return None
    try:
        from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder

        rep = tuple(Replicate() for _ in range(mesh.ndim))

        def spec(a: TensorMeta) -> object:
            return make_spec(mesh, rep, a)

        schema = _schema(op, tuple(_specs(a, spec) for a in args), {k: _specs(v, spec) for k, v in kwargs.items()})
        out_meta = output_meta(out_val) if out_val is not _UNKNOWN else prop._propagate_tensor_meta_non_cached(schema)
        wrapped = prop._wrap_with_op_strategy(schema)
        func = getattr(info, "func", info)
        raw = func(op, wrapped.args_meta, wrapped.kwargs_meta)
        n_out = sum(1 for r in op._schema.returns if "Tensor" in str(r.type))
        metas = [out_meta] if isinstance(out_meta, TensorMeta) or out_meta is None else list(out_meta)
        rules: list[tuple[Placement | None, ...]] = []
        for rule in raw:
            filled = tuple(Shard(p.dim) if isinstance(p, _ShardingPlaceholder) else p for p in rule)
            if filled not in rules:
                rules.append(filled)
        width = len(rules[0]) if rules else None
        if width is None:
            return None
        replicate = tuple(
            None if i < n_out and i < len(metas) and metas[i] is None else Replicate() for i in range(width)
        )
        if not any(all(p is None or isinstance(p, Replicate) for p in r) for r in rules):
            rules.insert(0, replicate)
        return AxisRules(n_out, tuple(rules))
    except Exception as e:  # a registry layout this adapter does not know: let the caller use the slow path
        log.debug("single-dim rules of %s unavailable: %s", op, e)
        return None


def propagate(
    op: torch._ops.OpOverload,
    args: tuple,
    kwargs: dict,
    mesh: DeviceMesh,
    placed: dict[int, Placements],
    out_val: object = _UNKNOWN,
) -> RawStrategy:
    """What DTensor itself would run for ``op`` given its tensor inputs' placements (unlisted ones Replicate):
    the placements it redistributes the inputs to and the placements of the outputs."""
    prop = _prop()
    counter = [0]
    rep = tuple(Replicate() for _ in range(mesh.ndim))

    def spec(a: TensorMeta) -> object:
        i = counter[0]
        counter[0] += 1
        return make_spec(mesh, placed.get(i, rep), a)

    schema = _schema(op, tuple(_specs(a, spec) for a in args), {k: _specs(v, spec) for k, v in kwargs.items()})
    # DTensor also rewrites a view's shape arguments to local sizes, which for strided shards on big meshes
    # splits real index tensors (seconds per call); the planner needs placements only, so skip that step
    saved = getattr(prop, "op_to_shape_and_stride_idx", None)
    if saved is not None and op in saved:
        prop.op_to_shape_and_stride_idx = {k: v for k, v in saved.items() if k is not op}
    try:
        with _known_output_meta(prop, output_meta(out_val) if out_val is not _UNKNOWN else _UNKNOWN):
            sharding = prop.propagate_op_sharding_non_cached(schema)
    finally:
        if saved is not None:
            prop.op_to_shape_and_stride_idx = saved
    outs = tuple(None if s is None else tuple(s.placements) for s in _specs_of(sharding.output_spec))
    red = sharding.redistribute_schema
    in_specs = _arg_specs(red if red is not None else schema)
    return RawStrategy(tuple(tuple(s.placements) for s in in_specs), outs)


def has_sharding_rule(op: torch._ops.OpOverload) -> bool:
    prop = _prop()
    if op in prop.op_single_dim_strategy_funcs or op in prop.op_strategy_funcs or op in prop.op_to_rules:
        return True
    try:  # torch 2.13 re-exports it here; torch 2.11 has it in _decompositions only
        from torch.distributed.tensor._sharding_prop import DecompShardingStrategy
    except ImportError:
        from torch.distributed.tensor._decompositions import DecompShardingStrategy

    return DecompShardingStrategy.has_decomp(op)


def redistribute(t: DTensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """``DTensor.redistribute`` that also makes Partial targets (R -> P), which the public API refuses but
    DTensor's own dispatch does when an op wants a Partial input (a zeroed copy on all but one rank)."""
    placements = tuple(placements)
    if t.dtype == torch.bool and any(
        isinstance(h, (Shard, Partial)) and h != w for h, w in zip(t.placements, placements)
    ):
        # moved as bytes: Inductor's C++ code types a collective's boolean result as int64 (torch 2.13: "expected
        # predicate to be bool, got torch.int64" where a gathered padding mask is read)
        return redistribute(t.to(torch.uint8), mesh, placements).to(torch.bool)
    summed = _summed_axes(t.placements, placements)
    if len(summed) > 1 and mesh.mesh_dim_names:  # one all-reduce over the flattened axes, not one per axis
        import torch.distributed._functional_collectives as funcol

        local = funcol.all_reduce(t._local_tensor, "sum", flat_mesh(mesh, summed))
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
    gathered = _gathered_axes(t, placements)
    if len(gathered) > 1 and mesh.mesh_dim_names:  # likewise one all-gather
        local = all_gather_dim0(t._local_tensor, mesh, gathered, t.placements[gathered[0]].dim)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
    if not any(isinstance(p, Partial) and not isinstance(q, Partial) for p, q in zip(placements, t.placements)):
        return t.redistribute(mesh, placements)
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    target = DTensorSpec(mesh, placements, tensor_meta=t._spec.tensor_meta)
    local = redistribute_local_tensor(t.to_local(), t._spec, target)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())


def _gathered_axes(t: DTensor, want: Sequence[Placement]) -> tuple[int, ...]:
    """The mesh axes of a move that only all-gathers one tensor dim that no other axis splits, evenly (every
    other axis unchanged); () for any other move."""
    have = t.placements
    axes = tuple(a for a, (h, w) in enumerate(zip(have, want)) if h != w)
    if not axes or any(not (isinstance(have[a], Shard) and isinstance(want[a], Replicate)) for a in axes):
        return ()
    dim = have[axes[0]].dim
    split = [a for a, h in enumerate(have) if isinstance(h, Shard) and h.dim == dim]
    if split != list(axes) or t.shape[dim] % math.prod(t.device_mesh.size(a) for a in axes):
        return ()
    return axes


def _summed_axes(have: Sequence[Placement], want: Sequence[Placement]) -> tuple[int, ...]:
    """The mesh axes of a move that only sums Partial(sum) into Replicate (every other axis unchanged); () for any
    other move."""
    axes = tuple(a for a, (h, w) in enumerate(zip(have, want)) if h != w)
    if any(
        not (isinstance(have[a], Partial) and have[a].reduce_op == "sum" and isinstance(want[a], Replicate))
        for a in axes
    ):
        return ()
    return axes


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard without an autograd node (``to_local()`` records one per call); other tensors
    as they are."""
    return t._local_tensor if isinstance(t, DTensor) else t


def dtensor_like(local: torch.Tensor, ref: DTensor) -> DTensor:
    """``local`` as a DTensor with ``ref``'s mesh, placements and global shape, without ``from_local``'s autograd
    function and checks (a gradient delivered in its parameter's layout)."""
    return DTensor(local, ref._spec, requires_grad=False)


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions.

    DTensor caches an op's output specs keyed by meshes that compare equal by shape and names, and a cached
    spec carries the mesh it was first computed on: its process group and this process's coordinate. After a
    fake or simulated world (planning, ``LocalTensorMode``) a real mesh of the same shape would be handed that
    stale mesh (a lookup of a destroyed process group, or rank 0's chunk on every rank of a forked worker).
    autoshard clears the cache whenever it leaves a fake world and before it builds a runtime.
    """
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        fn = getattr(prop, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's copy
    if native is not None:
        native()


def all_placements(mesh_ndim: int, tensor_ndim: int, partial: bool = False) -> Iterator[Placements]:
    """Every combination of R / S(d) (and P) over the mesh axes."""
    choices: list[Placement] = [Replicate()] + [Shard(d) for d in range(tensor_ndim)]
    if partial:
        choices.append(Partial())
    return itertools.product(choices, repeat=mesh_ndim)
