"""``torch.compile(model, backend="autoshard", options={"mesh": mesh, ...})``.

Registered through the ``torch_dynamo_backends`` entry point (``pyproject.toml``), so it works without
importing autoshard first. The options are ``autoshard.compile``'s (``mesh`` required; ``backend`` is the
per-rank compiler, "inductor" or "eager").

The loop is the ordinary one, with data parallelism's input convention::

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)       # built before the first call
    compiled = torch.compile(model, backend="autoshard", options={"mesh": mesh})
    for x, y in batches:                                        # each rank passes its own batch shard
        loss = compiled(x, y); loss.backward(); opt.step(); opt.zero_grad()

Dynamo hands the backend one graph of the forward, specialized to this rank's shapes. The backend plans the module
itself instead, called as dynamo saw it called but at global shapes (the ranks' shards stacked on dim 0 over the
data-parallel axes, ``runtime/lazy.py``), compiles it with ``autoshard.compile`` and makes each of the module's
parameter objects hold this rank's shard (``parameters="local"``), and drops dynamo's guards on them (their shapes
were recorded while tracing; the program reads the parameters by name and never runs dynamo's graph), so later calls
do not recompile. A model built on the meta device works too: ``autoshard.init_weights(model, seed)`` or
``autoshard.load_pretrained(model, path)`` before the first call records the call and gives each meta tensor a
one-element stand-in on the process group's device for dynamo to trace (``weights/shards.py``); the backend then
allocates only this rank's shards and runs the recorded call on them. Dynamo's graph only says which of its inputs are
the call's tensors. An optimizer built before the first call steps the same objects: elementwise optimizers (SGD,
Adam, AdamW, ...) are exact on shards; a global gradient norm over ``model.parameters()`` would be this rank's part
only. The loss is the graph's first scalar floating-point output; other outputs (a model output's logits and cache)
are not computed: they come back as ``None``, with one warning. A graph break (dynamo hands over the forward in
pieces) is an error that names the break: planning one piece as if it were the whole forward would train the wrong
thing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autoshard import _torch_compat as tc
from autoshard.errors import InputError, UsageError
from autoshard.inputs import Call, signature_of
from autoshard.messages import warn
from autoshard.runtime.lazy import batch_constraint, data_parallel_axes, global_example
from autoshard.weights.shards import is_unfilled

log = logging.getLogger(__name__)

_SHARDED = "_autoshard_sharded"  # on the model: the ShardedModule its first graph planned, for the graphs after


def _leaf_sources(example_inputs: Sequence[Any], leaves: Sequence[Any]) -> list[int]:
    """For each tensor leaf of the call, the position of the graph input that is that tensor."""
    where = {id(x): k for k, x in enumerate(example_inputs)}
    out = []
    for i, leaf in enumerate(leaves):
        if id(leaf) not in where:
            raise UsageError(
                f"autoshard backend: tensor argument {i} of the call is not an input of dynamo's graph (unused by "
                "forward?); autoshard plans the module's call as a whole: pass only what forward uses"
            )
        out.append(where[id(leaf)])
    return out


def _loss_position(outs: Sequence[Any]) -> int:
    """Where the loss sits among dynamo's graph outputs: the first scalar floating-point one (a ModelOutput with a
    KV cache puts the cache's tensors before the loss), else the first output."""
    for i, o in enumerate(outs):
        v = o.meta.get("val", o.meta.get("example_value")) if isinstance(o, fx.Node) else None  # dynamo: example_value
        if isinstance(v, torch.Tensor) and v.ndim == 0 and v.is_floating_point():
            return i
    return 0


