"""capture: nn.Module + global-shaped example inputs -> joint forward+backward ATen graph.

Needs: a module called the way its users call it (``example_inputs``: positional, keyword or both, as real, fake
or meta tensors of GLOBAL shape) whose output holds a scalar loss: the tensor itself, the ``loss`` of a
``ModelOutput``/dict/object, a tuple's first element, or what ``PlanConfig.loss_fn`` picks (``loss_of``).

Guarantees on exit:
- one fx.GraphModule holding forward and backward together (``aot_export_joint_with_descriptors``), traced
  under FakeTensorMode, so no parameter or activation memory is allocated; every node has ``meta["val"]``
  (a FakeTensor, or a tuple of them);
- placeholders are ``primals_*`` (parameters, buffers, inputs) then ``tangents_*`` and carry
  ``meta["autoshard_role"]`` (an ``InputRole``: kind, name);
- every call node carries ``meta["autoshard_module"]`` (the module path it ran in, forward and backward alike,
  "" at top level) and ``meta["autoshard_phase"]`` ("forward" | "backward");
- ``ctx.output_roles`` lists the graph outputs: the loss, other forward outputs, one gradient per parameter that
  requires grad; a parameter that has none (``requires_grad=False``, a LoRA base weight) is marked
  ``meta["autoshard_frozen"]`` (``ir.is_frozen``).

Modules built on the meta device are materialized as fake tensors on a copy (tracing on bare meta tensors
silently drops the backward).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn

from autoshard import _torch_compat as tc
from autoshard.compiler.capture_cleanup import (
    constant_values,
    drop_assertions,
    drop_empty_concat_inputs,
    merge_tied_parameters,
)
from autoshard.compiler.context import PassContext
from autoshard.compiler.precision import place_parameter_casts, run_model
from autoshard.errors import AutoshardError, CallError, DataDependentError, InputError
from autoshard.inputs import CallSignature, as_call, describe, signature_of
from autoshard.rules import random_draws
from autoshard.weights.shards import is_unfilled

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
    return type(t) in (torch.Tensor, nn.Parameter) and not is_unfilled(t)


def _traceable(model: nn.Module, fake_mode: Any, device: torch.device) -> nn.Module:
    """The model itself, or, when some parameters/buffers cannot be traced as they are (meta device or a stand-in
    for it, ``weights/shards.py``, or tensor
    subclasses such as LocalTensorMode's), a structural copy holding fake stand-ins for them: same shape,
    dtype and requires_grad, no memory. Tied tensors stay tied (the deepcopy memo maps each once)."""
    tensors = list(model.parameters()) + list(model.buffers())
    if all(_is_plain(t) and not tc.is_fake(t) for t in tensors):
        return model
    memo: dict[int, Any] = {}
    for t in tensors:
        if id(t) in memo:
            continue
        dev = device if is_unfilled(t) or type(t) not in (torch.Tensor, nn.Parameter) else t.device
        with fake_mode:
            f = torch.empty(tuple(t.shape), dtype=t.dtype, device=dev)
        memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
    return copy.deepcopy(model, memo)


def _buffers_after_outputs(out_node: fx.Node, roles: list, model: str, stage: bool) -> list:
    """The joint graph returns the buffers the forward updates first (BatchNorm's running statistics); the
    program returns the loss first: move them after the forward's outputs, before the gradients, in place."""
    outs = list(out_node.args[0])
    updates = [i for i, r in enumerate(roles) if r.kind == "buffer"]
    if not updates:
        return roles
    if stage:
        names = ", ".join(roles[i].name.removeprefix("inner.") for i in updates[:3])
        raise InputError(
            f"{model}: the forward updates buffers ({names}); a pipeline runs the batch as micro-batches, and "
            "statistics over a micro-batch (BatchNorm's) are not the batch's, so pipeline stages do not take "
            "them. Plan without a 'pp' axis (data, tensor and the other parallelisms keep the batch's statistics), "
            "or freeze the buffers (BatchNorm: track_running_stats=False, or eval() on the norm layers)"
        )
    rest = [i for i in range(len(outs)) if roles[i].kind not in ("grad", "input_grad", "none", "buffer")]
    tail = [i for i in range(len(outs)) if i not in set(rest) | set(updates)]
    order = rest + updates + tail
    out_node.args = (type(out_node.args[0])(outs[i] for i in order), *out_node.args[1:])
    descs = out_node.meta.get("desc")
    if descs is not None and len(descs) == len(outs):
        out_node.meta["desc"] = [descs[i] for i in order]
    return [roles[i] for i in order]


class _Outputs(nn.Module):
    """A pipeline stage: keeps every tensor the module returns (activations for the next stage, or the loss)."""

    def __init__(self, inner: nn.Module, signature: CallSignature, precision: Callable[..., Any]) -> None:
        super().__init__()
        self.inner = inner
        self.signature = signature
        self.precision = precision

    def forward(self, *tensors: Any) -> Any:
        args, kwargs = self.signature.unflatten(tensors)
        out = self.precision(self.inner, args, kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not outs or not all(isinstance(o, torch.Tensor) for o in outs):
            raise CallError(
                f"pipeline stage {type(self.inner).__name__} must return a tensor or a tuple of tensors, got "
                f"{type(out).__name__}"
            )
        return tuple(outs)


def loss_of(out: Any, model_name: str, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> torch.Tensor:
    """The loss in what forward returned: ``loss_fn(out)`` when given; else the tensor itself, the ``loss``
    of a ``ModelOutput``/dict/object, or a tuple's first element. Other outputs (logits, a KV cache) are
    dropped: the traced program computes only what the loss needs."""
    if loss_fn is not None:
        loss = loss_fn(out)
        where = "loss_fn(output)"
    elif isinstance(out, torch.Tensor):
        return out
    elif isinstance(out, Mapping) and "loss" not in out and not hasattr(out, "loss"):
        raise CallError(
            f"{model_name}.forward returned a {type(out).__name__} with keys {sorted(map(str, out))} and no 'loss'; "
            "return the loss under 'loss', or loss_fn= must pick it (a function of the output that returns the "
            "scalar loss)"
        )
    elif isinstance(out, Mapping) or hasattr(out, "loss"):
        loss = out.get("loss") if isinstance(out, Mapping) else out.loss
        where = f"{type(out).__name__}.loss"
        if loss is None:
            raise InputError(
                f"{model_name}.forward returned a {type(out).__name__} whose loss is None: pass the targets the "
                "model needs to compute its loss (labels=... for a Hugging Face model), or give loss_fn= (a "
                "function of the output that returns the scalar loss)"
            )
    elif isinstance(out, (tuple, list)) and out:
        loss, where = out[0], f"{type(out).__name__}[0]"
    else:
        loss, where = out, "the output"
    if not isinstance(loss, torch.Tensor):
        raise CallError(
            f"{model_name}.forward must return the loss (a scalar tensor), a ModelOutput/dict with a 'loss', or a "
            f"tuple whose first element is the loss, or loss_fn= must pick it; {where} is {type(loss).__name__}"
        )
    return loss


def loss_form(out: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Callable[[torch.Tensor], Any]:
    """How to return a loss shaped as the model returned it: its ``ModelOutput``/dict class with ``loss`` set
    (the other fields None: a training program computes the loss alone), a one-element tuple for a tuple, the
    tensor itself otherwise (or where ``loss_fn`` picked it)."""
    if loss_fn is not None or isinstance(out, torch.Tensor):
        return lambda loss: loss
    if isinstance(out, Mapping):
        cls = type(out)
        if cls is dict:
            return lambda loss: {"loss": loss}
        return lambda loss: cls(loss=loss)
    if isinstance(out, (tuple, list)):
        return lambda loss: (loss,)
    return lambda loss: loss


class _LossOnly(nn.Module):
    """Calls the model as the example call did and keeps only the loss (see ``loss_of``); ``form`` is then how
    the model shaped its output (``loss_form``)."""

    def __init__(
        self,
        inner: nn.Module,
        signature: CallSignature,
        loss_fn: Callable[[Any], torch.Tensor] | None,
        precision: Callable[..., Any],
    ) -> None:
        super().__init__()
        self.inner = inner
        self.signature = signature
        self.loss_fn = loss_fn
        self.precision = precision
        self.form: Callable[[torch.Tensor], Any] = lambda loss: loss

    def forward(self, *tensors: Any) -> torch.Tensor:
        args, kwargs = self.signature.unflatten(tensors)
        out = self.precision(self.inner, args, kwargs)
        self.form = loss_form(out, self.loss_fn)
        return loss_of(out, type(self.inner).__name__, self.loss_fn)


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


def _data_dependent(model: str, op: str, cause: BaseException) -> DataDependentError:
    """The error for a model whose Python branches on a tensor's value, which a trace with fake tensors cannot know."""
    where = _user_frame(cause)
    return DataDependentError(
        f"capture: {model}.forward reads a tensor's value in Python ({op}){where}. autoshard traces the "
        "training step once, with shapes but no values, into one program for every step, so a Python branch, "
        "loop count or .item()/.tolist() on a tensor cannot be followed. Compute it with tensor ops instead "
        "(torch.where, masks, torch.cond), or skip the check when torch.compiler.is_compiling() is true, as "
        "Hugging Face models do."
    )


def _user_frame(e: BaseException) -> str:
    """' at file:line (code)' of the innermost frame of the model's own code in the exception's traceback."""
    skip = (
        os.path.dirname(torch.__file__),
        os.path.dirname(os.path.abspath(__file__)),
        os.path.dirname(os.path.abspath(tc.__file__)).rpartition(os.sep)[0],
    )
    stdlib = os.path.dirname(contextlib.__file__)  # (but not the libraries installed under it: transformers)
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if not f.filename.startswith(skip) and not (f.filename.startswith(stdlib) and "-packages" not in f.filename)
    ]
    if not frames:
        return ""
    f = frames[-1]
    code = f" `{f.line.strip()}`" if f.line else ""
    return f" at {f.filename}:{f.lineno}{code}"


def _bound(model: nn.Module, example_inputs: Any) -> str:
    """How the example call binds to ``model.forward``'s parameters: ``input_ids=int64[4, 64], past_key_values=...``."""
    args, kwargs = as_call(example_inputs)
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return describe(args, kwargs)
    return ", ".join(f"{k}={describe((v,), {})[1:-1]}" for k, v in bound.items())


def capture(model: nn.Module, example_inputs: Sequence[Any], ctx: PassContext) -> fx.GraphModule:
    """``ctx.stage`` (a pipeline stage): every output is kept (role "output", one tangent each) and inputs that
    require grad get their gradient as an output (role "input_grad"); otherwise the first output is the loss."""
    device = torch.device(ctx.mesh.device_type)
    fake_mode = tc.new_fake_mode()
    traced = _traceable(model, fake_mode, device)
    signature, tensors = signature_of(example_inputs)
    ctx.signature = signature
    args = tuple(_fake_input(t, fake_mode, device, keep_grad=ctx.stage) for t in tensors)
    cfg = ctx.config

    def precision(inner: nn.Module, call_args: tuple, kwargs: dict) -> Any:
        return run_model(
            inner, call_args, kwargs, cfg.mixed_precision, cfg.precision_policy, device, cast_inputs=not ctx.stage
        )

    wrapper = (
        _Outputs(traced, signature, precision)
        if ctx.stage
        else _LossOnly(traced, signature, ctx.config.loss_fn, precision)
    )
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_annotate_modules(traced))
            gm = tc.export_joint(
                stack,
                wrapper,
                args,
                fake_mode,
                decompositions={**tc.planning_decompositions(), **random_draws.DECOMPOSITIONS},
            )
    except AutoshardError:
        raise
    except Exception as e:
        op = tc.data_dependent_op(e)
        if op is not None:
            raise _data_dependent(type(model).__name__, op, e) from e
        where = _user_frame(e)
        if not where:  # not raised in the model's code: autoshard's or torch's own failure, as it is
            raise
        raise CallError(
            f"capture: {type(model).__name__}.forward raised {type(e).__name__}: {str(e)[:300]}{where}, called with "
            f"the example inputs bound as {_bound(model, example_inputs)}. If an input went to the wrong parameter "
            "(a Hugging Face model's second positional parameter is not labels), pass it by keyword, e.g. "
            "example_inputs={'input_ids': ids, 'labels': labels}"
        ) from e
    changed = drop_assertions(gm)
    changed |= constant_values(gm, fake_mode)
    changed |= drop_empty_concat_inputs(gm)
    changed |= merge_tied_parameters(gm, traced)
    if changed:  # the module's code made once, and only when a cleanup changed the graph (40 ms on Mixtral's)
        gm.recompile()
    out_node = gm.graph.find_nodes(op="output")[0]
    roles = _buffers_after_outputs(out_node, tc.output_roles(out_node), type(model).__name__, ctx.stage)
    loss_val = out_node.args[0][0].meta.get("val") if out_node.args[0] else None
    if ctx.stage:
        pass
    elif not isinstance(loss_val, torch.Tensor) or loss_val.numel() != 1:
        shape = None if loss_val is None else tuple(getattr(loss_val, "shape", ()))
        raise InputError(
            f"{type(model).__name__}.forward must return a scalar loss to train; it returned shape {shape}. "
            "Reduce the output to a scalar (e.g. .mean() or a loss function) inside forward."
        )
    if not ctx.stage:
        roles[0] = tc.OutputRole("loss", "loss")
        ctx.loss_form = wrapper.form
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
    if place_parameter_casts(gm):
        gm.recompile()
    _inherit_modules(gm)
    ctx.output_roles = [
        tc.OutputRole(r.kind, r.name[len("inner.") :])
        if r.kind in ("grad", "buffer") and r.name.startswith("inner.")
        else r
        for r in ctx.output_roles
    ]
    trained = {r.name for r in ctx.output_roles if r.kind == "grad"}
    for node in gm.graph.find_nodes(op="placeholder"):  # a parameter without a gradient is frozen (ir.is_frozen)
        role = node.meta["autoshard_role"]
        node.meta["autoshard_frozen"] = role.kind == "parameter" and role.name not in trained
    ctx.stats["nodes_captured"] = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    log.info("capture: %d ops, %d placeholders", ctx.stats["nodes_captured"], sum(counts.values()))
    return gm
