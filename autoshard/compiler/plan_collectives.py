"""The collectives a solved graph's plan makes, priced as the lowering runs them (``autoshard/compiler/lower.py``).

One :class:`~autoshard.plans.plan.CollectiveStat` per collective DTensor runs for a placement change, with three
corrections that follow what the lowered program does rather than one collective per consumer edge:

- **Once per value and placement.** A value several consumers want in one placement is moved once (the first
  consumer is the one named); across the forward/backward boundary too, unless the move makes a bigger tensor
  (a gathered weight is gathered again in the backward) — ``PlanInterpreter._moved``.
- **Bundles pay one latency.** Gradients that only sum into Replicate ride DDP's buckets and gradients
  reduce-scattered along dim 0 ride FSDP2's (``autoshard/buckets.py``); parameters all-gathered along dim 0 are
  gathered with the rest of their layer in one collective per phase (``lower._gather_groups``), and ZeRO's
  masters back to their compute layout after the step all together (``runtime.param_state``). Each member is
  priced at its bytes (a gradient of a captured layer that stands for r layers fills buckets as r gradients);
  each bucket or group adds its collectives' latency once (tensor ``"bucket of N
  gradients"`` or ``"group of N parameters"``, 0 bytes, named after its first member's consumer).
- **Each wait costs the links' sync** (:attr:`autoshard.cluster.profile.Link.sync`: the ranks arrive apart after
  compute). Measured on gloo, a prefetched gather group or a gradient bucket is waited on much like an
  activation's all-reduce, so every collective of a move, bucket or group pays it (a move's second collective
  too: on another mesh axis it meets other ranks); ZeRO's gathers after the optimizer step that cannot be bundled
  run back to back and pay it once in all.

The solver prices edges, not values (``solver/intra_op.py``), and a bundle by shares: each member pays its bytes
and its share of the bundle's latency and sync (a gradient the part of one bucket its bytes fill, a parameter one in
its layer's gather group, a ZeRO master one in every parameter), which sums to one latency per bundle when its
members are all chosen. ``per_edge=True`` prices the plan so, member by member (rows ``"share of bucket"`` /
``"share of gather"``): what the objective sums.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autoshard.buckets import bucket_share, bucket_starts, gather_axes
from autoshard.compiler.context import PassContext
from autoshard.compiler.parameter_forms import after_step_members
from autoshard.cost.comm import redistribute_steps, sync_time
from autoshard.cost.memory import local_bytes
from autoshard.ir import gather_group, gather_group_sizes, is_state, layer_key, tensor_args, view_root
from autoshard.plans.plan import CollectiveStat

__all__ = ["plan_collectives", "weight_of"]


def weight_of(nodes: dict[str, fx.Node], name: str, ctx: PassContext) -> float:
    """How many layers node ``name``'s group stands for (sampled layers: a captured one costs for several)."""
    sh = nodes[name].meta.get("autoshard")
    return ctx.group_weight.get(sh.group, 1.0) if sh is not None else 1.0


def _owner(nodes: dict[str, fx.Node], src: fx.Node, consumer: str) -> str:
    """The module a collective is counted in: its consumer op's, else (a gradient's reduction, a master gathered
    after the step) the module of the parameter it is for."""
    if consumer in nodes and nodes[consumer].op == "call_function":
        return nodes[consumer].meta.get("autoshard_module", "")
    role = src.meta.get("autoshard_role") if src.op == "placeholder" else None
    name = role.name if role is not None else consumer
    return name.rpartition(".")[0]


def _gather_group(
    src: fx.Node, a: tuple, b: tuple, consumer: fx.Node, phase: str, mesh_shape: tuple[int, ...]
) -> tuple | None:
    """The lowering's gather group of a parameter's move (phase, layer, axes, dtype), or None when the move is
    not a dim-0 all-gather of a parameter (through views) that the lowering bundles."""
    root = view_root(src)
    if not is_state(root) or root.meta["autoshard_role"].kind != "parameter":
        return None
    moved = tuple(i for i, (h, w) in enumerate(zip(a, b)) if h != w)
    if not moved or any(not isinstance(b[i], Replicate) for i in moved):
        return None
    have = tuple(root.meta["autoshard"].outputs[0])
    want = tuple(Replicate() if i in moved else p for i, p in enumerate(have))
    if gather_axes(have, want, tuple(root.meta["val"].shape), mesh_shape) != moved:
        return None
    layer = layer_key(consumer.meta.get("autoshard_module", "")) or ("", -1)
    return ("gather", phase, layer, moved, root.meta["val"].dtype)


