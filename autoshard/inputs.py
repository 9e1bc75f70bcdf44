"""How the model is called: positional and keyword arguments, and the tensors the traced program takes.

Users call their models the way they always do (``model(input_ids=ids, attention_mask=mask, labels=ids)``);
the traced program takes a flat list of tensors. A :class:`CallSignature` is the bridge: it records the
structure of one example call (nested lists, tuples and dicts), which leaves are tensors (the program's
inputs, ``input[0]``, ``input[1]``, ... in flattening order) and the values of the other leaves (``None``,
flags, numbers), which are baked into the trace. A later call must have the same structure and the same
non-tensor values; otherwise it is refused with a message naming the argument.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoshard import _torch_compat as tc
from autoshard.errors import CallError, InputError

# A graph input's name in plans and errors is "input[i]"; this is its place in the user's call
_NO_VALUE = object()


@dataclass(frozen=True)
class Call:
    """Positional and keyword arguments together (``example_inputs=Call((x,), {"mask": m})``)."""

    args: tuple
    kwargs: Mapping[str, Any]

    def __str__(self) -> str:
        return describe(self.args, self.kwargs)


def as_call(example_inputs: Any) -> tuple[tuple, dict[str, Any]]:
    """``example_inputs`` as (args, kwargs): a tensor, a tuple/list of positional arguments, a mapping of
    keyword arguments (``dict(input_ids=ids, labels=ids)``, a tokenizer's ``BatchEncoding``) or a ``Call``."""
    if isinstance(example_inputs, Call):
        return tuple(example_inputs.args), dict(example_inputs.kwargs)
    if example_inputs is None:
        raise InputError(
            "example_inputs is required here: a tuple of positional arguments or a dict of keyword "
            "arguments (global-shaped tensors, real, fake or meta), as forward is called"
        )
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        bad = [k for k in example_inputs if not isinstance(k, str)]
        if bad:
            raise CallError(f"example_inputs as a mapping are keyword arguments; keys must be strings, got {bad!r}")
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise CallError(
        f"example_inputs must be a tensor, a tuple of positional arguments or a dict of keyword arguments; got "
        f"{type(example_inputs).__name__}"
    )


def example_call(example_inputs: Any) -> tuple | dict | Call:
    """The example call as given (positional tuple, dict of keyword arguments, or both as a Call), checked."""
    args, kwargs = as_call(example_inputs)
    if args and kwargs:
        return Call(args, kwargs)
    return dict(kwargs) if kwargs else args


def _path_name(path: Sequence[Any]) -> str:
    """``args[0]``, ``input_ids`` or ``batch["mask"]`` for a leaf's key path in ((args), {kwargs})."""
    if not path:
        return "?"
    head, rest = path[0], path[1:]
    idx = getattr(head, "idx", None)
    text = ""
    if idx == 0:  # positional
        first = rest[0] if rest else None
        text = f"args[{getattr(first, 'idx', '?')}]"
    else:
        first = rest[0] if rest else None
        text = str(getattr(first, "key", "?"))
    for k in rest[1:]:
        if hasattr(k, "idx"):
            text += f"[{k.idx}]"
        elif hasattr(k, "key"):
            text += f"[{k.key!r}]"
        else:
            text += f".{getattr(k, 'name', k)}"
    return text


@dataclass(frozen=True)
class CallSignature:
    """The structure of one call of the model (see the module docstring)."""

    spec: Any  # pytree spec of (args, kwargs)
    constants: tuple[Any, ...]  # per leaf: the baked-in value of a non-tensor leaf, _NO_VALUE for a tensor
    leaf_names: tuple[str, ...]  # per leaf: where it sits in the call ("input_ids", "args[1]", "batch['mask']")
    keywords: tuple[str, ...]  # the keyword arguments' names, in call order

    @property
    def names(self) -> tuple[str, ...]:
        """Per tensor input (graph input i), where it sits in the call."""
        return tuple(n for n, c in zip(self.leaf_names, self.constants) if c is _NO_VALUE)

    @property
    def num_tensors(self) -> int:
        return len(self.names)

    @property
    def positional(self) -> bool:
        """Called with positional tensors only (the program's inputs are the arguments, in order)."""
        return not self.keywords and all(c is _NO_VALUE for c in self.constants)

    def flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
        """The tensors of a call in graph-input order; refuses a call shaped unlike the traced one."""
        leaves, spec = tc.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.spec:
            raise CallError(
                f"this call's arguments {describe(args, kwargs)} are not shaped like the traced call's "
                f"({self.describe_traced()}); call it as it was traced, or compile again with the new call as "
                "example_inputs"
            )
        out = []
        for i, (leaf, const) in enumerate(zip(leaves, self.constants)):
            if const is _NO_VALUE:
                if not isinstance(leaf, torch.Tensor):
                    raise CallError(
                        f"argument {self._leaf_name(i)} must be a tensor, as traced; got {type(leaf).__name__}"
                    )
                out.append(leaf)
            elif isinstance(leaf, torch.Tensor) or leaf != const:
                raise InputError(
                    f"argument {self._leaf_name(i)}={leaf!r} differs from the traced value {const!r}; non-tensor "
                    "arguments are baked into the compiled program: pass the traced value, or compile again with "
                    "this one in example_inputs"
                )
        return out

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple, dict[str, Any]]:
        it = iter(tensors)
        leaves = [next(it) if c is _NO_VALUE else c for c in self.constants]
        args, kwargs = tc.tree_unflatten(leaves, self.spec)
        return tuple(args), dict(kwargs)

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple, dict[str, Any]] | tuple:
        """The call's own shape with other tensors: a tuple of the positional arguments when traced with
        positional tensors only, else (args, kwargs)."""
        args, kwargs = self.unflatten(tensors)
        return args if self.positional else (args, kwargs)

    def _leaf_name(self, leaf: int) -> str:
        return self.leaf_names[leaf] if leaf < len(self.leaf_names) else f"leaf {leaf}"

    def describe_traced(self) -> str:
        return describe(*self.unflatten([_Placeholder(n) for n in self.names]))  # type: ignore[list-item]


class _Placeholder:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return "tensor"


def describe(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
        if isinstance(v, (list, tuple)):
            return "(" + ", ".join(one(x) for x in v) + ")"
        if isinstance(v, Mapping):
            return "{" + ", ".join(f"{k}: {one(x)}" for k, x in v.items()) + "}"
        return "tensor" if isinstance(v, _Placeholder) else repr(v)

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def signature_of(example_inputs: Any) -> tuple[CallSignature, tuple[torch.Tensor, ...]]:
    """The signature of an example call and its tensors (the traced program's inputs, in order)."""
    args, kwargs = as_call(example_inputs)
    with_paths, spec = tc.tree_flatten_with_path((args, kwargs))
    tensors, constants = [], []
    for _, leaf in with_paths:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            constants.append(_NO_VALUE)
        else:
            constants.append(leaf)
    names = tuple(_path_name(path) for path, _ in with_paths)
    sig = CallSignature(spec, tuple(constants), names, tuple(kwargs))
    return sig, tuple(tensors)


def first_tensor(example_inputs: Any) -> torch.Tensor | None:
    """The first tensor of an example call (its batch size is the batch), or None."""
    _, tensors = signature_of(example_inputs)
    return tensors[0] if tensors else None


__all__ = ["Call", "CallSignature", "as_call", "describe", "first_tensor", "signature_of"]
