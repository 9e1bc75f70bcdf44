"""lower: the solved joint graph -> this rank's joint graph (local shapes, explicit collectives).

Needs: every node annotated by ``annotate`` with ``meta["autoshard"]`` = ``NodeSharding`` (its output
placements and the placements its tensor inputs must have).

The plan's meaning is one interpreter, ``PlanInterpreter``: it runs the joint graph on DTensors, and before
each op redistributes every input to the placement the plan chose for that op
(``# x: f32[B, T, D] [S(0), P] -> [S(0), R]`` becomes an all-reduce on axis 1), then runs the op through
DTensor (which rewrites shape arguments of views to local sizes), or locally for the ops autoshard has its
own rule for (CPU flash attention), for factory ops and for ops with no rule (all Replicate).

Guarantees on exit of ``lower``: an fx.GraphModule traced from that interpreter with ``make_fx`` for this
rank: placeholders ``primals_*`` (local parameters, buffers, inputs in capture order) and ``tangents_*``;
outputs ``[loss (Replicate), *gradients (each in its parameter's placement)]``; every placement change is a
``_c10d_functional`` collective followed by ``wait_tensor``; every shape is local. Rank-dependent constants
(which chunk a Replicate->Shard keeps) are baked in, so each rank lowers its own graph.

``LocalTensorMode`` simulates all ranks in one process and cannot hold one rank's graph; there ``compile``
makes a program that runs ``PlanInterpreter`` itself (the same code ``make_fx`` traces here).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from autoshard import _torch_compat as tc
from autoshard import rules
from autoshard.buckets import bucketable, gather_all, gather_axes, scatter_axes
from autoshard.compiler.context import PassContext
from autoshard.compiler.lower_buckets import by_size, reduce_together, scatter_together
from autoshard.config import BUCKET_BYTES, FIRST_BUCKET_BYTES
from autoshard.ir import NodeSharding, layer_key, sums, tensor_args
from autoshard.messages import warn
from autoshard.notation import local_shape, placements_str
from autoshard.rules import random_draws

log = logging.getLogger(__name__)
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def _wrap(t: torch.Tensor, mesh: DeviceMesh, placements: Sequence, global_val: torch.Tensor) -> DTensor:
    return DTensor.from_local(
        t, mesh, tuple(placements), run_check=False, shape=global_val.shape, stride=global_val.stride()
    )


def _contiguous(x: DTensor) -> DTensor:
    """``x`` with its local tensor and its own metadata both contiguous."""
    stride = torch.empty(x.shape, device="meta").stride()
    return DTensor.from_local(
        x.to_local().contiguous(), x.device_mesh, x.placements, run_check=False, shape=x.shape, stride=stride
    )


def _split_only(sh: NodeSharding, mesh_shape: tuple[int, ...]) -> NodeSharding:
    """``sh`` with a shard on a mesh axis of size 1 read as Replicate: nothing is split there, and an op rule's own
    local call (a ring, a causal load balance, a vocabulary-parallel loss) is for axes that split (a 1-device mesh
    planned attention's inputs "on the sequence" of its one rank, and the CUDA kernels refused to balance that)."""
    if all(n > 1 for n in mesh_shape):
        return sh

    def whole(pl: Any) -> Any:
        if pl is None or not isinstance(pl, tuple) or len(pl) != len(mesh_shape):
            return pl
        return tuple(Replicate() if isinstance(p, Shard) and n == 1 else p for p, n in zip(pl, mesh_shape))

    return dataclasses.replace(
        sh, outputs=tuple(whole(p) for p in sh.outputs), inputs=tuple(whole(p) for p in sh.inputs)
    )


def _all_replicated(sh: NodeSharding) -> bool:
    return all(all(isinstance(p, Replicate) for p in pl) for pl in list(sh.inputs) + list(sh.outputs) if pl)


class PlanInterpreter:
    """Runs the annotated joint graph on DTensors with exactly the plan's placements."""

    def __init__(self, gm: fx.GraphModule, mesh: DeviceMesh, group_gathers: bool = False) -> None:
        self.gm = gm
        self.mesh = mesh
        self.nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.output = self.nodes[-1]
        self.mismatches = 0
        # FSDP-style: one all-gather per layer and phase for the parameters it gathers
        # (autoshard/compiler/lower_buckets.py)
        self.groups, self.group_of = _gather_groups(self.nodes, tuple(mesh.shape)) if group_gathers else ({}, {})
        self.gathered: dict[tuple, DTensor] = {}

    def phase_nodes(self, phase: str) -> list[fx.Node]:
        return [
            n
            for n in self.nodes
            if n.op in ("call_function", "get_attr") and n.meta.get("autoshard_phase", "forward") == phase
        ]

    def bind(self, env: dict[str, Any], names: Sequence[fx.Node], locals_: Sequence[torch.Tensor]) -> None:
        for node, t in zip(names, locals_):
            env[node.name] = _wrap(t, self.mesh, node.meta["autoshard"].outputs[0], node.meta["val"])

    def run(self, env: dict[str, Any], nodes: Sequence[fx.Node]) -> None:
        for node in nodes:
            with tc.tag_traced(node):  # (traced: the ops recorded for it carry its recompute tag)
                env[node.name] = self.run_node(node, env)

    def run_node(self, node: fx.Node, env: dict[str, Any]) -> Any:
        if node.op == "get_attr":
            val = getattr(self.gm, node.target)
            return DTensor.from_local(val, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False)
        if node.target is operator.getitem:
            return env[node.args[0].name][node.args[1]]
        sh: NodeSharding = node.meta["autoshard"]
        ins = tensor_args(node)
        moved: dict[str, Any] = {}
        for k, src in enumerate(ins):
            want = sh.inputs[k] if k < len(sh.inputs) else None
            val = env[src.name]
            if want is not None and isinstance(val, DTensor) and tuple(val.placements) != tuple(want):
                key = (src.name, node.meta.get("autoshard_phase", "forward"), tuple(want))
                val = self._gather_group(key, env) if key in self.group_of else self._moved(key, val, env)
            moved[f"{src.name}#{k}"] = val
        counter = iter(range(len(ins)))

        def sub(a: object) -> object:
            if isinstance(a, fx.Node):
                if isinstance(a.meta.get("val"), torch.Tensor):
                    return moved[f"{a.name}#{next(counter)}"]
                return env[a.name]
            if isinstance(a, (list, tuple)):
                return type(a)(sub(x) for x in a)
            return a

        args = tuple(sub(a) for a in node.args)
        kwargs = {k: sub(v) for k, v in node.kwargs.items()}
        if rules.runs_local(node, sh) or not ins or not tc.has_sharding_rule(node.target):
            return self._run_local(node, sh, args, kwargs)
        try:
            out = node.target(*args, **kwargs)
        except NotImplementedError:
            # DTensor's propagation knew a rule (strategies asked it) that its dispatch does not (fill.Tensor):
            # replicated inputs give replicated outputs however the op runs
            if not _all_replicated(sh):
                raise
            return self._run_local(node, sh, args, kwargs)
        except RuntimeError:
            # a view traced on one memory layout, run on another (DTensor's local results need not keep the
            # traced strides, and a DTensor's own strides are the traced ones): the same values through a
            # contiguous copy of the local tensor
            if (
                node.target not in _VIEWS
                or not isinstance(args[0], DTensor)
                or (args[0].is_contiguous() and args[0].to_local().is_contiguous())
            ):
                raise
            out = node.target(_contiguous(args[0]), *args[1:], **kwargs)
        return self._match(node, sh, out)

    def _moved(self, use: tuple, val: DTensor, env: dict[str, Any]) -> DTensor:
        """``val`` (the value ``use[0]``) redistributed to ``use[2]``, once for all its consumers that want that
        placement: in the same phase, and also across phases when the move makes no bigger tensor (a summed
        loss denominator is reduced once, and the backward reuses it; an all-gathered weight is gathered again
        in the backward, so that it is not kept alive between them, as FSDP reshards after forward)."""
        src, phase, want = use
        grows = any(isinstance(h, Shard) and not isinstance(w, Shard) for h, w in zip(val.placements, want))
        key = f"{src} -> {placements_str(want)} {phase if grows else ''}"  # (not a node name: those have no spaces)
        if key not in env:
            env[key] = tc.redistribute(val, self.mesh, want)
        return env[key]

    def _gather_group(self, use: tuple, env: dict[str, Any]) -> DTensor:
        """The value ``use`` names, made from its parameter gathered (with every other parameter of its group,
        at the group's first use) and passed through the same views."""
        gkey, (member, views) = self.group_of[use]
        if member not in self.gathered:
            members = [m for m in self.groups[gkey] if m not in self.gathered]
            vals = gather_all(self.mesh, gkey[2], [env[m[0]] for m in members])
            self.gathered.update(zip(members, vals))
        val = self.gathered[member]
        for view in views:
            val = view.target(val, *view.args[1:], **view.kwargs)
        want = use[2]
        return val if tuple(val.placements) == want else tc.redistribute(val, self.mesh, want)

    def _run_local(self, node: fx.Node, sh: NodeSharding, args: tuple, kwargs: dict) -> Any:
        def unwrap(a: object) -> object:
            if isinstance(a, DTensor):
                return a.to_local()
            if isinstance(a, (list, tuple)):
                return type(a)(unwrap(x) for x in a)
            return a

        call = rules.local_call(node, _split_only(sh, tuple(self.mesh.shape)))
        if call is not None:
            out = call(args, kwargs, self.mesh)
        else:
            out = node.target(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})
        vals = node.meta["val"]
        if isinstance(out, torch.Tensor):
            return _wrap(out, self.mesh, sh.outputs[0] or [Replicate()] * self.mesh.ndim, vals)
        return tuple(
            _wrap(o, self.mesh, pl, v) if isinstance(o, torch.Tensor) else o for o, pl, v in zip(out, sh.outputs, vals)
        )

    def _match(self, node: fx.Node, sh: NodeSharding, out: Any) -> Any:
        """DTensor picks the output layout itself; where it differs from the plan, move it to the plan's."""
        if isinstance(out, DTensor):
            want = sh.outputs[0]
            if want is not None and tuple(out.placements) != tuple(want):
                self.mismatches += 1
                log.debug(
                    "%s: DTensor produced %s, plan says %s",
                    node.name,
                    placements_str(out.placements),
                    placements_str(want),
                )
                out = tc.redistribute(out, self.mesh, want)
            return out
        if isinstance(out, (tuple, list)):
            res = []
            for o, want in zip(out, sh.outputs):
                if isinstance(o, DTensor) and want is not None and tuple(o.placements) != tuple(want):
                    self.mismatches += 1
                    o = tc.redistribute(o, self.mesh, want)
                res.append(o)
            return type(out)(res)
        return out

    def outputs(
        self,
        env: dict[str, Any],
        output_roles: Sequence,
        param_placements: dict[str, tuple],
        reduce_dtype: torch.dtype | None = None,
    ) -> list[Any]:
        """Loss, outputs and updated buffers made Replicate, gradients moved to their parameter's (or input's) gradient
        placement (``param_placements``), all as local tensors. ``reduce_dtype``: floating gradients that a move sums
        (Partial) are cast to it for the collective and back after (mixed precision's bf16 reduction)."""
        result: list[Any] = []
        dtypes: dict[int, torch.dtype] = {}  # result slot -> the gradient's own dtype, where it was reduced in another
        buckets: dict[tuple, list[tuple[int, DTensor]]] = {}
        made_at = {n.name: i for i, n in enumerate(self.nodes)}
        order: dict[int, int] = {}  # result slot -> where the backward makes that gradient
        for src, role in zip(self.output.args[0], output_roles):
            if role.kind in ("none",) or src is None:
                continue
            val = env[src.name]
            if role.kind in ("loss", "output", "buffer"):
                val = tc.redistribute(val, self.mesh, [Replicate()] * self.mesh.ndim)
            elif role.kind in ("grad", "input_grad"):
                want = tuple(param_placements[role.name])
                have = tuple(val.placements)
                if _reduced_in(reduce_dtype, val, want):
                    dtypes[len(result)] = val.dtype
                    val = val.to(reduce_dtype)
                axes = scatter_axes(have, want, tuple(val.shape), tuple(self.mesh.shape))
                if bucketable(have, want) or axes is not None:
                    buckets.setdefault((have, want, val.dtype, axes), []).append((len(result), val))
                    order[len(result)] = made_at[src.name]
                    result.append(None)
                    continue
                val = tc.redistribute(val, self.mesh, want)
            local = val.to_local()
            result.append(local.to(dtypes[len(result)]) if len(result) in dtypes else local)
        for (have, want, _, axes), members in buckets.items():
            # in the order the backward makes them, so that a bucket is complete (and its reduction can start,
            # see autoshard/compiler/overlap.py) while the backward goes on with earlier layers
            members.sort(key=lambda m: order[m[0]])
            for chunk in by_size(members, FIRST_BUCKET_BYTES, BUCKET_BYTES):
                vals = [v for _, v in chunk]
                reduced = (
                    reduce_together(self.mesh, vals, have, want)
                    if axes is None
                    else scatter_together(self.mesh, axes, vals, want[axes[0]].dim)
                )
                for slot, local in zip((i for i, _ in chunk), reduced):
                    result[slot] = local.to(dtypes[slot]) if slot in dtypes else local
        return result


