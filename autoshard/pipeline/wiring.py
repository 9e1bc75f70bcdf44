"""Cutting a model into pipeline stages, and how values travel between the stages.

``torch.distributed.pipelining.pipeline`` traces the model, called as the user calls it (positional or keyword
arguments, a ``ModelOutput`` of which only the loss is kept), and splits the traced graph at the chosen layers
into one ``GraphModule`` per stage. Each stage's arguments are model inputs or values made by earlier stages.
torch's schedules send activations from stage k to stage k+1 only, so here:

- a model input goes straight to every stage that uses it (every rank has the global batch, and the schedule
  cuts keyword arguments into micro-batches for each of its stages): the attention mask in every layer's stage,
  the labels in the last;
- a value made in stage j and used in a stage k > j+1 (rotary tables, a causal mask built once from the
  attention mask) is relayed: each stage in between sends it on with its own outputs.

``StageWiring`` (``autoshard/runtime/stage_values.py``, which the runtime reads) says, per stage, where each
argument of its graph comes from and what it sends on.

The last stage ends in the model's loss, one per micro-batch. The schedule averages them; that equals the
whole batch's loss when every micro-batch counts alike. A mean cross-entropy with ignored targets (padding)
does not: ``loss_counter`` finds how many targets each micro-batch counts and weights its loss so that the
step's loss and gradients are the whole batch's, as on one device.
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autoshard import _torch_compat as tc
from autoshard.errors import InputError
from autoshard.inputs import CallSignature
from autoshard.ir import kept_target_counter, node_arg
from autoshard.runtime.stage_values import MEAN, Source, StageWiring, stage_args, stage_sends


def _loss_call(
    model: nn.Module,
    signature: CallSignature,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    input_dtype: torch.dtype | None = None,
) -> nn.Module:
    """The model called as the example call did (flat tensors in), returning only its loss: a shallow copy that
    shares the model's parameters, buffers and children (traced names are the model's own) with a forward that
    runs the model's and keeps the loss (``passes.capture.loss_of``); floating inputs cast to ``input_dtype``."""
    from autoshard.compiler.capture import loss_of

    wrapper = copy.copy(model)
    cls_forward = type(model).forward

    def forward(*tensors: torch.Tensor) -> torch.Tensor:
        if input_dtype is not None:
            tensors = tuple(
                t.to(input_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors
            )
        args, kwargs = signature.unflatten(tensors)
        return loss_of(cls_forward(wrapper, *args, **kwargs), type(model).__name__, loss_fn)

    wrapper.forward = forward  # type: ignore[method-assign]
    return wrapper


def split_model(
    model: nn.Module,
    signature: CallSignature,
    tensors: Sequence[torch.Tensor],
    split_spec: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    param_dtype: torch.dtype | None = None,
) -> tuple[Any, list[StageWiring]]:
    """The ``torch.distributed.pipelining`` Pipe of ``model`` cut at ``split_spec`` (traced on the micro-batch
    ``tensors``, the call's tensors in ``signature`` order) and each stage's wiring. ``param_dtype`` (mixed
    precision's bf16 parameters, ``autoshard/compiler/precision.py``): the model is traced with its floating
    parameters and inputs in that dtype, so what its code decides from a dtype (``x.to(weight.dtype)``) is
    decided as the stages run; the stages get the model's own parameters back, which each stage's program
    casts."""
    device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))
    with _stand_ins(model, device, param_dtype) as stand:
        pipe = tc.split_for_pipeline(_loss_call(model, signature, loss_fn, param_dtype), tuple(tensors), split_spec)
    if stand:
        _originals_again(pipe, stand)
    for k in range(pipe.num_stages - 1):
        _contiguous_outputs(pipe.get_stage_module(k))
    return pipe, wiring_of(pipe.split_gm.graph)


def _contiguous_outputs(stage: fx.GraphModule) -> None:
    """Each output of a stage made contiguous in its graph: a stage sends whole buffers and gets back
    contiguous gradients, so the gradients its program is traced with must be contiguous too (ConvNeXt's
    layers end in a permute back from channels-last, whose gradient the traced backward would view in the
    permuted strides it does not have)."""
    out = stage.graph.find_nodes(op="output")[0]
    values = out.args[0]
    single = not isinstance(values, (tuple, list))
    made = []
    with stage.graph.inserting_before(out):
        for v in (values,) if single else values:
            val = v.meta.get("val") if isinstance(v, fx.Node) else None
            if isinstance(val, torch.Tensor) and not val.is_contiguous():
                c = stage.graph.call_method("contiguous", (v,))
                c.meta = {**v.meta, "val": val.contiguous()} if "val" in v.meta else dict(v.meta)
                made.append(c)
            else:
                made.append(v)
    out.args = (made[0] if single else type(values)(made),)
    stage.recompile()