def autoshard_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: dict[str, Any] | None = None, mode: str | None = None
) -> Callable[..., Any]:
    """The ``torch.compile`` backend (see the module docstring)."""
    opts = dict(options or {})
    mesh = opts.pop("mesh", None)
    if not isinstance(mesh, DeviceMesh):
        raise InputError(
            "torch.compile(model, backend='autoshard', options={'mesh': mesh}) needs the DeviceMesh "
            f"to shard over in options['mesh'] (got {type(mesh).__name__})"
        )
    if mode not in (None, "default"):
        warn(log, "autoshard backend: mode=%r is ignored (the plan chooses what to run)", mode)
    if any(isinstance(x, DTensor) for x in example_inputs):
        raise UsageError(
            "autoshard backend: this graph reads parameters that autoshard already sharded for another graph. "
            "Either the model is split into several graphs by a graph break (torch.compile(..., fullgraph=True) "
            "names where), or the input shapes changed and dynamo recompiled (autoshard plans static shapes: keep "
            "every batch the same shape, e.g. drop_last=True)"
        )
    found = tc.compiling_call(example_inputs)
    if found is None:
        raise UsageError(
            "autoshard backend: torch.compile must be given an nn.Module (its parameters are what "
            "autoshard shards); it was given a function whose graph takes no module's parameters"
        )
    root, args, kwargs = found
    dynamic = any(isinstance(s, torch.SymInt) for x in example_inputs if isinstance(x, torch.Tensor) for s in x.shape)
    sharded = root.__dict__.get(_SHARDED)
    if sharded is not None and sharded.mesh is not mesh:
        raise InputError(
            f"autoshard backend: {type(root).__name__} was already sharded over another mesh "
            f"({sharded.mesh}); compile a fresh model for {mesh}"
        )
    if sharded is None and dynamic:
        raise UsageError(
            "autoshard backend: the first call was traced with dynamic shapes; autoshard plans "
            "concrete ones (and re-plans each new batch shape itself): compile with dynamic=False"
        )
    broke = tc.graph_break_reason()
    if broke is not None:
        held = {id(x) for x in example_inputs}
        n_read = sum(1 for p in root.parameters() if id(p) in held)
        raise UsageError(
            f"autoshard backend: dynamo splits {type(root).__name__}.forward into several graphs, and this one (which "
            f"reads {n_read} of its {sum(1 for _ in root.parameters())} parameters) ends at a graph break: {broke}. "
            "autoshard plans the whole forward as one program: remove the break (torch.compile(..., fullgraph=True) "
            "reports every one), or use autoshard.compile(model, mesh), which traces without dynamo"
        )
    if sharded is None:
        sharded = _plan(root, gm, mesh, opts, args, kwargs)
        root.__dict__[_SHARDED] = sharded  # (not a submodule: the model does not own its sharded wrapper)
    else:  # dynamo traced the model again (a new batch shape): the sharded module plans that shape at its call
        log.info(
            "autoshard backend: %s traced again (new shapes%s); its sharded module re-plans them when called",
            type(root).__name__,
            ", dynamic" if dynamic else "",
        )
    signature, tensors = signature_of(Call(args, kwargs))
    sources = _leaf_sources(example_inputs, tensors)
    # nor on the call's tensors and the module (its mode, its attributes): a batch of another shape, or a call in
    # eval() mode, reaches ``run`` as it is, and the sharded module plans it (``ShardedModule._switch_shapes``, its
    # evaluation programs); a re-trace would run the model on parameters that now hold shards
    tc.forget_guards_on(gm, list(tensors))
    tc.forget_guards_on_module(gm, list(root.parameters()))
    out = gm.graph.find_nodes(op="output")[0].args[0]
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    extra = len(outs) - 1
    at = _loss_position(outs)
    warned: list[bool] = []

    def run(*flat: Any) -> tuple:
        call_args, call_kwargs = signature.unflatten([flat[k] for k in sources])
        if sharded.training != root.training:
            sharded.train(root.training)
        if not root.training:  # the model's outputs, this rank's rows of them, where dynamo's graph returns them
            return _place_outputs(sharded.evaluate(*call_args, **call_kwargs), outs, mesh)
        loss = sharded(*call_args, **call_kwargs)
        if extra and not warned:
            warned.append(True)
            warn(
                log,
                "autoshard backend: the compiled graph returns %d outputs besides the loss (logits, cache); "
                "autoshard computes only the loss and returns None for them",
                extra,
            )
        result: list[Any] = [None] * len(outs)
        result[at] = loss
        return tuple(result)

    run.sharded = sharded  # type: ignore[attr-defined]  # the ShardedModule (its plan, report)
    return run


