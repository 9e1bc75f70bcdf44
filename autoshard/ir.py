"""Small value types shared by the planning passes (groups, strategies, per-node decisions), the one notion of a
repeated layer, and the tensor arguments of a graph node."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor.placement_types import Placement

Placements = tuple[Placement, ...]
# Placements of each output of a node (one entry for a single-tensor node, None for non-tensor outputs).
NodeOut = tuple[Placements | None, ...]


@dataclass(frozen=True)
class Group:
    """Nodes that share one sharding decision: an anchor and the followers that can only follow it."""

    id: int
    anchor: str
    members: tuple[str, ...]  # node names, topological order, anchor first
    kind: str  # "parameter" | "buffer" | "input" | "tangent" | "op" | "factory" | "fallback"
    module: str
    phase: str


@dataclass(frozen=True)
class Edge:
    """A tensor flowing into a group from another group: producer node -> (member position, tensor arg)."""

    src_group: int
    src_node: str
    dst_group: int
    dst_member: int
    dst_arg: int


@dataclass(frozen=True)
class GroupStrategy:
    """One candidate for a whole group: placements for every member, and its costs on one device."""

    outputs: tuple[NodeOut, ...]  # per member
    inputs: tuple[tuple[Placements | None, ...], ...]  # per member: required placement of each tensor arg
    compute_s: float
    comm_s: float  # resharding inside the group (a follower that cannot take its producer's layout)
    activation_bytes: int  # saved-for-backward bytes on one device
    state_bytes: int  # parameter + gradient + optimizer state bytes on one device
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    # a parameter's gradient and optimizer-state layouts where they differ from its compute layout (outputs[0][0]):
    # ZeRO-1 (state sharded further, gradient as computed) and ZeRO-2 (gradient and state sharded further); None:
    # the same as the compute layout (DDP, FSDP/ZeRO-3, TP)
    grad_placements: Placements | None = None
    state_placements: Placements | None = None
    # offload (ZeRO-Offload, ``autoshard/compiler/parameter_forms.py: offload_variants``): "optimizer" or "params" when
    # the optimizer state and the master it steps live in host memory (``state_placements`` then says how the master is
    # sharded), "" on the device. ``offload_s``: the per-step host copies and host optimizer step, included in
    # ``compute_s``; ``host_bytes``: what this group holds in host memory (master, its gradient, optimizer state)
    offload: str = ""
    offload_s: float = 0.0
    host_bytes: int = 0


@dataclass(frozen=True)
class NodeSharding:
    """The solved layout of one node: ``node.meta["autoshard"]`` (``grad``/``state``: a parameter's gradient and
    optimizer-state layouts, when not its compute layout ``outputs[0]``; ``offload``: its master and optimizer state
    held in host memory, see ``GroupStrategy.offload``)."""

    group: int
    outputs: NodeOut
    inputs: tuple[Placements | None, ...]
    grad: Placements | None = None
    state: Placements | None = None
    offload: str = ""  # a parameter whose master and optimizer state live in host memory: "optimizer" / "params"

    @property
    def grad_layout(self) -> Placements:
        return self.grad if self.grad is not None else self.outputs[0]

    @property
    def state_layout(self) -> Placements:
        return self.state if self.state is not None else self.outputs[0]


def param_offload_of(gm: fx.GraphModule) -> dict[str, str]:
    """Parameter name -> offload mode ("optimizer" / "params") of the solved graph's offloaded parameters (the
    runtime holds their masters and optimizer state in host memory: ``autoshard/runtime/offload.py``)."""
    out: dict[str, str] = {}
    for n in gm.graph.find_nodes(op="placeholder"):
        sh = n.meta.get("autoshard")
        if sh is not None and getattr(sh, "offload", "") and n.meta["autoshard_role"].kind == "parameter":
            out[n.meta["autoshard_role"].name] = sh.offload
    return out


def layer_parts(name: str) -> tuple[str, int, str] | None:
    """``model.layers.3.attn.wq.weight`` -> ``("model.layers", 3, "attn.wq.weight")``: the repeated block a module
    or parameter path belongs to (its first numbered component), and the rest of the path; None outside one."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        if parts[i].isdigit():
            return ".".join(parts[:i]), int(parts[i]), ".".join(parts[i + 1 :])
    return None


def layer_key(name: str) -> tuple[str, int] | None:
    """``("layers", 3)`` for ``layers.3.attn.wq``: the repeated block of ``layer_parts``, without the rest."""
    found = layer_parts(name)
    return None if found is None else (found[0], found[1])


def is_saved(node: fx.Node) -> bool:
    """A forward tensor the backward reads (held from the forward until the backward)."""
    return node.meta.get("autoshard_phase") == "forward" and any(
        u.meta.get("autoshard_phase") == "backward" for u in node.users
    )


@functools.lru_cache(maxsize=None)
def is_view(target: object) -> bool:
    if target is torch.ops.aten._unsafe_view.default:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def sums(have: Sequence[Placement], want: Sequence[Placement]) -> bool:
    """Whether moving ``have`` to ``want`` reduces: Partial on some mesh axis where ``want`` is not."""
    return any(h.is_partial() and h != w for h, w in zip(have, want))


def view_root(node: fx.Node) -> fx.Node:
    """The tensor whose storage ``node`` is a view of (``node`` itself when it is no view)."""
    root = node
    while root.op == "call_function" and is_view(root.target):
        args = tensor_args(root)
        if not args:
            break
        root = args[0]
    return root


