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

``LocalTensorMode`` simulates all ranks in one process and cannot hold one rank's graph; there the runtime
runs ``PlanInterpreter`` itself (the same code ``make_fx`` traces here).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.fx.experimental.proxy_tensor import make_fx

from autoshard import _torch_compat as tc
from autoshard.ir import NodeSharding
from autoshard.notation import local_shape, placements_str
from autoshard.passes.coarsen import tensor_args
from autoshard.passes.context import PassContext
from autoshard.passes.strategies import SDPA_CPU

log = logging.getLogger(__name__)


def _wrap(t: torch.Tensor, mesh: DeviceMesh, placements: Sequence, global_val: torch.Tensor) -> DTensor:
    return DTensor.from_local(
        t, mesh, tuple(placements), run_check=False, shape=global_val.shape, stride=global_val.stride()
    )


class PlanInterpreter:
    """Runs the annotated joint graph on DTensors with exactly the plan's placements."""

    def __init__(self, gm: fx.GraphModule, mesh: DeviceMesh) -> None:
        self.gm = gm
        self.mesh = mesh
        self.nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.output = self.nodes[-1]
        self.mismatches = 0

    def phase_nodes(self, phase: str) -> list[fx.Node]:
        return [n for n in self.nodes if n.op in ("call_function", "get_attr") and n.meta.get("autoshard_phase", "forward") == phase]

    def bind(self, env: dict[str, Any], names: Sequence[fx.Node], locals_: Sequence[torch.Tensor]) -> None:
        for node, t in zip(names, locals_):
            env[node.name] = _wrap(t, self.mesh, node.meta["autoshard"].outputs[0], node.meta["val"])

    def run(self, env: dict[str, Any], nodes: Sequence[fx.Node]) -> None:
        for node in nodes:
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
                val = tc.redistribute(val, self.mesh, want)
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
        if node.target in SDPA_CPU or not ins or not tc.has_sharding_rule(node.target):
            return self._run_local(node, sh, args, kwargs)
        out = node.target(*args, **kwargs)
        return self._match(node, sh, out)

    def _run_local(self, node: fx.Node, sh: NodeSharding, args: tuple, kwargs: dict) -> Any:
        def unwrap(a: object) -> object:
            if isinstance(a, DTensor):
                return a.to_local()
            if isinstance(a, (list, tuple)):
                return type(a)(unwrap(x) for x in a)
            return a

        out = node.target(*unwrap(args), **unwrap(kwargs))
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
                log.debug("%s: DTensor produced %s, plan says %s", node.name, placements_str(out.placements), placements_str(want))
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

    def outputs(self, env: dict[str, Any], output_roles: Sequence, param_placements: dict[str, tuple]) -> list[Any]:
        """Loss and outputs made Replicate, gradients moved to their parameter's (or input's) placement, all as
        local tensors."""
        result: list[Any] = []
        buckets: dict[tuple, list[tuple[int, DTensor]]] = {}
        made_at = {n.name: i for i, n in enumerate(self.nodes)}
        order: dict[int, int] = {}  # result slot -> where the backward makes that gradient
        for src, role in zip(self.output.args[0], output_roles):
            if role.kind in ("none",) or src is None:
                continue
            val = env[src.name]
            if role.kind in ("loss", "output"):
                val = val.redistribute(self.mesh, [Replicate()] * self.mesh.ndim)
            elif role.kind in ("grad", "input_grad"):
                want = tuple(param_placements[role.name])
                if _bucketable(tuple(val.placements), want):
                    buckets.setdefault((tuple(val.placements), want, val.dtype), []).append((len(result), val))
                    order[len(result)] = made_at[src.name]
                    result.append(None)
                    continue
                val = tc.redistribute(val, self.mesh, want)
            result.append(val.to_local())
        for (have, want, _), members in buckets.items():
            # in the order the backward makes them, so that a bucket is complete (and its reduction can start,
            # see passes/overlap.py) while the backward goes on with earlier layers
            members.sort(key=lambda m: order[m[0]])
            for chunk in _by_size(members, FIRST_BUCKET_BYTES, BUCKET_BYTES):
                for slot, local in zip((i for i, _ in chunk), self._reduce_together([v for _, v in chunk], have, want)):
                    result[slot] = local
        return result

    def _reduce_together(self, vals: list[DTensor], have: tuple, want: tuple) -> list[torch.Tensor]:
        """Partial -> Replicate of several gradients as ONE collective (DDP's gradient bucket): their local
        pieces flattened into one tensor, reduced, and cut back. The sums are the same, element by element."""
        locals_ = [v.to_local() for v in vals]
        if len(locals_) == 1:
            return [tc.redistribute(vals[0], self.mesh, want).to_local()]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        reduced = tc.redistribute(DTensor.from_local(flat, self.mesh, have, run_check=False), self.mesh, want).to_local()
        pieces = torch.split(reduced, [t.numel() for t in locals_])
        return [p.view(t.shape) for p, t in zip(pieces, locals_)]


