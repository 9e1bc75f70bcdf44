"""Hugging Face checkpoints in and out of the shards, through ``torch.distributed.checkpoint``.

In: ``load_pretrained(sharded, path)`` reads a ``save_pretrained`` directory (one safetensors file or several with
an index) with DCP's ``HuggingFaceStorageReader``: each rank reads only the slices of each tensor that its shards
hold, cast to the parameter's dtype (a bf16 checkpoint into fp32 masters, or the reverse). Before anything is read,
the files are checked from their headers (``check_files``: cut short, missing from the index, not safetensors), then
the checkpoint's keys and shapes against the model's: a missing, unexpected or wrong-shaped key is an error naming it
(and both shapes). A tied parameter (an LM head sharing the embedding) is read once, under the name
the checkpoint holds.

Out: ``save_pretrained(sharded, model, path)`` writes each rank's shards with ``HuggingFaceStorageWriter``
(``save_distributed``), then consolidates them into whole-tensor safetensors files and their index, one output
file per rank where torch can spread the work, so no rank gathers the model; rank 0 adds the model's config.
``from_pretrained(path)`` reads the result on one process.

The same state dict names serve ``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` /
``set_state_dict``): ``fqn_modifiers`` tells it that autoshard's wrappers add no name to the model's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Collection, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from autoshard import _torch_compat as tc
from autoshard.errors import InputError
from autoshard.weights.shards import global_shape, local_of

log = logging.getLogger(__name__)


def fqn_modifiers(inner: nn.Module, attribute: str) -> dict[str, str]:
    """``_fqn_modifiers`` of a wrapper holding the model as ``attribute``: every first name of the model's keys
    maps to it, so torch's state-dict API walks through the wrapper without adding ``attribute.`` to names."""
    heads = {n for n, _ in inner.named_children()}
    heads |= {n for n, _ in inner.named_parameters(recurse=False)} | {n for n, _ in inner.named_buffers(recurse=False)}
    return {h: attribute for h in heads}


def _unique_state(sharded: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict with each tensor once (the first of tied names), and each dropped alias -> its kept name."""
    state: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[Any, str] = {}
    for k, v in sharded.state_dict().items():
        if not isinstance(v, torch.Tensor):
            continue
        local = local_of(v)  # state_dict() detaches: tied names share the storage, not the object
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape)) if local.numel() else k
        if key in first:
            aliases[k] = first[key]
            continue
        first[key] = k
        state[k] = v
    return state, aliases


def _ignored(model: nn.Module, attr: str) -> list[re.Pattern[str]]:
    pats = getattr(model, attr, None) or ()
    return [re.compile(p) for p in pats]


def check_checkpoint(
    state: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    saved: Mapping[str, Any],
    path: str,
    model: nn.Module,
    strict: bool = True,
    expected: Collection[str] | None = None,
    tied: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Compare the model's keys and shapes with the checkpoint's (``saved``: key -> DCP storage metadata).
    Returns the model keys to read, each -> the checkpoint key it reads (a tied parameter may be stored under its
    other name). Raises naming the first difference. ``expected``: every key of the whole model, where ``state``
    is this rank's part (pipeline stages); ``tied``: each name of a tied parameter -> its first name (a stage's
    copy of a tied parameter reads whichever of its names the checkpoint holds)."""
    tied = dict(tied or {})
    plan: dict[str, str] = {}
    missing = []
    for key in state:
        first = tied.get(key, key)
        names = [key] + [a for a, k in aliases.items() if k == key] + [first]
        names += [a for a, c in tied.items() if c == first]
        found = next((n for n in names if n in saved), None)
        if found is None:
            missing.append(key)
        else:
            plan[key] = found
    for key, stored in plan.items():
        want, have = tuple(global_shape(state[key])), tuple(saved[stored].size)
        if want != have:
            raise InputError(
                f"{path}: {stored} has shape {have} in the checkpoint but {want} in the model "
                f"({type(model).__name__}); is the checkpoint from another model or config?"
            )
    expected = set(state) | set(aliases) | set(expected or ())
    skip = _ignored(model, "_keys_to_ignore_on_load_unexpected")
    unexpected = sorted(k for k in saved if k not in expected and not any(p.search(k) for p in skip))
    skip_missing = _ignored(model, "_keys_to_ignore_on_load_missing")
    missing = [k for k in missing if not any(p.search(k) for p in skip_missing)]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(
                f"missing from the checkpoint: {missing[0]} {tuple(global_shape(state[missing[0]]))}"
                + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            )
        if unexpected:
            parts.append(
                f"not in the model: {unexpected[0]} {tuple(saved[unexpected[0]].size)}"
                + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else "")
            )
        raise InputError(
            f"{path} does not match {type(model).__name__}: {'; '.join(parts)}. Is it a checkpoint of "
            "another model? (strict=False loads the keys both have.)"
        )
    return plan