def _reduced_in(dtype: torch.dtype | None, val: DTensor, want: tuple) -> bool:
    """Whether gradient ``val`` is summed in ``dtype`` on its way to ``want``: a floating gradient of another
    dtype that is Partial on an axis where ``want`` is not."""
    return dtype is not None and val.dtype != dtype and val.dtype.is_floating_point and sums(val.placements, want)


_aten = torch.ops.aten
_PARAM_VIEWS = {
    _aten.t.default,
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.permute.default,
    _aten.transpose.int,
    _aten.reshape.default,
}  # what a parameter goes through before its matmul


def _gather_groups(
    nodes: Sequence[fx.Node], mesh_shape: tuple[int, ...]
) -> tuple[dict[tuple, list], dict[tuple, tuple]]:
    """Parameters gathered Shard(0) -> Replicate on some axes (directly, or through views such as the ``t`` before
    a matmul), grouped by (phase, layer, axes, dtype).

    Returns each group's members ``(parameter, phase, its placements once gathered)`` in order of first use, and
    for each use ``(value, phase, wanted placements)`` a pair (group, (member, the view nodes from it))."""
    groups: dict[tuple, list] = {}
    group_of: dict[tuple, tuple] = {}
    for node in nodes:
        sh = node.meta.get("autoshard")
        if node.op != "call_function" or node.target is operator.getitem or sh is None:
            continue
        phase = node.meta.get("autoshard_phase", "forward")
        layer = layer_key(node.meta.get("autoshard_module", "")) or ("", -1)
        for k, src in enumerate(tensor_args(node)):
            if k >= len(sh.inputs) or not sh.inputs[k] or "autoshard" not in src.meta:
                continue
            want, have = tuple(sh.inputs[k]), tuple(src.meta["autoshard"].outputs[0])
            param, views = src, []
            while param.op == "call_function" and param.target in _PARAM_VIEWS and isinstance(param.args[0], fx.Node):
                param, views = param.args[0], [param, *views]
            role = param.meta.get("autoshard_role")
            if param.op != "placeholder" or role is None or role.kind != "parameter":
                continue
            moved = tuple(a for a, (h, w) in enumerate(zip(have, want)) if h != w)
            if not moved or any(not isinstance(want[a], Replicate) for a in moved):
                continue
            p_have = tuple(param.meta["autoshard"].outputs[0])
            p_want = tuple(Replicate() if i in moved else p for i, p in enumerate(p_have))
            if gather_axes(p_have, p_want, tuple(param.meta["val"].shape), mesh_shape) != moved:
                continue
            use = (src.name, phase, want)
            if use in group_of:
                continue
            member = (param.name, phase, p_want)
            gkey = (phase, layer, moved, param.meta["val"].dtype)
            if member not in groups.setdefault(gkey, []):
                groups[gkey].append(member)
            group_of[use] = (gkey, (member, tuple(views)))
    return groups, group_of


