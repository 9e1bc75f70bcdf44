"""Joint forward+backward capture, the forward/backward partitioner and Inductor (private torch APIs)."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from autoshard.errors import InputError

# ----------------------------------------------------------------------------------------------- capture


@dataclass(frozen=True)
class InputRole:
    """What a joint-graph placeholder is: a parameter, a buffer, a user input or a tangent."""

    kind: str  # "parameter" | "buffer" | "input" | "tangent"
    name: str  # parameter/buffer FQN, "input[i]" or "tangent[i]"
    index: int  # position among placeholders of that kind


@dataclass(frozen=True)
class OutputRole:
    kind: str  # "loss" | "output" | "buffer" | "grad" | "input_grad" | "none"
    # "output[i]", the buffer FQN the forward updates, the parameter FQN whose gradient this is, or "input[i]" for an
    # input's gradient
    name: str


def new_fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)


def export_joint(
    stack: contextlib.ExitStack,
    module: torch.nn.Module,
    args: tuple[Any, ...],
    fake_mode: FakeTensorMode,
    decompositions: dict | None = None,
) -> fx.GraphModule:
    """Trace ``module(*args)`` into one joint forward+backward ATen graph with fake tensors."""
    from torch._export.utils import _compiling_state_context
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    with fake_mode, _compiling_state_context():
        jd = aot_export_joint_with_descriptors(
            stack, module, args, decompositions=decompositions, _record_nn_module_stack=True
        )
    return jd.graph_module


def split_for_pipeline(module: torch.nn.Module, args: tuple[Any, ...], split_spec: dict[str, Any]) -> Any:
    """``torch.distributed.pipelining.pipeline`` traced under torch.export's compiling state (as ``export_joint``
    is), so that model code which checks ``torch.compiler.is_compiling()`` takes its traceable path."""
    from unittest import mock

    from torch._export.utils import _compiling_state_context
    from torch.distributed.pipelining import _IR, pipeline

    # pipelining rebuilds each stage's module hierarchy from the trace's module stack ("outlining"); on modules
    # called with values computed inside the model (HF rotary embeddings) the rebuilt calls lose their
    # arguments. Each stage stays one flat graph here (parameter names are the model's either way).
    # A tied parameter has several names and pipelining resolves it in each stage by the first of a *set* of
    # them (an order that changes with the process's hash seed): a stage holding only the LM head then looks up
    # the embedding's path and fails. Each stage gets the names it can resolve first.
    sink = getattr(_IR, "_sink_params", None)

    def resolvable_first(mod: torch.nn.Module, inputs_to_state: dict, scope: list, *rest: Any, **kw: Any) -> Any:
        ordered = {k: sorted(sorted(v), key=lambda fqn: not _has_path(mod, fqn)) for k, v in inputs_to_state.items()}
        return sink(mod, ordered, scope, *rest, **kw)

    with contextlib.ExitStack() as stack:
        stack.enter_context(_compiling_state_context())
        if hasattr(_IR, "_outline_submodules"):
            stack.enter_context(mock.patch.object(_IR, "_outline_submodules", lambda graph: graph.owning_module))
        if sink is not None:
            stack.enter_context(mock.patch.object(_IR, "_sink_params", resolvable_first))
        return pipeline(module, mb_args=args, split_spec=split_spec)


def _has_path(mod: Any, fqn: str) -> bool:
    for atom in fqn.split("."):
        if not hasattr(mod, atom):
            return False
        mod = getattr(mod, atom)
    return True


def placeholder_role(node: fx.Node) -> InputRole:
    desc = node.meta.get("desc")
    cls = type(desc).__name__
    if cls == "ParamAOTInput":
        return InputRole("parameter", desc.target, -1)
    if cls == "BufferAOTInput":
        return InputRole("buffer", desc.target, -1)
    if cls == "PlainAOTInput":
        return InputRole("input", f"input[{desc.idx}]", desc.idx)
    if cls == "TangentAOTInput":
        out = desc.output
        idx = getattr(out, "idx", 0)
        return InputRole("tangent", f"tangent[{idx}]", idx)
    raise NotImplementedError(
        f"autoshard cannot place graph input {node.name} with descriptor {desc!r}: only parameters, buffers, "
        "plain tensor inputs and tangents are supported"
    )


def output_roles(output_node: fx.Node) -> list[OutputRole]:
    descs = output_node.meta.get("desc") or []
    roles = []
    for i, d in enumerate(descs):
        cls = type(d).__name__
        if cls == "PlainAOTOutput":
            roles.append(OutputRole("output", f"output[{d.idx}]"))
        elif cls == "GradAOTOutput":
            target = getattr(d.grad_of, "target", None)
            if type(d.grad_of).__name__ == "PlainAOTInput":
                roles.append(OutputRole("input_grad", f"input[{d.grad_of.idx}]"))
            elif target is None:
                roles.append(OutputRole("none", f"grad[{i}]"))
            else:
                roles.append(OutputRole("grad", target))
        elif d is None:
            roles.append(OutputRole("none", f"none[{i}]"))
        elif cls == "InputMutationAOTOutput" and type(d.mutated_input).__name__ == "BufferAOTInput":
            roles.append(OutputRole("buffer", d.mutated_input.target))  # the buffer's value after the forward
        elif cls == "InputMutationAOTOutput":
            raise InputError(
                f"the forward writes in place into {d.mutated_input!r} (e.g. an input tensor or a parameter "
                "updated with copy_ / add_); autoshard plans programs that update only buffers (BatchNorm's running "
                "statistics, register_buffer state). Return the new value instead of writing into the input"
            )
        else:
            raise NotImplementedError(f"autoshard does not support graph output descriptor {d!r}")
    return roles


def data_dependent_op(e: BaseException) -> str | None:
    """The op (or condition) whose value a fake-tensor trace needed, if ``e`` (or its cause) is that failure."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    seen = 0
    cur: BaseException | None = e
    while cur is not None and seen < 8:
        if isinstance(cur, DataDependentOutputException):
            return str(cur.func)
        if isinstance(cur, GuardOnDataDependentSymNode):
            return f"a condition on a data-dependent value: {str(cur).splitlines()[0][:120]}"
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return None


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    from torch.utils._pytree import tree_flatten as flatten

    return flatten(tree)