def check_files(path: str) -> None:
    """Refuse a checkpoint directory whose files cannot all be read, naming the file and what is missing: a file its
    index names that is not there, a safetensors file cut short (a save that did not finish) or not one at all.
    Reads the headers only (a safetensors file is an 8-byte header length, a JSON header giving each tensor's byte
    range, then the data)."""
    names = set(os.listdir(path))
    for idx in sorted(f for f in names if f.endswith(".safetensors.index.json")):
        try:
            with open(os.path.join(path, idx)) as fh:
                weight_map = dict(json.load(fh)["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{os.path.join(path, idx)}: not a safetensors index (no readable weight_map: {e})") from e
        absent = sorted(set(weight_map.values()) - names)
        if absent:
            keys = [k for k, f in weight_map.items() if f == absent[0]]
            raise InputError(
                f"{path}: its index {idx} puts {len(keys)} tensors ({keys[0]}, ...) in {absent[0]}, which "
                f"is not there"
                + (f" (nor {len(absent) - 1} more of its files)" if len(absent) > 1 else "")
                + "; copy the whole checkpoint directory, or save it again"
            )
    for name in sorted(f for f in names if f.endswith(".safetensors")):
        file = os.path.join(path, name)
        size = os.path.getsize(file)
        with open(file, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or 8 + n > size:
                raise InputError(
                    f"{file} is not a complete safetensors file: {size} bytes, "
                    + ("shorter than its header's length field" if n < 0 else f"its header alone {8 + n}")
                    + "; was its save interrupted? Save it again"
                )
            try:
                header = json.loads(fh.read(n))
                ends = {k: int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"}
            except (ValueError, KeyError, TypeError, IndexError) as e:
                raise InputError(f"{file} is not a safetensors file (its header does not parse: {e})") from e
        need = 8 + n + max(ends.values(), default=0)
        if need > size:
            cut = sorted((k for k, end in ends.items() if 8 + n + end > size), key=ends.get)
            raise InputError(
                f"{file} is truncated: {size} bytes where its header describes {need}; {cut[0]}"
                + (f" and {len(cut) - 1} more tensors" if len(cut) > 1 else "")
                + " end past its end. Was "
                "its save interrupted? Save it again"
            )


def load_pretrained(
    sharded: nn.Module,
    path: str | os.PathLike,
    *,
    strict: bool = True,
    model: nn.Module | None = None,
    expected: Collection[str] | None = None,
    tied: Mapping[str, str] | None = None,
) -> None:
    """Read a ``save_pretrained`` directory into ``sharded``'s shards (see the module docstring); ``model``: the
    model as built (its ignore lists), ``expected``: the whole model's keys where ``sharded`` holds a part."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    path = os.fspath(path)
    if not os.path.isdir(path) or not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise FileNotFoundError(
            f"{path}: no safetensors files; load_pretrained reads a directory written by "
            "save_pretrained (model.safetensors, or model-0000k-of-0000n.safetensors and its index)"
        )
    check_files(path)
    reader = HuggingFaceStorageReader(path)
    saved = reader.read_metadata().state_dict_metadata
    state, aliases = _unique_state(sharded)
    model = model if model is not None else getattr(sharded, "module", sharded)
    plan = check_checkpoint(state, aliases, saved, path, model, strict, expected, tied)
    to_read = {stored: state[key] for key, stored in plan.items()}
    log.info("load_pretrained: %d tensors from %s into this rank's shards", len(to_read), path)
    dcp.load(to_read, storage_reader=HuggingFaceStorageReader(path))


def save_pretrained(
    sharded: nn.Module, model: nn.Module, path: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> None:
    """Write ``sharded``'s model as a ``from_pretrained`` directory (see the module docstring); ``dtype`` casts
    floating-point tensors on the way out (e.g. ``torch.bfloat16``)."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        _save_adapters(model, path, dtype)
        return
    state, _ = _unique_state(sharded)
    skip = _ignored(model, "_keys_to_ignore_on_save")
    state = {k: v for k, v in state.items() if not any(p.search(k) for p in skip)}
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    sharded_dir = os.path.join(path, "sharded")
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(sharded_dir, save_distributed=True))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    # one output file per rank (by bytes), so that each rank consolidates its own file
    files = max(1, min(world, len(state)))
    total = sum(_numel(v) * v.element_size() for v in state.values())
    mapping, acc = {}, 0
    for k, v in state.items():
        mapping[k] = min(files, 1 + acc * files // max(total, 1))
        acc += _numel(v) * v.element_size()
    tc.consolidate_safetensors(sharded_dir, path, mapping)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        shutil.rmtree(sharded_dir, ignore_errors=True)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(path)
        gen = getattr(model, "generation_config", None)
        if gen is not None and hasattr(gen, "save_pretrained"):
            gen.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()


def _save_adapters(model: nn.Module, path: str, dtype: torch.dtype | None) -> None:
    """A PEFT model: its adapters as PEFT writes and loads them (``adapter_config.json``,
    ``adapter_model.safetensors``), not the frozen base. Each trained tensor is gathered whole on every rank (they
    are small), and rank 0 writes them through PEFT's own ``save_pretrained``."""
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    state = {}
    for key, value in model.state_dict().items():
        if key in trained:
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            state[key] = whole.to(dtype) if dtype is not None and whole.is_floating_point() else whole
    if not dist.is_initialized() or dist.get_rank() == 0:
        model.save_pretrained(path, state_dict=state)
    log.info("save_pretrained: %d adapter tensors of %s written to %s", len(state), type(model).__name__, path)
    if dist.is_initialized():
        dist.barrier()


def _numel(t: torch.Tensor) -> int:
    n = 1
    for s in global_shape(t):
        n *= int(s)
    return n


__all__ = ["check_checkpoint", "check_files", "fqn_modifiers", "load_pretrained", "save_pretrained"]
