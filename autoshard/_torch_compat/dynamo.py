"""What a ``torch.compile`` backend needs from dynamo's internals: the module being compiled."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn


def compiling_call(example_inputs: Sequence[Any]) -> tuple[nn.Module, tuple, dict[str, Any]] | None:
    """The ``nn.Module`` whose call dynamo is compiling (the one ``torch.compile`` was given) and the arguments
    of this call, found among the frames' locals: the module that owns parameters passed to the graph, and the
    ``args``/``kwargs`` it was called with (or the named arguments of its ``forward``). None when not found."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    if tx is None:
        return None
    inputs = {id(x) for x in example_inputs}
    frames = [tx]
    parent = getattr(tx, "parent", None)
    while parent is not None:
        frames.append(parent)
        parent = getattr(parent, "parent", None)

    def owns(value: object) -> bool:
        return isinstance(value, nn.Module) and any(id(p) in inputs for p in value.parameters())

    for frame in reversed(frames):  # the outermost frame first: the module torch.compile wraps
        local = frame.f_locals
        for key, value in local.items():
            if owns(value):
                if "args" in local or "kwargs" in local:
                    return value, tuple(local.get("args", ())), dict(local.get("kwargs", {}))
                return value, (), {k: v for k, v in local.items() if k != key}
        # a decorated forward (transformers >= 5.24 wraps it): the frame is ``wrapper(*args, **kwargs)`` and the
        # module is its first positional argument
        args = local.get("args")
        if isinstance(args, tuple) and args and owns(args[0]):
            return args[0], tuple(args[1:]), dict(local.get("kwargs", {}))
    return None


def graph_break_reason() -> str | None:
    """Why dynamo ended the graph it is compiling, when that is a graph break (not the end of the frame): the
    reason and the user's line, or None."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    reason = getattr(getattr(tx, "output", None), "compile_subgraph_reason", None) if tx is not None else None
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    where = ""
    stack = getattr(reason, "user_stack", None) or []
    if stack:
        frame = stack[-1]
        where = f" at {frame.filename}:{frame.lineno} ({frame.line})"
    return f"{reason.reason}{where}"


def forget_guards_on(gm: Any, tensors: Sequence[Any]) -> int:
    """Drop the guards dynamo recorded on graph inputs that are ``tensors`` (by identity): the parameters a
    backend re-lays out in place (same objects, new shapes). Their shapes were recorded while tracing, so the
    guards would fail on the very frame they are built for; the backend's program reads the parameters by name
    and never runs dynamo's graph, which they protected. Returns how many inputs were freed."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    if tx is None:
        return 0
    ids = {id(t) for t in tensors}
    freed = 0
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")
        if arg is not None and id(arg.example) in ids:
            tx.output.guards.remove_guards_with_source(arg.source)
            freed += 1
    return freed


def outside_dynamo() -> Any:
    """A context in which a backend can trace and compile programs of its own: without dynamo's tracing
    context (its fake mode and guards), as if called outside ``torch.compile``."""
    import contextlib

    import torch._guards

    stack = contextlib.ExitStack()
    stack.enter_context(torch._guards.tracing(None))
    return stack


def forget_guards_on_module(gm: Any, tensors: Sequence[Any]) -> str | None:
    """Drop every guard dynamo recorded on the module that holds ``tensors`` (its parameters): their shapes, its
    ``training`` flag, its attributes, and the global state (grad mode). For a backend whose program reads the
    module live (parameters by name, the mode at each call) and never runs dynamo's graph: a change of mode or of
    parameter layout must reach that program, not make dynamo trace the module again (on parameters that now hold
    shards). The module is the
    deepest source every one of ``tensors`` is reached from; returns its name (None if there is none)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    if tx is None:
        return None
    ids = {id(t) for t in tensors}
    chains = []
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")
        if arg is not None and id(arg.example) in ids:
            chain, src = [], arg.source
            while src is not None:
                chain.append(src)
                src = getattr(src, "base", None)
            chains.append(list(reversed(chain)))  # outermost first
    if not chains:
        return None
    common = None
    for depth in range(min(len(c) for c in chains)):
        names = {c[depth].name() if callable(getattr(c[depth], "name", None)) else str(c[depth]) for c in chains}
        if len(names) != 1:
            break
        common = chains[0][depth]
    if common is None:
        return None
    # the module itself, not its ``_modules`` / ``_parameters`` dict: guards on its attributes hang off it
    name = common.name() if callable(getattr(common, "name", None)) else str(common)
    while name.endswith(("._modules", "._parameters")) and getattr(common, "base", None) is not None:
        common = common.base
        name = common.name() if callable(getattr(common, "name", None)) else str(common)
    tx.output.guards.remove_guards_with_source(common)
    # and the global state (grad mode, autocast): the program's precision is planned, and evaluation runs its own
    from torch._dynamo.source import GlobalStateSource

    tx.output.guards.remove_guards_with_source(GlobalStateSource())
    return name