def tree_flatten_with_path(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """(key path, leaf) pairs and the spec; key paths are tuples of SequenceKey(idx=) / MappingKey(key=) /
    GetAttrKey(name=)."""
    from torch.utils._pytree import tree_flatten_with_path as flatten

    return flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    from torch.utils._pytree import tree_unflatten as unflatten

    return unflatten(leaves, spec)


def is_fake(t: object) -> bool:
    return isinstance(t, FakeTensor)


# ------------------------------------------------------------------------------- partition and compile


def draws_random(node: fx.Node) -> bool:
    """Whether an op draws random numbers: tagged ``nondeterministic_seeded`` and, for the ops tagged so only
    because they can draw (the attention kernels' ``dropout_p``), drawing at the value given."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", schema.arguments[i].default_value)
    return not (isinstance(p, (int, float)) and p == 0)


def partition_joint(gm: fx.GraphModule, num_fwd_outputs: int) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split a joint graph (placeholders ``primals_*``/``tangents_*``) into forward and backward graphs.

    The forward returns its ``num_fwd_outputs`` outputs followed by the tensors saved for backward; the
    backward takes the saved tensors followed by the tangents.
    """
    from unittest import mock

    from torch._functorch import partitioners

    _tag_forward(gm, num_fwd_outputs)
    _inline_constant_items(gm)
    primals = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("primals")]
    tangents = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]

    def replays_draws(g: fx.GraphModule) -> bool:  # (an attention kernel at dropout_p=0 replays no draw)
        return any(partitioners.must_recompute(n) and draws_random(n) for n in g.graph.nodes)

    with mock.patch.object(partitioners, "has_recomputable_rng_ops", replays_draws):
        fw, bw = partitioners.default_partition(gm, [primals, tangents], num_fwd_outputs=num_fwd_outputs)
    _drop_unused(fw, keep_draws=True)
    _drop_unused(bw, keep_draws=False)  # (an unread draw copied into the backward would move the generator again)
    return fw, bw


def _inline_constant_items(gm: fx.GraphModule) -> None:
    """Drop unused items of multi-output ops, and write items that are constants (not tensors or symbols) into
    their users' arguments: the partitioner saves only tensors and symbols, and CUDA flash attention returns
    ``None`` sequence offsets and ``int`` maximum lengths that its backward takes back."""
    import operator

    from torch.fx.node import map_arg

    for n in list(gm.graph.find_nodes(op="call_function", target=operator.getitem)):
        if not n.users:  # an unused item (CUDA cudnn attention's, carrying no value metadata)
            gm.graph.erase_node(n)
            continue
        if "val" not in n.meta:
            continue
        v = n.meta["val"]
        if v is not None and (type(v) not in (int, float, bool)):
            continue
        for user in list(n.users):
            user.args = map_arg(user.args, lambda a, v=v, n=n: v if a is n else a)
            user.kwargs = map_arg(user.kwargs, lambda a, v=v, n=n: v if a is n else a)
        if not n.users:
            gm.graph.erase_node(n)
    gm.recompile()