@contextlib.contextmanager
def _stand_ins(
    model: nn.Module, device: torch.device, param_dtype: torch.dtype | None = None
) -> Iterator[dict[int, torch.Tensor]]:
    """A model built on the meta device is traced with each meta parameter and buffer replaced by a stand-in on
    the inputs' ``device`` that holds one element, expanded to the full shape (no memory): the trace then records
    the devices the stages run on. With ``param_dtype``, every floating parameter gets a stand-in of that dtype.
    Yields stand-in id -> the original; the model gets its originals back."""
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    made: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for table in (m._parameters, m._buffers):
            for leaf, t in list(table.items()):
                recast = param_dtype is not None and table is m._parameters and t is not None and t.is_floating_point()
                if t is None or (t.device.type != "meta" and not recast):
                    continue
                if id(t) not in made:
                    dev = device if t.device.type == "meta" else t.device
                    fill = torch.zeros((), dtype=param_dtype if recast else t.dtype, device=dev).expand(t.shape)
                    made[id(t)] = (
                        nn.Parameter(fill, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fill
                    )
                swapped.append((table, leaf, t))
                table[leaf] = made[id(t)]
    try:
        yield {id(made[id(t)]): t for _, _, t in swapped}
    finally:
        for table, leaf, t in swapped:
            table[leaf] = t


def _originals_again(pipe: Any, stand: dict[int, torch.Tensor]) -> None:
    """The stages' stand-ins replaced by their originals: a meta original by a new meta tensor (tied ones shared:
    the runtime replaces and empties a stage's parameters, while the model keeps its own for ``init_weights``),
    any other by the original itself."""
    fresh: dict[int, torch.Tensor] = {}
    for k in range(pipe.num_stages):
        for m in pipe.get_stage_module(k).modules():
            for table in (m._parameters, m._buffers):
                for leaf, t in list(table.items()):
                    orig = stand.get(id(t)) if t is not None else None
                    if orig is None:
                        continue
                    if orig.device.type != "meta":
                        table[leaf] = orig
                        continue
                    if id(t) not in fresh:
                        empty = torch.empty(orig.shape, dtype=orig.dtype, device="meta")
                        fresh[id(t)] = (
                            nn.Parameter(empty, orig.requires_grad) if isinstance(orig, nn.Parameter) else empty
                        )
                    table[leaf] = fresh[id(t)]


def wiring_of(graph: fx.Graph) -> list[StageWiring]:
    """Each stage's wiring from the Pipe's top-level graph (placeholders: model inputs; ``submod_*`` calls: the
    stages, in order; ``getitem`` on a call: one output of a stage with several)."""
    root = {n: i for i, n in enumerate(graph.find_nodes(op="placeholder"))}
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]
    index = {c: k for k, c in enumerate(calls)}

    def source(a: Any) -> tuple[str, Any]:
        if a in root:
            return ("input", root[a])
        if isinstance(a, fx.Node) and a.op == "call_function" and a.target is operator.getitem and a.args[0] in index:
            return ("value", (index[a.args[0]], int(a.args[1])))
        if a in index:
            return ("value", (index[a], 0))
        raise InputError(f"pipeline stage argument {a} is neither a model input nor a stage's output")

    uses = []
    for call in calls:
        if call.kwargs:
            raise InputError(f"pipeline stage {call.target} takes keyword arguments {sorted(call.kwargs)}")
        uses.append([source(a) for a in call.args])
    out = graph.find_nodes(op="output")[0].args[0]
    out = out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
    if out is not calls[-1]:
        raise InputError(
            "the model's loss must be the last pipeline stage's only output; here it is "
            f"{out}, not stage {len(calls) - 1}'s"
        )
    n = len(calls)
    # carry[k]: the values sent from stage k to k+1 (made at or before k, used after k), in a fixed order
    carry: list[list[tuple[int, int]]] = []
    for k in range(n - 1):
        later = {v for m in range(k + 1, n) for kind, v in uses[m] if kind == "value" and v[0] <= k}
        carry.append(sorted(later))
    wiring = []
    for k in range(n):
        prev = carry[k - 1] if k else []
        args = tuple(("input", v) if kind == "input" else ("recv", prev.index(v)) for kind, v in uses[k])
        if k == n - 1:
            sends: tuple[Source, ...] = (("out", 0),)
        else:
            sends = tuple(("out", v[1]) if v[0] == k else ("recv", prev.index(v)) for v in carry[k])
        wiring.append(StageWiring(args, sends, len(prev), k == n - 1))
    return wiring