def owns_storage(node: fx.Node) -> bool:
    """Whether a saved tensor holds memory of its own: a view of a parameter or input (``t(w)`` read by the
    backward's matmul) holds the parameter's, and a view of a tensor that is saved too holds that one's (counted
    there), so neither adds to the saved activations; of several saved views of one unsaved tensor (the
    ``view`` before each of the q, k and v matmuls of one norm's output) one holds the storage."""
    root = view_root(node)
    if root is node:
        return True
    if root.op == "placeholder" or is_saved(root):
        return False
    return node is _first_saved_view(root)


def _first_saved_view(root: fx.Node) -> fx.Node | None:
    """The saved view of ``root`` (through chains of views) with the smallest name: one representative."""
    found: list[fx.Node] = []
    todo = [u for u in root.users if u.op == "call_function" and is_view(u.target)]
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_saved(n):
            found.append(n)
        todo.extend(u for u in n.users if u.op == "call_function" and is_view(u.target))
    return min(found, key=lambda n: n.name) if found else None


def node_arg(node: fx.Node, pos: int, name: str, default: object) -> object:
    """An op's argument by position or keyword (``default`` when the call leaves it out)."""
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)


def kept_target_counter(owner: fx.GraphModule, target: fx.Node, ignore: object) -> tuple[fx.GraphModule, list[fx.Node]]:
    """A graph computing ``sum(target != ignore)`` (the targets a mean NLL / cross-entropy averages over) from the
    placeholders ``target`` depends on, and those placeholders in its argument order."""
    seen: set[fx.Node] = set()
    todo = [target]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    used = []
    for n in (n for n in target.graph.nodes if n in seen):  # graph order: placeholders first
        if n.op == "placeholder":
            used.append(n)
            env[n] = g.placeholder(n.name)
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    kept = g.call_function(torch.ops.aten.ne.Scalar, (env[target], ignore))
    g.output(g.call_function(torch.ops.aten.sum.default, (kept,)))
    return fx.GraphModule(owner, g), used


def gather_group_sizes(gm: fx.GraphModule) -> dict[tuple, int]:
    """How many parameters the lowering's gather group of each (phase, layer) may bundle into one all-gather
    (``autoshard/compiler/lower.py``: a layer's gathered parameters, per phase): the distinct parameters, through
    their views, that the ops of that layer read in that phase. The layer is ``layer_key`` of the op's module
    (``("", -1)`` outside a repeated block)."""
    seen: dict[tuple, set[str]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        for a in tensor_args(n):
            if is_parameter(a):
                seen.setdefault(_gather_key(n), set()).add(view_root(a).name)
    return {k: len(v) for k, v in seen.items()}


def gather_group(consumer: fx.Node, sizes: Mapping[tuple, int]) -> int:
    """How many parameters ride the gather group of a parameter that op ``consumer`` reads (``sizes``:
    ``gather_group_sizes`` of its graph); 0 when none."""
    return sizes.get(_gather_key(consumer), 0)


def _gather_key(n: fx.Node) -> tuple:
    return (n.meta.get("autoshard_phase", "forward"), layer_key(n.meta.get("autoshard_module", "")) or ("", -1))


def is_parameter(node: fx.Node) -> bool:
    """A parameter placeholder, or a view of one."""
    root = view_root(node)
    role = root.meta.get("autoshard_role") if root.op == "placeholder" else None
    return role is not None and role.kind == "parameter"


def is_frozen(node: fx.Node) -> bool:
    """A parameter placeholder the loss takes no gradient of (``requires_grad=False``: a LoRA adapter's base
    weight), as ``capture`` marks it (``meta["autoshard_frozen"]``). It holds no gradient and no optimizer state
    (nor their ZeRO shards, master copy or host offload), and its layout serves the forward and the gradients of
    the activations only."""
    return bool(node.meta.get("autoshard_frozen"))


def is_state(node: fx.Node) -> bool:
    """A parameter or buffer placeholder, or a view of one (the ``t`` before a matmul). The solver charges no
    ``autoshard.cluster.profile.Link.sync`` for such a move when the lowering gathers it ahead with its layer's others
    (FSDP's gathers); every other moved value (activations, their gradients, the loss) is waited on by the op
    that needs it (``autoshard/compiler/plan_collectives.py``)."""
    node = view_root(node)
    role = node.meta.get("autoshard_role") if node.op == "placeholder" else None
    return role is not None and role.kind in ("parameter", "buffer")


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued input nodes of ``node`` in DTensor's flattened argument order (lists expanded)."""
    out: list[fx.Node] = []
    for a in node.args:
        _tensor_nodes(a, out)
    for v in node.kwargs.values():
        _tensor_nodes(v, out)
    return out


def _tensor_nodes(a: object, out: list[fx.Node]) -> None:
    # (a module-level function: a recursive closure is a reference cycle per call, and planning makes ~70k calls,
    # whose garbage the cycle collector then walked for 0.3 s at the end of a Mixtral plan)
    if isinstance(a, fx.Node):
        if isinstance(a.meta.get("val"), torch.Tensor):
            out.append(a)
    elif isinstance(a, (list, tuple)):
        for x in a:
            _tensor_nodes(x, out)


def output_vals(node: fx.Node) -> list[torch.Tensor | None]:
    """Per output of ``node``: its (fake) tensor value, None for a non-tensor output."""
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [x if isinstance(x, torch.Tensor) else None for x in v]
    return [None]


def _layer_signature(m: nn.Module) -> tuple:
    return (type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()))


def repeated_layers(model: nn.Module) -> tuple[str, int] | None:
    """The longest ``nn.ModuleList`` of identical blocks (same class, same parameter shapes): (path, length)."""
    best: tuple[str, int] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 1:
            first = _layer_signature(mod[0])
            if all(_layer_signature(c) == first for c in mod) and (best is None or len(mod) > best[1]):
                best = (name, len(mod))
    return best
