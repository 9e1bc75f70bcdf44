"""Joint forward+backward capture, the forward/backward partitioner and Inductor (private torch APIs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode


# ----------------------------------------------------------------------------------------------- capture


@dataclass(frozen=True)
class InputRole:
    """What a joint-graph placeholder is: a parameter, a buffer, a user input or a tangent."""

    kind: str  # "parameter" | "buffer" | "input" | "tangent"
    name: str  # parameter/buffer FQN, "input[i]" or "tangent[i]"
    index: int  # position among placeholders of that kind


@dataclass(frozen=True)
class OutputRole:
    kind: str  # "loss" | "output" | "grad" | "input_grad" | "none"
    name: str  # "output[i]", the parameter FQN whose gradient this is, or "input[i]" for an input's gradient


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
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    with fake_mode:
        jd = aot_export_joint_with_descriptors(
            stack, module, args, decompositions=decompositions, _record_nn_module_stack=True
        )
    return jd.graph_module


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
        else:
            raise NotImplementedError(f"autoshard does not support graph output descriptor {d!r}")
    return roles


def is_fake(t: object) -> bool:
    return isinstance(t, FakeTensor)


# ------------------------------------------------------------------------------- partition and compile


def partition_joint(gm: fx.GraphModule, num_fwd_outputs: int) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split a joint graph (placeholders ``primals_*``/``tangents_*``) into forward and backward graphs.

    The forward returns its ``num_fwd_outputs`` outputs followed by the tensors saved for backward; the
    backward takes the saved tensors followed by the tangents.
    """
    from torch._functorch.partitioners import default_partition

    primals = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("primals")]
    tangents = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]
    return default_partition(gm, [primals, tangents], num_fwd_outputs=num_fwd_outputs)


def inductor_compile(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable[..., Any]:
    """Compile an ATen graph (already functional, no autograd) with Inductor; returns f(list) -> outputs."""
    from torch._inductor.compile_fx import compile_fx_inner

    compiled = compile_fx_inner(gm, list(example_inputs))

    def run(args: list[torch.Tensor]) -> Any:
        return compiled(list(args))

    return run


def planning_decompositions() -> dict:
    """Ops decomposed at capture because DTensor can only replicate them whole but shards their parts
    (mse_loss with a sharded batch would otherwise force gathering predictions and targets)."""
    from torch._decomp import get_decompositions

    aten = torch.ops.aten
    return get_decompositions([aten.mse_loss, aten.mse_loss_backward])


def decomposition_table() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()