def _drop_unused(gm: fx.GraphModule, keep_draws: bool) -> None:
    """Remove ops nothing uses, but collectives. The partitioner leaves a multi-output forward op (attention)
    in the backward when only its saved pieces are used there; FX's own dead-code pass keeps it, as CPU
    flash attention is tagged random (dropout), so it would run twice."""
    for n in reversed(list(gm.graph.nodes)):
        if n.op != "call_function" or n.users:
            continue
        if isinstance(n.target, torch._ops.OpOverload) and (
            n.target.namespace == "_c10d_functional"
            or n.target._schema.is_mutable
            or (keep_draws and n.target.namespace == "autoshard")
        ):
            continue  # (an unread autoshard draw of the forward still moves the generator, as one device's does)
        gm.graph.erase_node(n)
    gm.recompile()


def _tag_forward(gm: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Tag the ancestors of the forward outputs ``partitioner_tag="is_forward"``.

    ``default_partition`` takes as forward every node up to the LAST node carrying that tag (AOTAutograd tags
    its joint graphs; a graph traced by ``make_fx`` has none). Untagged, the forward ends at the last primal:
    only the primals are saved and the backward recomputes the whole forward, collectives included.
    The tagged nodes are also moved ahead of every other (keeping their order; they only use each other), as
    the forward output's own collective (the loss's all-reduce) is traced last, after the backward.
    """
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    stack = [a for a in outs[:num_fwd_outputs] if isinstance(a, fx.Node)]
    seen: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen or n.name.startswith("tangents"):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    # the other outputs of a forward op (attention's logsumexp, layer norm's mean/rstd) are forward values
    # too, only used by the backward; untagged, the backward would run the op again to get them
    seen |= {u for n in list(seen) for u in n.users if u.target is operator.getitem}
    for n in seen:
        n.meta["partitioner_tag"] = "is_forward"
    placeholders = gm.graph.find_nodes(op="placeholder")
    if not placeholders:
        return
    anchor = placeholders[-1]
    for n in [n for n in gm.graph.nodes if n in seen and n.op != "placeholder"]:
        anchor.append(n)
        anchor = n
    gm.recompile()


# Inductor settings every autoshard graph is compiled with:
# - ``fallback_random``: random ops as one device runs them (ATen's kernels on the default generator), not
#   Inductor's own draws;
# - ``force_pointwise_cat``: a ``cat`` is a copy into a new buffer, as the traced graph (and the memory model,
#   ``autoshard/cost/memory.py``) has it. Inductor's default lowers a ``cat`` into one buffer its inputs' producers
#   write in place (ConcatKernel); the lowering's gradient buckets (``compiler/lower_buckets.py``) concatenate the
#   bias and norm gradients of every layer, so each layer's bias reduction then writes into the bucket, and the
#   scheduler (``reorder_for_peak_memory`` included) can no longer run it before the last layer's: every layer's
#   activation gradients, which those reductions read, stay alive to the end of the backward. Measured on a stock
#   4-layer GPT-2 (dp=2, ``benchmarks/memory_truth.py``): the backward's own buffers peak at 37.9 MiB against
#   26.6 MiB with this setting and 25.0 MiB in the traced graph's order (docs/benchmarks.md, memory section).
INDUCTOR_CONFIG: dict[str, Any] = {"fallback_random": True, "force_pointwise_cat": True}


def inductor_compile(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
    """Compile an ATen graph (already functional, no autograd) with Inductor (``INDUCTOR_CONFIG``); returns
    f(list) -> outputs."""
    import copy
    import logging

    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner

    try:
        with inductor_config.patch(INDUCTOR_CONFIG):
            compiled = compile_fx_inner(copy.deepcopy(gm), list(example_inputs))
    except Exception as e:
        if "CppCSEVariable" not in str(e) or example_inputs and example_inputs[0].device.type != "cpu":
            raise
        # Inductor's vectorized C++ code generation asserts on some int64 masks (seen on vocab-parallel
        # embeddings and losses, torch 2.13): the same graph without vectorization
        logging.getLogger(__name__).warning(
            "Inductor's vectorized C++ code generation failed (%s); compiling this graph without vectorization",
            str(e).splitlines()[0][:160],
        )
        with inductor_config.patch({**INDUCTOR_CONFIG, "cpp.simdlen": 1}):
            compiled = compile_fx_inner(gm, list(example_inputs))

    def run(args: list[torch.Tensor]) -> Any:
        return compiled(list(args))

    run.source_code = getattr(compiled, "source_code", "")  # type: ignore[attr-defined]  # Inductor's output code
    return run


def planning_decompositions() -> dict:
    """Ops decomposed at capture because DTensor can only replicate them whole but shards their parts
    (mse_loss with a sharded batch would otherwise force gathering predictions and targets), or because its
    rule is wrong for some inputs (``nll_loss_forward``, below)."""
    from torch._decomp import get_decompositions

    aten = torch.ops.aten
    table = get_decompositions([aten.mse_loss, aten.mse_loss_backward])
    # batch norm in training: its statistics as sums over batch and space, so that a batch-sharded input adds
    # them up across the data-parallel ranks (SyncBatchNorm's global statistics) instead of gathering the batch
    table[aten._native_batch_norm_legit_functional.default] = _batch_norm_by_sums
    table.update(get_decompositions([aten.native_batch_norm_backward]))
    # group norm's backward as reductions: DTensor has no rule for the fused op (it ran replicated), and its CPU
    # kernel reads a contiguous gradient with a channels-last input wrongly (the gradient a gather returns)
    table.update(get_decompositions([aten.native_group_norm_backward]))
    table[aten.nll_loss_forward.default] = _nll_loss_mean_as_sum
    return table


def _batch_norm_by_sums(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    training: bool,
    momentum: float,
    eps: float,
) -> Any:
    """Training batch norm with its mean and (biased) variance as two sums over every dim but the channels (two
    passes, as ATen's own), each a linear reduction that DTensor sums across a sharded batch; returns what the
    ATen op does: output, saved mean and 1/std per channel, the updated running mean and variance."""
    if not training:
        return NotImplemented
    dims = [0, *range(2, x.ndim)]
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xs = x.to(acc)
    n = x.numel() // x.shape[1]
    mean = xs.sum(dims, keepdim=True) / n
    centred = xs - mean
    var = (centred * centred).sum(dims, keepdim=True) / n
    rstd = torch.rsqrt(var + eps)
    out = centred * rstd
    per_channel = [1, -1] + [1] * (x.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(per_channel)
    if bias is not None:
        out = out + bias.reshape(per_channel)
    mean, var, rstd = mean.flatten(), var.flatten(), rstd.flatten()
    new_mean = running_mean * (1 - momentum) + mean.to(running_mean.dtype) * momentum
    unbiased = var * (n / (n - 1)) if n > 1 else var
    new_var = running_var * (1 - momentum) + unbiased.to(running_var.dtype) * momentum
    # in ATen's layout (empty_like(x, x.suggest_memory_format())): contiguous unless x is channels-last; what
    # follows may draw in memory order (CPU dropout's mask is a bernoulli_ of empty_like: rules/random_draws.py)
    last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.ndim)
    channels_last = last is not None and x.is_contiguous(memory_format=last) and not x.is_contiguous()
    layout = last if channels_last else torch.contiguous_format
    return out.to(x.dtype).contiguous(memory_format=layout), mean, rstd, new_mean, new_var


def _nll_loss_mean_as_sum(
    self: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, reduction: int, ignore_index: int
) -> Any:
    """A mean cross-entropy as its sum over the counted targets divided by their count (what ATen computes).
    DTensor's rule for the mean on a batch-sharded input averages the shards' means, which is the global mean
    only when every shard counts as many targets: padding (``ignore_index``) makes them differ."""
    aten = torch.ops.aten
    if reduction != 1:  # 1 = mean
        return NotImplemented
    total, count = aten.nll_loss_forward.default(self, target, weight, 2, ignore_index)
    return total / count, count


def decomposition_table() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def _checkpoint_policy() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.PREFER_RECOMPUTE


PREFER_RECOMPUTE = _checkpoint_policy()


@contextlib.contextmanager
def tag_traced(node: fx.Node, key: str = "recompute") -> Iterator[None]:
    """While make_fx traces, put ``node.meta[key]`` (if set) on every node recorded inside the block."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    value = node.meta.get(key)
    mode = get_proxy_mode() if value is not None else None
    if mode is None:
        yield
        return
    graph = mode.tracer.graph
    before = list(graph.nodes)[-1] if len(graph.nodes) else None
    yield
    started = before is None
    for n in graph.nodes:
        if started and n.op == "call_function":
            n.meta[key] = value
        started = started or n is before
