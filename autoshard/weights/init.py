"""The model's own initialization, run on shards, one whole tensor at a time, the same on every mesh.

``init_weights(tree, seed, targets)`` runs, as a single device would after building the model:

1. every module's construction-time initialization, ``reset_parameters()`` (torch's modules) and, for a
   Hugging Face model, its ``_init_weights(module)`` (what ``post_init`` runs; the nearest ``PreTrainedModel``
   above a module supplies it). Each module runs with its own parameters and buffers swapped for whole temporary
   tensors on the compute device, which are then cut to this rank's shards (``shards.write_full``): a rank holds
   its shards plus one module's whole tensors at a time;
2. then a model's own ``init_weights()`` that is not Hugging Face's (torchtitan's convention), on the sharded
   tensors themselves.

Both run under ``_WholeInit``, a ``TorchFunctionMode`` that catches what init code does to a sharded tensor
directly (a ``torch.nn.init`` function, or a random in-place fill such as ``normal_``): the whole tensor is drawn
on the compute device and cut to the shards. Elementwise in-place ops (``mul_``, ``clamp_``, ``fill_``) act on
DTensors as they are.

Random numbers are drawn from generators seeded by ``(seed, module or tensor name)``, never from a stream shared
across tensors, so a tensor's whole value depends only on the seed, its name and the init code: the same seed
gives the same model on any mesh, under any plan, and on one device (``autoshard.init_weights(model, seed)`` on an
unsharded model). DTensor's own random ops do not promise that: they draw each shard from an offset of one
stream, which depends on the placements. The caller's RNG state is left as it was.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autoshard.errors import UsageError
from autoshard.weights.shards import global_shape, layout_of, write_full

log = logging.getLogger(__name__)

# in-place methods that overwrite a tensor with random draws: drawn whole, then cut
_RANDOM_FILLS = frozenset(
    ("normal_", "uniform_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_")
)


def derived_seed(seed: int, name: str, count: int = 0) -> int:
    """A 63-bit seed for one tensor or module: a function of the user's seed, the name and the call's count only."""
    return (int(seed) * 1_000_003 + zlib.crc32(f"{name}#{count}".encode())) % (2**63 - 1)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    with torch.random.fork_rng(devices=devices, device_type=device.type if device.type != "cpu" else "cuda"):
        torch.manual_seed(seed)
        yield


def _hf_owners(tree: nn.Module) -> dict[str, Any]:
    """Module name -> the Hugging Face ``PreTrainedModel`` whose ``_init_weights`` initializes it (the nearest one
    above it, as transformers' ``initialize_weights`` dispatches); empty for a model that is not one."""
    if "transformers" not in sys.modules:
        return {}
    from transformers import PreTrainedModel

    owners: dict[str, Any] = {}
    for name, m in tree.named_modules():
        parent = owners.get(name.rpartition(".")[0]) if name else None
        owners[name] = m if isinstance(m, PreTrainedModel) else parent
    return owners if owners.get("") is not None else {}


class _WholeInit(TorchFunctionMode):
    """Catches init code acting on a sharded tensor of the model (see the module docstring)."""

    def __init__(
        self, seed: int, names: Mapping[int, str], write: Callable[[str, torch.Tensor], None], device: torch.device
    ) -> None:
        super().__init__()
        self.seed, self.names, self.write, self.device = seed, dict(names), write, device
        self.calls: dict[str, int] = {}
        self.written: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        name = self.names.get(id(target)) if isinstance(target, torch.Tensor) else None
        if name is None:
            return func(*args, **kwargs)
        fname = getattr(func, "__name__", "")
        if getattr(func, "__module__", "") == "torch.nn.init" or fname in _RANDOM_FILLS:
            whole = torch.empty(global_shape(target), dtype=target.dtype, device=self.device)
            k = self.calls[name] = self.calls.get(name, -1) + 1
            rest = args[1:] if args else ()
            kw = {k2: v for k2, v in kwargs.items() if k2 != "tensor"}
            with _seeded(derived_seed(self.seed, name, k), self.device):
                func(whole, *rest, **kw)
            self.write(name, whole)
            self.written.add(name)
            return target
        if fname == "__get__" and getattr(func, "__self__", None) is torch.Tensor.data:
            return target  # ``p.data``: the parameter itself (init runs under no_grad), so later calls are caught
        if fname == "detach":
            return target
        if fname == "copy_" and layout_of(target) is not None and len(args) > 1 and layout_of(args[1]) is None:
            self.write(name, args[1].to(self.device))  # a whole value copied into a sharded tensor: its piece
            self.written.add(name)
            return target
        if fname.endswith("_") and not fname.startswith("__"):
            if target.device.type == "meta":
                raise UsageError(
                    f"init code calls {fname} on {name}, which has no values here (the model as built, whose "
                    "pipeline stages hold the values); initialize it with torch.nn.init functions or reset_parameters()"
                )
            self.written.add(name)
        return func(*args, **kwargs)


def _direct(m: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    out = [(k, p, True) for k, p in m._parameters.items() if p is not None]
    return out + [(k, b, False) for k, b in m._buffers.items() if b is not None]


@contextlib.contextmanager
def _swapped(m: nn.Module, device: torch.device) -> Iterator[list[tuple[str, torch.Tensor, torch.Tensor, int]]]:
    """``m``'s own parameters and buffers replaced by whole tensors on ``device`` (a real buffer keeps its value);
    yields (attribute, original, temporary, version before init), restores the originals after."""
    swaps = []
    for leaf, t, is_param in _direct(m):
        real = t.device.type != "meta" and layout_of(t) is None
        tmp = t.detach().to(device).clone() if real else torch.empty(global_shape(t), dtype=t.dtype, device=device)
        if is_param:
            m._parameters[leaf] = nn.Parameter(tmp, requires_grad=t.requires_grad)
            tmp = m._parameters[leaf]
        else:
            m._buffers[leaf] = tmp
        swaps.append((leaf, t, tmp, tmp._version))
    try:
        yield swaps
    finally:
        for leaf, t, _, _ in swaps:
            (m._parameters if leaf in m._parameters else m._buffers)[leaf] = t


@torch.no_grad()
def init_weights(
    tree: nn.Module,
    seed: int = 0,
    targets: Mapping[str, Sequence[torch.Tensor]] | None = None,
    device: torch.device | str | None = None,
    only: Collection[str] | None = None,
) -> set[str]:
    """Initialize the tensors of ``tree`` (the model as built: meta, sharded or whole) as its own code does, and
    write each whole result into the tensors ``targets`` names (default: ``tree``'s own parameters and buffers,
    under every alias). ``only``: run just the modules that own these names, write just them (the buffers a
    checkpoint does not hold, recomputed after a load). Returns the names written."""
    if only is not None:
        keep = set(only)
        full = targets if targets is not None else {n: [t] for n, t in tree.named_buffers(remove_duplicate=False)}
        targets = {
            n: ts
            for n, ts in {**{n: [t] for n, t in tree.named_parameters(remove_duplicate=False)}, **full}.items()
            if n in keep
        }
    if targets is None:
        targets = {}
        for n, t in [*tree.named_parameters(remove_duplicate=False), *tree.named_buffers(remove_duplicate=False)]:
            targets.setdefault(n, []).append(t)  # type: ignore[attr-defined]
    dev = torch.device(device) if device is not None else _device_of(targets)
    names_of = {}  # id(tensor in the tree) -> its name
    for n, t in [*tree.named_parameters(remove_duplicate=False), *tree.named_buffers(remove_duplicate=False)]:
        names_of.setdefault(id(t), n)

    def write(name: str, whole: torch.Tensor) -> None:
        for t in targets.get(name, ()):
            write_full(t, whole)

    owners = _hf_owners(tree)
    written: set[str] = set()
    mode = _WholeInit(seed, names_of, write, dev)
    with mode:
        for mname, m in tree.named_modules():
            if not _direct(m) and not hasattr(m, "reset_parameters") and owners.get(mname) is None:
                continue
            if only is not None and not any(
                (f"{mname}.{leaf}" if mname else leaf) in keep for leaf, _, _ in _direct(m)
            ):
                continue
            with _swapped(m, dev) as swaps, _seeded(derived_seed(seed, mname or "<root>"), dev):
                _module_init(m, owners.get(mname))
                for leaf, _, tmp, before in swaps:
                    name = f"{mname}.{leaf}" if mname else leaf
                    if tmp._version != before and name in targets:
                        write(name, tmp.detach())
                        written.add(name)
        user = getattr(tree, "init_weights", None)
        if callable(user) and not owners and only is None:
            log.info("init_weights: running %s.init_weights() on the shards", type(tree).__name__)
            user()
    return written | mode.written


def _module_init(m: nn.Module, hf_owner: Any) -> None:
    """What building ``m`` on a device would have run: torch's ``reset_parameters`` (``_reset_parameters`` for
    ``nn.MultiheadAttention``), then Hugging Face's ``_init_weights`` for it."""
    reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
    if callable(reset):
        reset()
    if hf_owner is not None:
        hf_owner._init_weights(m)


def _device_of(targets: Mapping[str, Sequence[torch.Tensor]]) -> torch.device:
    for ts in targets.values():
        for t in ts:
            layout = layout_of(t)
            if layout is not None:
                return torch.device(layout[0].device_type)
            if t.device.type != "meta":
                return t.device
    return torch.device("cpu")


__all__ = ["derived_seed", "init_weights"]
