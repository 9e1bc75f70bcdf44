"""Where pipeline stages are cut: the model's main sequence of blocks.

Stages go between consecutive blocks of one ``nn.ModuleList`` or ``nn.Sequential`` (a *sequence*), whatever the
blocks' classes: Llama's identical decoder layers, T5's blocks of one class (the first also holds the relative
position table), Jamba's Mamba and attention layers alternating in one list, ConvNeXt's stages of different
widths. A sequence qualifies when it is not inside a block of another sequence (its path has no numbered part:
the layer of a module is its first numbered path component, ``ir.layer_parts``), is not the model itself (its
blocks need a path to be cut at), and holds two or more blocks: an ``nn.ModuleList`` of identical blocks (same
class, same parameter shapes), an ``nn.ModuleList`` of blocks of one class, or any list or ``nn.Sequential``
with parameters in two or more blocks. The main sequence is one holding at least half as many parameters as the
largest qualifying sequence (so a UNet is cut between its up-sampling blocks, not between the two identical
ResNet blocks of its middle); of those, identical blocks before blocks of one class before any blocks (as
before this module: T5 is cut in its encoder), then the longest, then the first in module order.

The split between its blocks is the stage search's (``pipeline/search.py``): each block is priced on its own
(``pipeline/costs.py``), so blocks of different classes weigh what they cost. A model without such a sequence
gets :func:`no_sequence_error`, which names the containers it has and the structure that would allow a cut.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from autoshard.errors import InputError
from autoshard.ir import layer_parts

_SEQUENCES = (nn.ModuleList, nn.Sequential)
_SHOWN = 8  # containers named in the error


def _signature(m: nn.Module) -> tuple:
    return (type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()))


def _size(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _outer_sequences(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every sequence of 2 or more blocks that is not inside a block of another sequence, in module order."""
    for name, mod in model.named_modules():
        if name and isinstance(mod, _SEQUENCES) and len(mod) > 1 and layer_parts(name) is None:
            yield name, mod


def main_sequence(model: nn.Module) -> tuple[str, int] | None:
    """The path and length of ``model``'s main sequence of blocks (see the module docstring), or None."""
    found: list[tuple[tuple, str, int]] = []
    for name, mod in _outer_sequences(model):
        blocks = list(mod)
        held = sum(_size(b) for b in blocks)
        if isinstance(mod, nn.ModuleList) and all(_signature(b) == _signature(blocks[0]) for b in blocks):
            kind = 2
        elif isinstance(mod, nn.ModuleList) and len({type(b) for b in blocks}) == 1:
            kind = 1
        elif sum(_size(b) > 0 for b in blocks) > 1:
            kind = 0
        else:
            continue
        found.append(((kind, len(blocks)), name, held))
    most = max((held for *_, held in found), default=0)
    best = None
    for rank, name, held in found:  # the first of equals, in module order
        if 2 * held >= most and (best is None or rank > best[0]):
            best = (rank, name)
    return None if best is None else (best[1], best[0][1])


def outside_part(module: str, container: str) -> str:
    """A module outside the main sequence ``container`` as a stage lists it: its path down to one part past
    what it shares with the sequence's path (``unet.down_blocks`` for every module of a UNet's down-sampling
    blocks cut between its up-sampling ones; ``model.embed_tokens`` beside ``model.layers``)."""
    parts, theirs = module.split("."), container.split(".")
    same = next((i for i, (a, b) in enumerate(zip(parts, theirs)) if a != b), min(len(parts), len(theirs)))
    return ".".join(parts[: same + 1])


def _describe(model: nn.Module) -> list[str]:
    """The model's containers as the error names them: its sequences (and why none qualifies), then its
    top-level modules."""
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, _SEQUENCES):
            continue
        kind = f"nn.{type(mod).__name__} of {len(mod)}"
        if not name:
            out.append(f"the model itself ({kind}: its blocks need a parent module)")
        elif layer_parts(name) is not None:
            parts = layer_parts(name)
            assert parts is not None
            out.append(f"{name} ({kind}, inside block {parts[0]}.{parts[1]})")
        elif len(mod) < 2:
            out.append(f"{name} ({kind}: nothing to cut between)")
        else:
            out.append(f"{name} ({kind}: fewer than 2 blocks with parameters)")
    more = [f"and {len(out) - _SHOWN} more"] if len(out) > _SHOWN else []
    top = [f"{n} ({type(m).__name__})" for n, m in model.named_children()]
    tail = [
        f"top-level modules {', '.join(top[:_SHOWN])}{', ...' if len(top) > _SHOWN else ''}" if top else "no submodules"
    ]
    return out[:_SHOWN] + more + tail


def no_sequence_error(model: nn.Module, fix: str) -> InputError:
    """The error for a model with no main sequence: what stages need, the containers ``model`` has, and the fix
    (``fix``: how to go on without stages, as the caller's entry point takes it)."""
    cls = type(model).__name__
    return InputError(
        f"pipeline stages go between consecutive blocks of the model's main sequence (an nn.ModuleList or "
        f"nn.Sequential attribute of 2 or more blocks with parameters, of any classes, not inside another such "
        f"sequence's block), and {cls} has none; its containers: {'; '.join(_describe(model))}. To cut it into "
        f"stages, hold the blocks its forward runs one after another in one such attribute (e.g. "
        f"self.blocks = nn.ModuleList([...]) called in a loop, or nn.Sequential); otherwise {fix}"
    )


__all__ = ["main_sequence", "no_sequence_error", "outside_part"]