def _place_outputs(output: Any, outs: Sequence[Any], mesh: DeviceMesh) -> tuple:
    """An evaluation's output (whole tensors) as dynamo's graph returns it on this rank: each of its tensors cut
    to this rank's rows (the call was this rank's batch shard), placed at the graph output of that shape and dtype
    (in order)."""
    leaves, _ = tc.tree_flatten(output)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    dp = data_parallel_axes(mesh)
    coord = mesh.get_coordinate() or [0] * mesh.ndim
    size, index = 1, 0
    for a in dp:
        index = index * mesh.size(a) + coord[a]
        size *= mesh.size(a)
    result: list[Any] = [None] * len(outs)
    taken: set[int] = set()
    for i, o in enumerate(outs):
        v = o.meta.get("val", o.meta.get("example_value")) if isinstance(o, fx.Node) else None
        if not isinstance(v, torch.Tensor):
            continue
        for j, t in enumerate(tensors):
            piece = t.chunk(size)[index] if t.ndim and size > 1 and t.shape[0] == v.shape[0] * size else t
            if j not in taken and tuple(piece.shape) == tuple(v.shape) and piece.dtype == v.dtype:
                result[i] = piece
                taken.add(j)
                break
    return tuple(result)


def _plan(
    root: nn.Module, gm: fx.GraphModule, mesh: DeviceMesh, opts: dict[str, Any], args: tuple, kwargs: dict[str, Any]
) -> Any:
    """Plan and compile ``root`` itself at the global shapes of this call, its parameter objects made to hold
    this rank's shards in place; dynamo's guards on them dropped."""
    from autoshard.api import compile as autoshard_compile

    if meta := [n for n, p in root.named_parameters() if p.device.type == "meta"]:
        raise InputError(
            f"autoshard backend: {type(root).__name__} is on the meta device ({meta[0]} and {len(meta) - 1} more) "
            "with nothing to give it values. Before the first call, call autoshard.init_weights(model, seed) or "
            "autoshard.load_pretrained(model, path) on it (they run on this rank's shards once the backend has "
            "planned), with the process group already initialized"
        )
    example = global_example(args, kwargs, mesh)
    constraints = {**batch_constraint(mesh, example), **dict(opts.pop("constraints", None) or {})}
    # the module itself is planned at global shapes (dynamo's graph is specialized to this rank's shapes)
    # the parameter objects dynamo traced hold their compute shard, which the user's optimizer steps: no ZeRO-1/2
    # masters sharded further than that (see runtime/param_state.py)
    opts.setdefault("shard_state", False)
    opts.setdefault("offload", "none")  # nor masters in host memory
    # a meta-built model's buffers stand in until compile gives them storage (new objects: their guards go too)
    relaid = [*root.parameters(), *(b for b in root.buffers() if is_unfilled(b))]
    with tc.outside_dynamo():
        sharded = autoshard_compile(root, mesh, example, constraints=constraints, parameters="local", **opts)
    freed = tc.forget_guards_on(gm, relaid)
    log.info(
        "autoshard backend: %d parameters (and buffers) re-laid out in place; dynamo's guards on them dropped", freed
    )
    log.info(
        "autoshard backend: planned %s on mesh %s: predicted step %.3g s",
        type(root).__name__,
        dict(zip(mesh.mesh_dim_names or (), mesh.shape)),
        sharded.plan.step_time_s,
    )
    return sharded
