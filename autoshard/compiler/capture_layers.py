"""The capture pass's entry: the whole model, or only the first few of its repeated layers.

Part of ``capture`` (not a pass of its own). With ``PlanConfig.sample_layers`` = k and a model whose largest
``nn.ModuleList`` of identical blocks (``ir.repeated_layers``) is longer than k, a shallow copy of the model with
only the first k blocks is captured, and ``share_layers`` weighs them to stand for all (the plan's costs and
memory count every layer). A constraint that pins some of those layers but not the others, layers frozen unlike
the others (``requires_grad=False`` on some of their weights only), or a forward that needs all its layers, makes
it capture every layer instead.
"""

from __future__ import annotations

import copy
import fnmatch
import logging

import torch.fx as fx
from torch import nn

from autoshard.compiler.capture import capture
from autoshard.compiler.capture_recompute import sampled_specs, tag_recompute
from autoshard.compiler.context import PassContext
from autoshard.config import PlanConfig
from autoshard.ir import repeated_layers
from autoshard.messages import warn

log = logging.getLogger(__name__)


def _param_modules(model: nn.Module) -> dict[str, str]:
    return {
        f"{mn}.{pn}" if mn else pn: type(m).__name__
        for mn, m in model.named_modules()
        for pn, _ in m.named_parameters(recurse=False)
    }


def _truncated(model: nn.Module, path: str, keep: int) -> nn.Module:
    """A shallow copy of ``model`` whose ModuleList at ``path`` holds only its first ``keep`` blocks (the
    blocks, parameters and everything else are shared with ``model``, not copied)."""
    parts = path.split(".") if path else []
    root = copy.copy(model)
    root._modules = dict(model._modules)
    parent = root
    for part in parts[:-1]:
        child = copy.copy(parent._modules[part])
        child._modules = dict(child._modules)
        parent._modules[part] = child
        parent = child
    parent._modules[parts[-1]] = nn.ModuleList(list(parent._modules[parts[-1]])[:keep])
    return root


def constraints_uneven(model: nn.Module, path: str, total: int, config: PlanConfig) -> str | None:
    """A constraint over parameter names that pins some of the repeated layers at ``path`` but not the same
    parameters in all of them (``model.layers.1*.mlp.*``): the captured layers could not stand for the rest.
    Returns that constraint's key, or None."""
    keys = [k for k in config.constraints if k not in ("inputs", "params") and not k.startswith("input[")]
    if not keys:
        return None
    prefix = f"{path}."
    rel: dict[int, list[str]] = {i: [] for i in range(total)}
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name.startswith(prefix):
            idx, _, tail = name[len(prefix) :].partition(".")
            if idx.isdigit():
                rel[int(idx)].append(tail)
    for key in keys:
        pinned = {
            frozenset(t for t in tails if fnmatch.fnmatchcase(f"{prefix}{i}.{t}", key)) for i, tails in rel.items()
        }
        if len(pinned) > 1:
            return key
    return None


def _frozen_alike(model: nn.Module, path: str) -> bool:
    """Whether every block of the ModuleList at ``path`` has the same parameters frozen (a block with frozen
    weights holds no gradient or optimizer state for them: captured blocks stand only for blocks frozen alike)."""
    blocks = model.get_submodule(path)
    return len({tuple(p.requires_grad for _, p in b.named_parameters()) for b in blocks}) <= 1


def capture_model(model: nn.Module, ctx: PassContext) -> fx.GraphModule:
    """The capture pass: ``model`` called with ``ctx.example_inputs``, whole or (``config.sample_layers``) with
    only the first few of its repeated layers; then the constraints are checked against the model's parameter
    names and the call's argument names (a pipeline stage's were checked on the whole model). With
    ``ctx.cache`` the trace is taken once per ``plan_graph`` call: later attempts get a copy of it."""
    cache = ctx.cache
    if cache is not None and cache.captured is not None:
        gm, ctx.signature, roles, modules, ctx.sampled_layers, nodes = cache.captured
        gm, ctx.output_roles, ctx.param_modules = copy_graph(gm), list(roles), dict(modules)
        ctx.stats["nodes_captured"] = nodes
    else:
        gm = _capture_some(model, ctx)
        if cache is not None:
            cache.captured = (
                copy_graph(gm),
                ctx.signature,
                list(ctx.output_roles),
                dict(ctx.param_modules),
                ctx.sampled_layers,
                ctx.stats.get("nodes_captured"),
            )
    specs = ctx.config.recompute
    if specs and ctx.sampled_layers is not None:  # the captured layers stand for all: their modes too
        specs = sampled_specs(specs, *ctx.sampled_layers)[0]
    tag_recompute(gm, specs, [n for n, _ in model.named_modules()])
    if not ctx.stage:
        params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        ctx.config.check_constraints(params, ctx.signature.names if ctx.signature else (), ctx.mesh_names)
    return gm


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A graph of new nodes with the same names, arguments and (shallow-copied) meta: the passes write only
    top-level meta keys, so the copy's annotations never reach the original."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    return fx.GraphModule(gm, graph)


def _capture_some(model: nn.Module, ctx: PassContext) -> fx.GraphModule:
    k = ctx.config.sample_layers
    found = repeated_layers(model) if k and ctx.config.share_layers else None
    if found is not None and found[0]:
        uneven = constraints_uneven(model, found[0], found[1], ctx.config)
        if uneven is not None:
            log.info(
                "capture: constraint %r pins some of the layers in %s but not others; capturing every layer",
                uneven,
                found[0],
            )
            found = None
        elif not _frozen_alike(model, found[0]):
            log.info(
                "capture: some of the layers in %s are frozen (requires_grad=False) where others train; "
                "capturing every layer",
                found[0],
            )
            found = None
    if found is not None and found[1] > k and found[0]:
        path, total = found
        try:
            short = _truncated(model, path, k)
            ctx.param_modules = _param_modules(short)
            ctx.sampled_layers = (path, k, total)
            gm = capture(short, ctx.example_inputs, ctx)
            log.info("capture: %d of the %d identical layers in %s captured; they stand for all", k, total, path)
            return gm
        except Exception as e:  # a forward that needs all its layers (indexes them, checks the count ...)
            warn(
                log,
                "capture: could not trace %s with %d of its %d layers (%s: %s); capturing every layer",
                path,
                k,
                total,
                type(e).__name__,
                str(e)[:200],
            )
            ctx.sampled_layers = None
    ctx.param_modules = _param_modules(model)
    return capture(model, ctx.example_inputs, ctx)
