"""capture: nn.Module + global-shaped example inputs -> joint forward+backward ATen graph.

Needs: a module whose ``forward(*example_inputs)`` returns a scalar loss (or a tuple whose first element is the
loss); example inputs as real, fake or meta tensors of GLOBAL shape.

Guarantees on exit:
- one fx.GraphModule holding forward and backward together (``aot_export_joint_with_descriptors``), traced
  under FakeTensorMode, so no parameter or activation memory is allocated; every node has ``meta["val"]``
  (a FakeTensor, or a tuple of them);
- placeholders are ``primals_*`` (parameters, buffers, inputs) then ``tangents_*`` and carry
  ``meta["autoshard_role"]`` (an ``InputRole``: kind, name);
- every call node carries ``meta["autoshard_module"]`` (the module path it ran in, forward and backward alike,
  "" at top level) and ``meta["autoshard_phase"]`` ("forward" | "backward");
- ``ctx.output_roles`` lists the graph outputs: the loss, other forward outputs, one gradient per parameter.

Modules built on the meta device are materialized as fake tensors on a copy (tracing on bare meta tensors
silently drops the backward).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn

from autoshard import _torch_compat as tc
from autoshard.passes.context import PassContext

log = logging.getLogger(__name__)


def _fake_input(t: Any, fake_mode: Any, device: torch.device, keep_grad: bool = False) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if tc.is_fake(t) and t.fake_mode is fake_mode:
        return t
    dev = device if t.device.type == "meta" or tc.is_fake(t) else t.device
    with fake_mode:
        f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=dev)
    return f.requires_grad_(True) if keep_grad and t.requires_grad and t.is_floating_point() else f


@contextlib.contextmanager
def _annotate_modules(model: nn.Module):
    """Tag every traced node with the path of the module it ran in (the backward inherits the tag)."""
    handles = []
    open_scopes: list[contextlib.AbstractContextManager] = []

    for name, mod in model.named_modules():
        if not name:
            continue

        def pre(_m: nn.Module, _args: Any, _name: str = name) -> None:
            cm = fx_traceback.annotate({"autoshard_module": _name})
            cm.__enter__()
            open_scopes.append(cm)

        def post(_m: nn.Module, _args: Any, _out: Any) -> None:
            open_scopes.pop().__exit__(None, None, None)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        for h in handles:
            h.remove()
        while open_scopes:  # a forward that raised left scopes open
            try:
                open_scopes.pop().__exit__(None, None, None)
            except KeyError:
                pass


def _is_plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and t.device.type != "meta"


def _traceable(model: nn.Module, fake_mode: Any, device: torch.device) -> nn.Module:
    """The model itself, or, when some parameters/buffers cannot be traced as they are (meta device, or tensor
    subclasses such as LocalTensorMode's), a structural copy holding fake stand-ins for them: same shape,
    dtype and requires_grad, no memory. Tied tensors stay tied (the deepcopy memo maps each once)."""
    tensors = list(model.parameters()) + list(model.buffers())
    if all(_is_plain(t) and not tc.is_fake(t) for t in tensors):
        return model
    memo: dict[int, Any] = {}
    for t in tensors:
        if id(t) in memo:
            continue
        dev = device if t.device.type == "meta" or type(t) not in (torch.Tensor, nn.Parameter) else t.device
        with fake_mode:
            f = torch.empty(tuple(t.shape), dtype=t.dtype, device=dev)
        memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
    return copy.deepcopy(model, memo)


class _Outputs(nn.Module):
    """A pipeline stage: keeps every tensor the module returns (activations for the next stage, or the loss)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        out = self.inner(*args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
            raise TypeError(
                f"pipeline stage {type(self.inner).__name__} must return a tensor or a tuple of tensors, got "
                f"{type(out).__name__}"
            )
        return tuple(outs)


class _LossOnly(nn.Module):
    """Keeps the traced program's first output (the loss) when forward returns a tuple or a HF-style output."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> torch.Tensor:
        out = self.inner(*args)
        if isinstance(out, torch.Tensor):
            return out
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, (tuple, list)) and out:
            loss = out[0]
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"{type(self.inner).__name__}.forward must return the loss (a scalar tensor), or a tuple / "
                f"output object whose first element or .loss is the loss; got {type(out).__name__}"
            )
        return loss


def _inherit_modules(gm: fx.GraphModule) -> None:
    """Autograd's own nodes (gradient accumulation of a tensor used twice) ran in no module: give them the
    module of their most recently computed input, so each stays inside one layer (the one the backward is
    working on) and identical layers stay identical."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get("autoshard_module"):
            continue
        ins = [a for a in node.all_input_nodes if a.op == "call_function" and a.meta.get("autoshard_module")]
        if ins:
            node.meta["autoshard_module"] = max(ins, key=order.__getitem__).meta["autoshard_module"]


def _drop_assertions(gm: fx.GraphModule) -> None:
    """Remove metadata assertions (``_assert_tensor_metadata`` from an exported ``.to()``, as in the stage modules
    ``torch.distributed.pipelining`` cuts): checks of the traced program with no value to place or run."""
    aten = torch.ops.aten
    asserts = {aten._assert_tensor_metadata.default, aten._assert_scalar.default, aten._assert_async.msg}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in asserts and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def capture(model: nn.Module, example_inputs: Sequence[Any], ctx: PassContext) -> fx.GraphModule:
    """``ctx.stage`` (a pipeline stage): every output is kept (role "output", one tangent each) and inputs that
    require grad get their gradient as an output (role "input_grad"); otherwise the first output is the loss."""
    device = torch.device(ctx.mesh.device_type)
    fake_mode = tc.new_fake_mode()
    traced = _traceable(model, fake_mode, device)
    args = tuple(_fake_input(t, fake_mode, device, keep_grad=ctx.stage) for t in example_inputs)
    wrapper = _Outputs(traced) if ctx.stage else _LossOnly(traced)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_annotate_modules(traced))
        gm = tc.export_joint(stack, wrapper, args, fake_mode, decompositions=tc.planning_decompositions())
    _drop_assertions(gm)
    out_node = gm.graph.find_nodes(op="output")[0]
    roles = tc.output_roles(out_node)
    loss_val = out_node.args[0][0].meta.get("val") if out_node.args[0] else None
    if ctx.stage:
        pass
    elif not isinstance(loss_val, torch.Tensor) or loss_val.numel() != 1:
        shape = None if loss_val is None else tuple(getattr(loss_val, "shape", ()))
        raise ValueError(
            f"{type(model).__name__}.forward must return a scalar loss to train; it returned shape {shape}. "
            "Reduce the output to a scalar (e.g. .mean() or a loss function) inside forward."
        )
    if not ctx.stage:
        roles[0] = tc.OutputRole("loss", "loss")
    ctx.output_roles = roles
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            role = tc.placeholder_role(node)
            # the wrapper adds an "inner." prefix to every parameter and buffer name
            if role.kind in ("parameter", "buffer") and role.name.startswith("inner."):
                role = tc.InputRole(role.kind, role.name[len("inner.") :], role.index)
            idx = counts.get(role.kind, 0)
            counts[role.kind] = idx + 1
            node.meta["autoshard_role"] = tc.InputRole(role.kind, role.name, idx)
            node.meta["autoshard_module"] = role.name.rpartition(".")[0] if role.kind in ("parameter", "buffer") else ""
            node.meta["autoshard_phase"] = "backward" if role.kind == "tangent" else "forward"
        elif node.op == "call_function":
            custom = node.meta.get("custom") or {}
            node.meta["autoshard_module"] = custom.get("autoshard_module", "")
            tag = node.meta.get("partitioner_tag", "is_forward")
            node.meta["autoshard_phase"] = "backward" if tag == "is_backward" else "forward"
    _inherit_modules(gm)
    ctx.output_roles = [
        tc.OutputRole(r.kind, r.name[len("inner.") :]) if r.kind == "grad" and r.name.startswith("inner.") else r
        for r in ctx.output_roles
    ]
    ctx.stats["nodes_captured"] = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    log.info("capture: %d ops, %d placeholders", ctx.stats["nodes_captured"], sum(counts.values()))
    return gm