def stage_examples(
    pipe: Any, wiring: Sequence[StageWiring], mb_tensors: Sequence[torch.Tensor], param_dtype: torch.dtype | None = None
) -> tuple[list[tuple[torch.Tensor, ...]], list[tuple[torch.Tensor, ...]]]:
    """Per stage: its graph's arguments and what it sends, as zero tensors of the micro-batch shapes (a
    fake-tensor run, no compute); a float value derived from parameters requires grad. ``param_dtype``: the
    stages run on their floating parameters in that dtype (``split_model``'s)."""
    fake = tc.new_fake_mode()
    args_out, sends_out = [], []
    received: tuple[torch.Tensor, ...] = ()
    for k, w in enumerate(wiring):
        args = stage_args(w, received, mb_tensors)
        stage = pipe.get_stage_module(k)
        with fake:
            fargs = [fake.from_tensor(a) for a in args]
            # a stage of a model built on the meta device runs with fake stand-ins on the inputs' device
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
            params = [
                (n, t, param_dtype if param_dtype is not None and t.is_floating_point() else t.dtype)
                for n, t in stage.named_parameters()
            ]
            meta = {
                n: torch.empty(
                    t.shape, dtype=dtype, device=device if t.device.type == "meta" else t.device
                ).requires_grad_(t.requires_grad)
                for n, t, dtype in [*params, *((n, t, t.dtype) for n, t in stage.named_buffers())]
                if t.device.type == "meta" or dtype != t.dtype
            }
            out = torch.func.functional_call(stage, meta, tuple(fargs)) if meta else stage(*fargs)
        outs = tuple(_like(o) for o in (out if isinstance(out, tuple) else (out,)))
        args_out.append(tuple(_like(a) for a in args))
        received = stage_sends(w, outs, received)
        sends_out.append(received)
    return args_out, sends_out


def _like(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad)


# ------------------------------------------------------------------------------------------- loss weights


def loss_counter(stage: fx.GraphModule, wiring: StageWiring) -> tuple[int, Callable[..., torch.Tensor] | None]:
    """The last stage's loss reduction and, for a mean cross-entropy / NLL loss with ignored targets, a function
    of the model inputs (micro-batch tensors) that counts the targets the loss averages over. (0, None) when the
    loss is something else: the micro-batches' losses are then averaged."""
    out = stage.graph.find_nodes(op="output")[0].args[0]
    loss = out[0] if isinstance(out, (tuple, list)) else out
    ops = {
        torch.ops.aten.cross_entropy_loss.default: (3, 4),
        torch.ops.aten.nll_loss.default: (3, 4),
        torch.ops.aten.nll_loss_nd.default: (3, 4),
    }
    if not isinstance(loss, fx.Node) or loss.target not in ops:
        return 0, None
    r_at, ig_at = ops[loss.target]
    reduction = node_arg(loss, r_at, "reduction", MEAN)
    weight = node_arg(loss, 2, "weight", None)
    if reduction != MEAN or weight is not None:
        return (reduction if weight is None else 0), None
    ignore = node_arg(loss, ig_at, "ignore_index", -100)
    target = loss.args[1]
    placeholders = stage.graph.find_nodes(op="placeholder")
    which = {placeholders[pos]: i for pos, (kind, i) in enumerate(wiring.args) if kind == "input"}
    counter, used = kept_target_counter(stage, target, ignore)
    if any(p not in which for p in used):
        return MEAN, None  # the targets depend on received values: cannot be counted from the inputs
    order = [which[p] for p in used]
    return MEAN, lambda inputs: counter(*[inputs[i] for i in order])


__all__ = ["loss_counter", "split_model", "stage_examples", "wiring_of"]