def plan_collectives(gm: fx.GraphModule, ctx: PassContext, per_edge: bool = False) -> list[CollectiveStat]:
    """Every placement change the chosen plan makes, as collectives (see the module docstring). ``per_edge``: as
    the solver prices them instead (one move per consumer edge, each bundle's latency paid by shares, no wait on
    a gradient's reduction), which is what its objective sums."""
    names = ctx.mesh_names
    mesh_shape = tuple(ctx.mesh_shape)
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    bundled = ctx.cluster.bundled()
    sizes = gather_group_sizes(gm)
    n_params = after_step_members(ctx)
    bundles: dict[tuple, list[tuple[int, int, list[CollectiveStat]]]] = {}  # key -> (made at, bytes, latencies)
    out: list[CollectiveStat] = []
    made: set[tuple] = set()
    after_step: list[tuple] = []  # the moves after the optimizer step so far

    def add(
        src: fx.Node,
        a: Sequence,
        b: Sequence,
        consumer: str,
        phase: str,
        repeat: float,
        itemsize: int | None = None,
        sink: bool = False,
    ) -> None:
        if a is None or b is None or tuple(a) == tuple(b):
            return
        a, b = tuple(a), tuple(b)
        grows = any(isinstance(h, Shard) and not isinstance(w, Shard) for h, w in zip(a, b))
        key = (src.name, b, phase if grows else "", sink, consumer if per_edge else "")
        if key in made:
            return
        made.add(key)
        v = src.meta["val"]
        size = min(v.element_size(), itemsize or v.element_size())  # gradients: mixed precision's reduce_dtype
        shape = tuple(v.shape)
        move = (a, b, shape, size, mesh_shape)
        local = local_bytes(math.prod(shape) * size, a, mesh_shape)
        bundle, share = None, 0.0  # the bundle it rides, and its share of it as the solver prices it
        if sink and (rides := bucket_share(a, b, shape, mesh_shape, local)):
            bundle, share = ("bucket", a, b, size), rides
        elif consumer in nodes and (found := _gather_group(src, a, b, nodes[consumer], phase, mesh_shape)):
            bundle, share = found, 1.0 / max(1, gather_group(nodes[consumer], sizes))
        elif phase == "optimizer" and gather_axes(a, b, shape, mesh_shape) is not None:
            bundle, share = (
                ("gather", phase, gather_axes(a, b, shape, mesh_shape), v.dtype),
                1.0 / n_params,
            )  # ParamStates'
        owner = _owner(nodes, src, consumer)
        steps = redistribute_steps(*move, bundled if bundle else ctx.cluster)
        back_to_back = (
            phase == "optimizer" and bool(after_step) and not per_edge
        )  # ZeRO's gathers after the step: one wait
        after_step.extend([key] if phase == "optimizer" else [])
        pays = not bundle and not back_to_back and not (per_edge and sink)  # the solver: no wait on a gradient's
        for st in steps:  # each collective of a move pays its link's sync
            wait = sync_time((st,), mesh_shape, ctx.cluster) if pays else 0.0
            out.append(
                CollectiveStat(
                    st.kind,
                    names[st.axis],
                    int(st.nbytes),
                    float(st.time) + wait,
                    src.name,
                    consumer,
                    phase,
                    repeat,
                    owner,
                )
            )
        if bundle:  # the bundle's collectives: latency and sync, once per bucket or group (the solver: shares)
            per = 1.0 if bundle[0] == "bucket" or phase == "optimizer" else repeat  # a group is per layer
            latency = [
                CollectiveStat(
                    f.kind,
                    names[f.axis],
                    0,
                    f.time - st.time + sync_time((st,), mesh_shape, ctx.cluster),
                    "",
                    consumer,
                    phase,
                    per,
                    owner,
                )
                for f, st in zip(redistribute_steps(*move, ctx.cluster), steps)
            ]
            if per_edge:
                out.extend(
                    dataclasses.replace(st, tensor=f"share of {bundle[0]}", time_s=st.time_s * share, repeat=repeat)
                    for st in latency
                )
            else:
                if bundle[0] == "bucket":  # a captured layer standing for r layers makes r such gradients
                    whole, part = int(repeat), repeat - int(repeat)
                    parts = [local] * whole + ([int(local * part)] if part > 1e-9 else [])
                else:
                    parts = [int(local * repeat)]
                bundles.setdefault(bundle, []).extend((order[src.name], nbytes, latency) for nbytes in parts)

    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        sh = node.meta["autoshard"]
        phase = node.meta.get("autoshard_phase", "forward")
        w = ctx.group_weight.get(sh.group, 1.0)
        for k, src in enumerate(tensor_args(node)):
            add(src, src.meta["autoshard"].outputs[0], sh.inputs[k], node.name, phase, w)
    out_node = gm.graph.find_nodes(op="output")[0]
    rep = tuple(Replicate() for _ in mesh_shape)
    params = {n.meta["autoshard_role"].name: n for n in gm.graph.find_nodes(op="placeholder")}
    for src, role in zip(out_node.args[0], ctx.output_roles):
        if not isinstance(src, fx.Node):
            continue
        have = src.meta["autoshard"].outputs[0]
        w = weight_of(nodes, src.name, ctx)
        if role.kind in ("loss", "output", "buffer"):
            add(src, have, rep, "output" if role.kind != "buffer" else role.name, "forward", w)
        elif role.kind in ("grad", "input_grad"):
            add(
                src,
                have,
                params[role.name].meta["autoshard"].grad_layout,
                role.name,
                "backward",
                w,
                ctx.config.reduce_itemsize,
                sink=True,
            )
    for _name, ph in params.items():  # ZeRO-1/2: the stepped master shard gathered back to the compute layout
        sh = ph.meta["autoshard"]
        if sh.state is not None and tuple(sh.state) != tuple(sh.outputs[0]):
            add(ph, sh.state, sh.outputs[0], "optimizer step", "optimizer", weight_of(nodes, ph.name, ctx))
    for key, members in bundles.items():  # in the order they are made, as the lowering fills buckets
        members.sort(key=lambda m: m[0])
        if key[0] == "bucket":
            starts, what = bucket_starts([nbytes for _, nbytes, _ in members]), "gradients"
        else:
            starts, what = [0], "parameters"
        for i, j in zip(starts, [*starts[1:], len(members)]):
            out += [
                dataclasses.replace(st, tensor=f"{'bucket' if what == 'gradients' else 'group'} of {j - i} {what}")
                for st in members[i][2]
            ]
    return out