def local_placeholder_shapes(gm: fx.GraphModule, mesh_shape: Sequence[int]) -> list[tuple[torch.Size, torch.dtype]]:
    out = []
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta["val"]
        out.append((torch.Size(local_shape(tuple(v.shape), n.meta["autoshard"].outputs[0], mesh_shape)), v.dtype))
    return out


def param_placements_of(gm: fx.GraphModule, which: str = "compute") -> dict[str, tuple]:
    """Placements of the parameters and inputs by role name: the layout the program computes with
    (``"compute"``), the one its gradients are delivered in (``"grad"``), or the one the optimizer steps
    (``"state"``; ZeRO-1/2 parameters shard their gradient and state further than their compute layout)."""
    pick = {
        "compute": lambda sh: sh.outputs[0],
        "grad": lambda sh: sh.grad_layout,
        "state": lambda sh: sh.state_layout,
    }[which]
    return {
        n.meta["autoshard_role"].name: tuple(pick(n.meta["autoshard"]))
        for n in gm.graph.find_nodes(op="placeholder")
        if n.meta["autoshard_role"].kind in ("parameter", "input")
    }


def trace_rank_program(
    gm: fx.GraphModule, ctx: PassContext, decompositions: dict | None = None, group_gathers: bool = True
) -> fx.GraphModule:
    """make_fx-trace ``PlanInterpreter`` over the joint graph for this rank (``group_gathers``: one all-gather
    per layer and phase for the parameters it gathers, see ``autoshard/compiler/lower_buckets.py``)."""
    mesh = ctx.mesh
    interp = PlanInterpreter(gm, mesh, group_gathers=group_gathers)
    roles = ctx.output_roles
    grad_layouts = param_placements_of(gm, "grad")
    reduce_dtype = getattr(torch, ctx.config.reduce_dtype) if ctx.config.reduce_itemsize else None
    primal_nodes = [n for n in interp.placeholders if n.meta["autoshard_role"].kind != "tangent"]
    tangent_nodes = [n for n in interp.placeholders if n.meta["autoshard_role"].kind == "tangent"]

    def joint(primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> list[torch.Tensor]:
        env: dict[str, Any] = {}
        interp.bind(env, primal_nodes, primals)
        interp.bind(env, tangent_nodes, tangents)
        interp.run(env, [n for n in interp.nodes if n.op in ("call_function", "get_attr")])
        return interp.outputs(env, roles, grad_layouts, reduce_dtype)

    shapes = local_placeholder_shapes(gm, ctx.mesh_shape)
    device = torch.device(mesh.device_type)
    examples = [torch.empty(s, dtype=d, device=device) for s, d in shapes]
    n_primals = len(primal_nodes)
    traced = make_fx(joint, tracing_mode="fake", decomposition_table=decompositions or {})(
        examples[:n_primals], examples[n_primals:]
    )
    dropped = _drop_unused_collectives(traced)
    random_draws.chain_draws(traced)  # one device's order of draws, whatever the compiler schedules
    if interp.mismatches:
        warn(log, "lower: %d op outputs needed an extra redistribution to match the plan", interp.mismatches)
    ctx.stats["lower_mismatches"] = interp.mismatches
    ctx.stats["lower_dropped_collectives"] = dropped
    return traced


def _drop_unused_collectives(gm: fx.GraphModule) -> int:
    """Erase the collectives whose result nothing reads (their ``wait_tensor`` has no users; ``make_fx`` keeps
    them as side effects): a move made for an op whose own result the trace dropped. Every rank traces the same
    plan, so every rank drops the same ones and the others still pair up. Returns how many were dropped."""
    dropped = 0
    for w in reversed(list(gm.graph.nodes)):
        if not (w.op == "call_function" and w.target is torch.ops._c10d_functional.wait_tensor.default) or w.users:
            continue
        coll = w.args[0]
        gm.graph.erase_node(w)
        if isinstance(coll, fx.Node) and not coll.users:
            gm.graph.erase_node(coll)
            dropped += 1
    if dropped:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return dropped


def lower(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The lowering pass: this rank's joint graph, decomposed for Inductor when it compiles
    (``ctx.backend``). Keeps the solved global graph (``ctx.planned``) and which forward outputs have a tangent
    (``ctx.tangent_of``: a tangent's role is ``tangent[i]`` for forward output i), in tangent order."""
    ctx.planned = gm
    ctx.tangent_of = tuple(
        int(n.meta["autoshard_role"].name[len("tangent[") : -1])
        for n in gm.graph.find_nodes(op="placeholder")
        if n.meta["autoshard_role"].kind == "tangent"
    )
    decompositions = tc.decomposition_table() if ctx.backend == "inductor" else None
    lowered = trace_rank_program(gm, ctx, decompositions)
    ctx.stats["lowered_nodes"] = sum(1 for n in lowered.graph.nodes if n.op == "call_function")
    return lowered


def collective_counts(gm: fx.GraphModule) -> dict[str, int]:
    """How many of each ``_c10d_functional`` collective a lowered graph runs (wait_tensor excluded)."""
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, tc.OpOverload):
            if n.target.namespace == "_c10d_functional" and n.target._opname != "wait_tensor":
                counts[n.target._opname] = counts.get(n.target._opname, 0) + 1
    return counts