BUCKET_BYTES = 25 * 2**20  # per gradient bucket, DDP's default
FIRST_BUCKET_BYTES = 2**20  # the first bucket is small, as DDP's, so that its reduction starts early


def _bucketable(have: tuple, want: tuple) -> bool:
    """A move that only sums Partial(sum) into Replicate on some axes, with no Shard on either side (so the
    local pieces of several gradients can be flattened and reduced together)."""
    from torch.distributed.tensor import Partial, Shard

    moves = False
    for h, w in zip(have, want):
        if isinstance(h, Shard) or isinstance(w, Shard):
            return False
        if h != w:
            if not (isinstance(h, Partial) and h.reduce_op == "sum" and isinstance(w, Replicate)):
                return False
            moves = True
    return moves


def _by_size(members: list[tuple[int, DTensor]], first: int, limit: int) -> list[list[tuple[int, DTensor]]]:
    """Consecutive members in buckets of at most ``first`` bytes (the first) and ``limit`` bytes (the others);
    a member larger than that is a bucket of its own."""
    out: list[list[tuple[int, DTensor]]] = [[]]
    size = 0
    for slot, v in members:
        nbytes = v.to_local().numel() * v.element_size()
        if out[-1] and size + nbytes > (first if len(out) == 1 else limit):
            out.append([])
            size = 0
        out[-1].append((slot, v))
        size += nbytes
    return out


def local_placeholder_shapes(gm: fx.GraphModule, mesh_shape: Sequence[int]) -> list[tuple[torch.Size, torch.dtype]]:
    out = []
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta["val"]
        out.append((torch.Size(local_shape(tuple(v.shape), n.meta["autoshard"].outputs[0], mesh_shape)), v.dtype))
    return out


def param_placements_of(gm: fx.GraphModule) -> dict[str, tuple]:
    """Placements of the parameters and inputs by role name (where their gradients are delivered)."""
    return {
        n.meta["autoshard_role"].name: tuple(n.meta["autoshard"].outputs[0])
        for n in gm.graph.find_nodes(op="placeholder")
        if n.meta["autoshard_role"].kind in ("parameter", "input")
    }


def trace_rank_program(gm: fx.GraphModule, ctx: PassContext, decompositions: dict | None = None) -> fx.GraphModule:
    """make_fx-trace ``PlanInterpreter`` over the joint graph for this rank."""
    mesh = ctx.mesh
    interp = PlanInterpreter(gm, mesh)
    roles = ctx.output_roles
    pp = param_placements_of(gm)
    primal_nodes = [n for n in interp.placeholders if n.meta["autoshard_role"].kind != "tangent"]
    tangent_nodes = [n for n in interp.placeholders if n.meta["autoshard_role"].kind == "tangent"]

    def joint(primals: list[torch.Tensor], tangents: list[torch.Tensor]) -> list[torch.Tensor]:
        env: dict[str, Any] = {}
        interp.bind(env, primal_nodes, primals)
        interp.bind(env, tangent_nodes, tangents)
        interp.run(env, [n for n in interp.nodes if n.op in ("call_function", "get_attr")])
        return interp.outputs(env, roles, pp)

    shapes = local_placeholder_shapes(gm, ctx.mesh_shape)
    device = torch.device(mesh.device_type)
    examples = [torch.empty(s, dtype=d, device=device) for s, d in shapes]
    n_primals = len(primal_nodes)
    traced = make_fx(joint, tracing_mode="fake", decomposition_table=decompositions or {})(
        examples[:n_primals], examples[n_primals:]
    )
    if interp.mismatches:
        log.warning("lower: %d op outputs needed an extra redistribution to match the plan", interp.mismatches)
    ctx.stats["lower_mismatches"] = interp.mismatches
    return traced


def lower(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    lowered = trace_rank_program(gm, ctx)
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


Program = Callable[..., Any]
