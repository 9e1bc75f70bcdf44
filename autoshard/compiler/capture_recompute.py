"""Activation recomputation (checkpointing) of chosen modules: which forward ops the backward runs again.

``PlanConfig.recompute`` names modules, each with a mode (``spec``: ``"layers.3"`` or ``"layers.3:full"``, the
whole forward replayed; ``"layers.3:selective"``, all but the matmuls replayed; a container such as
``"layers"`` stands for all of its layers). ``tag_recompute`` marks the forward ops that ran inside them, in
``meta["recompute"]``, with torch's ``CheckpointPolicy`` as ``torch.utils.checkpoint``'s selective policies do:

- ``PREFER_RECOMPUTE`` on the ops the backward runs again;
- ``MUST_SAVE`` on what stays: in selective mode the expensive ops (matmuls, convolutions, attention: ``EXPENSIVE``)
  and their items; in both modes a recomputed layer's outputs (the values another layer or module reads: the
  residual stream), so that a backward replays one layer from its saved input, not the whole stack from the
  embedding. Ops that draw random numbers (attention with dropout) are left untagged, i.e. saved.

Non-recomputed ops that a replay reads (a layer's saved input, a selective layer's matmul outputs read through a
recomputed view) get ``meta[KEPT]``: they are held for the backward although no backward op reads them.

The tags travel into the costs (``strategies``: a recomputed op is not saved and costs its forward twice;
``stored`` says what is saved), into ``share_layers`` (layers in different modes are not identical), into
``cost/memory.py`` (the replay's working set) and into this rank's program: ``lower`` traces each op with its
global node's metadata, so the lowered ops (collectives included) carry the tag and torch's partitioner saves and
replays what they say (``autoshard/compiler/partition.py``).

With sampled capture (``ctx.sampled_layers``: k of a container's L layers captured), ``sampled_specs`` gives the
captured layers modes such that every mode of the L layers is represented, and ``mode_counts`` how many real
layers each mode stands for (``share_layers`` weighs them).

Part of capture (not a pass of its own): it runs on the captured graph before ``coarsen``.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoshard import _torch_compat as tc
from autoshard.cost.compute import compute_time, op_flops
from autoshard.errors import InputError
from autoshard.ir import is_saved, is_view, layer_key, owns_storage, tensor_args
from autoshard.notation import FULL, SELECTIVE, parse_spec, spec

log = logging.getLogger(__name__)

KEPT = "autoshard_replay_input"  # meta key: a kept value a replay reads (see the module docstring)
MUST_SAVE = type(tc.PREFER_RECOMPUTE).MUST_SAVE  # the same enum (torch.utils.checkpoint.CheckpointPolicy)
# what selective recomputation keeps (torch's selective-checkpoint examples and torchtitan's op list save these)
EXPENSIVE = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_convolution",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    }
)


def _inside(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _mode_of(module: str, parsed: Sequence[tuple[str, str]]) -> tuple[str, str] | None:
    """The (path, mode) of the most specific spec whose path holds ``module``."""
    found = [p for p in parsed if _inside(module, p[0])]
    return max(found, key=lambda p: len(p[0])) if found else None


def layer_modes(specs: Sequence[str], container: str, total: int) -> list[str | None]:
    """The mode of each of ``container``'s ``total`` layers under ``specs`` (None: saved)."""
    parsed = [parse_spec(s) for s in specs]
    out: list[str | None] = []
    for i in range(total):
        hit = _mode_of(f"{container}.{i}", parsed)
        out.append(hit[1] if hit is not None else None)
    return out


def layer_specs(container: str, modes: Sequence[str | None]) -> tuple[str, ...]:
    """Specs for ``container``'s layers in ``modes`` (None: saved); the container itself when all share one."""
    if modes and all(m == modes[0] for m in modes) and modes[0] is not None:
        return (spec(container, modes[0]),)
    return tuple(spec(f"{container}.{i}", m) for i, m in enumerate(modes) if m is not None)


def sampled_specs(specs: Sequence[str], container: str, k: int, total: int) -> tuple[tuple[str, ...], Counter]:
    """Specs for the ``k`` captured layers of ``total`` (sampled capture) and the real layers per mode.

    Layer 0 keeps its own mode; the others take modes so that every mode of layers 1.. is represented (the one
    with more layers left first); specs naming modules outside ``container`` are kept as they are."""
    modes = layer_modes(specs, container, total)
    counts = Counter(modes)
    left = Counter(modes[1:])
    captured = [modes[0]]
    for _ in range(1, k):
        unseen = [m for m in left if left[m] > 0 and m not in captured[1:]]
        pool = unseen or [m for m in left if left[m] > 0]
        m = max(pool, key=lambda x: (left[x], str(x)))
        captured.append(m)
        left[m] -= 1
    others = tuple(
        s for s in specs if not _inside(container, parse_spec(s)[0]) and not _inside(parse_spec(s)[0], container)
    )
    return others + layer_specs(container, captured), counts


def tag_recompute(gm: fx.GraphModule, specs: Sequence[str], modules: Sequence[str]) -> int:
    """Tag the forward ops run inside ``specs`` (see the module docstring); ``modules`` are the model's module
    paths, to refuse a spec that names none. Returns how many ops the backward runs again."""
    if not specs:
        return 0
    parsed = [parse_spec(s) for s in specs]
    unknown = [p for p, _ in parsed if not any(_inside(m, p) for m in modules)]
    if unknown:
        raise InputError(
            f"recompute={list(specs)}: {unknown} name no module of the model; give module paths "
            f"such as {[m for m in modules if m.count('.') == 1][:3]} or a container of layers, "
            f"optionally with ':selective'"
        )
    region: dict[fx.Node, tuple] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.meta.get("autoshard_phase") != "forward":
            continue
        module = n.meta.get("autoshard_module", "")
        hit = _mode_of(module, parsed)
        if hit is None or _seeded(n):
            continue
        region[n] = (hit[0], layer_key(module))
        keep = hit[1] == SELECTIVE and _expensive(n)
        n.meta["recompute"] = MUST_SAVE if keep else tc.PREFER_RECOMPUTE
    for n in region:  # a region's outputs (read by another layer or module) are saved: replays start there
        if n.meta["recompute"] == tc.PREFER_RECOMPUTE and any(
            u.op == "output" or (u.meta.get("autoshard_phase") == "forward" and region.get(u) != region[n])
            for u in n.users
        ):
            n.meta["recompute"] = MUST_SAVE
    _mark_kept(gm)
    replayed = sum(is_recomputed(n) for n in region)
    log.info(
        "recompute: %d forward ops inside %s run again in the backward, %d saved",
        replayed,
        list(specs),
        len(region) - replayed,
    )
    return replayed


def _expensive(node: fx.Node) -> bool:
    if node.target is operator.getitem:
        return _expensive(node.args[0]) if isinstance(node.args[0], fx.Node) else False
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", "") in EXPENSIVE


def _mark_kept(gm: fx.GraphModule, reset: bool = False) -> None:
    """``meta[KEPT]`` on the non-recomputed forward values that the replays the backward needs read."""
    for n in gm.graph.nodes if reset else ():
        n.meta.pop(KEPT, None)
    todo = [n for n in gm.graph.nodes if is_recomputed(n) and is_saved(n)]
    needed: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        needed.add(n)
        for a in n.all_input_nodes:
            if is_recomputed(a):
                todo.append(a)
            elif a.op == "call_function":
                a.meta[KEPT] = True


def _seeded(node: fx.Node) -> bool:
    """An op that draws random numbers (dropout, CPU flash attention with its dropout) is saved, not replayed:
    a replay must draw the same numbers, which needs torch's RNG functionalization. An op tagged as seeded only
    because it can draw (the attention kernels' ``dropout_p``) draws nothing at ``dropout_p=0`` and is replayed
    like any other: saved, its inputs (a layer's queries, keys and values) would stay too."""
    return tc.draws_random(node)


def is_recomputed(node: fx.Node) -> bool:
    return node.meta.get("recompute") == tc.PREFER_RECOMPUTE


def stored(node: fx.Node) -> bool:
    """Whether a forward value is held for the backward in storage of its own (an activation the costs count):
    read by the backward or by a replay, not replayed itself, and not a view of what is counted elsewhere."""
    return (is_saved(node) or bool(node.meta.get(KEPT))) and owns_storage(node) and not is_recomputed(node)


@dataclass(frozen=True)
class LayerReplay:
    """One recomputed layer under a solved layout, per device: the saved bytes full / selective recomputation
    frees against saving it (as ``strategies`` counts them), the time each replay adds to the step, and the
    bytes each replay makes again in the backward (``cost/memory.py``'s replay line)."""

    full_bytes: float
    cheap_bytes: float
    full_s: float
    cheap_s: float
    full_again: float = 0.0
    cheap_again: float = 0.0


def _local_bytes(val: object, placements: Sequence | None, mesh_shape: Sequence[int]) -> int:
    if not isinstance(val, torch.Tensor):
        return 0
    split = 1
    for p, n in zip(placements or (), mesh_shape):
        split *= n if p is not None and p.is_shard() else 1
    return val.numel() * val.element_size() // split


def _once_s(n: fx.Node, mesh_shape: Sequence[int], device: object) -> float:
    """One run of ``n`` under its solved layout (``meta["autoshard"]``): the roofline ``strategies`` prices."""
    sh = n.meta.get("autoshard")
    val = n.meta.get("val")
    if sh is None or n.target is operator.getitem:
        return 0.0
    vals = val if isinstance(val, (tuple, list)) else (val,)
    nbytes = sum(_local_bytes(v, p, mesh_shape) for v, p in zip(vals, sh.outputs))
    nbytes += sum(_local_bytes(a.meta.get("val"), p, mesh_shape) for a, p in zip(tensor_args(n), sh.inputs))
    split = 1
    for axis, size in enumerate(mesh_shape):
        if any(ps is not None and ps[axis].is_shard() for ps in (*sh.inputs, *sh.outputs)):
            split *= size

    def conv(a: object) -> object:
        return (
            a.meta.get("val")
            if isinstance(a, fx.Node)
            else type(a)(conv(x) for x in a)
            if isinstance(a, (list, tuple))
            else a
        )

    flops = op_flops(n.target, conv(tuple(n.args)), {k: conv(v) for k, v in n.kwargs.items()}, val) / split
    dtype = next((str(v.dtype) for v in vals if isinstance(v, torch.Tensor)), "float32")
    return compute_time(flops, nbytes, device, dtype)


def _storage_root(n: fx.Node) -> fx.Node:
    while n.op == "call_function" and is_view(n.target) and tensor_args(n):
        n = tensor_args(n)[0]
    return n


def _key(n: fx.Node) -> tuple:
    return layer_key(n.meta.get("autoshard_module", "")) or (n.meta.get("autoshard_module", ""), -1)


def _out_bytes(n: fx.Node, mesh_shape: Sequence[int]) -> int:
    sh, val = n.meta.get("autoshard"), n.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return sum(_local_bytes(v, p, mesh_shape) for v, p in zip(vals, sh.outputs)) if sh is not None else 0


def _by_layer(gm: fx.GraphModule, mesh_shape: Sequence[int], keys: set) -> tuple[Counter, Counter]:
    """Per layer: bytes ``stored`` under the graph's present tags, and bytes its replay makes again."""
    kept, again = Counter(), Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.meta.get("autoshard_phase") == "forward" and (k := _key(n)) in keys:
            kept[k] += _out_bytes(n, mesh_shape) if stored(n) else 0
            again[k] += _out_bytes(n, mesh_shape) if is_recomputed(n) and is_saved(n) and _storage_root(n) is n else 0
    return kept, again


def layer_replays(
    gm: fx.GraphModule, mesh_shape: Sequence[int], device: object, mode: str = FULL
) -> dict[tuple, LayerReplay]:
    """Per recomputed layer (``ir.layer_key``) of a solved graph whose layers are tagged in ``mode``: what full
    and selective recomputation of it free and cost in its layout, each mode's tags put on the graph in turn
    (and its own put back) so that bytes are counted as ``strategies`` counts them. A selective graph cannot say
    what full recomputation would free: its full figures are the selective ones."""
    tagged = {n: n.meta["recompute"] for n in gm.graph.nodes if "recompute" in n.meta}
    keys = {_key(n) for n in tagged if is_recomputed(n)}
    times: dict[tuple, list[float]] = {k: [0.0, 0.0] for k in keys}
    for n in tagged:
        if is_recomputed(n):
            once = _once_s(n, mesh_shape, device)
            times[_key(n)][0] += once
            times[_key(n)][1] += 0.0 if _expensive(n) else once
    own, own_again = _by_layer(gm, mesh_shape, keys)
    sel, sel_again = own, own_again
    try:
        if mode == FULL:  # selective: the expensive ops saved
            for n in tagged:
                n.meta["recompute"] = MUST_SAVE if is_recomputed(n) and _expensive(n) else tagged[n]
            _mark_kept(gm, reset=True)
            sel, sel_again = _by_layer(gm, mesh_shape, keys)
        for n in tagged:  # nothing recomputed
            del n.meta["recompute"]
        _mark_kept(gm, reset=True)
        save, _ = _by_layer(gm, mesh_shape, keys)
    finally:
        for n, tag in tagged.items():
            n.meta["recompute"] = tag
        _mark_kept(gm, reset=True)
    return {
        k: LayerReplay(save[k] - own[k], save[k] - sel[k], times[k][0], times[k][1], own_again[k], sel_again[k])
        for k in keys
    }


def typical_replay(replays: Iterable[LayerReplay]) -> LayerReplay:
    """The mean layer (what a mix of many layers adds up to), with the largest layer's replay working set (only
    one layer replays at a time)."""
    rs = list(replays)
    mean = [sum(getattr(r, f) for r in rs) / len(rs) for f in ("full_bytes", "cheap_bytes", "full_s", "cheap_s")]
    return LayerReplay(*mean, max(r.full_again for r in rs), max(r.cheap_again for r in rs))


def replay_time(gm: fx.GraphModule, mesh_shape: Sequence[int], device: object, weight: Mapping[int, float]) -> float:
    """The time the replays of a solved graph add to its step (a captured layer counted as the layers it stands
    for: ``weight`` by group, ``ctx.group_weight``)."""
    return sum(
        _once_s(n, mesh_shape, device) * weight.get(n.meta["autoshard"].group, 1.0)
        for n in gm.graph.nodes
        if is_recomputed(n) and n.meta.get("autoshard") is not None
    )


def mix_specs(container: str, counts: tuple[int, int, int]) -> tuple[str, ...]:
    """Specs for (saved, selective, full) layer counts: full layers first, then selective, then saved."""
    saved, sel, full = counts
    return layer_specs(container, [FULL] * full + [SELECTIVE] * sel + [None] * saved)


__all__ = [
    "EXPENSIVE",
    "KEPT",
    "LayerReplay",
    "is_recomputed",
    "layer_modes",
    "layer_replays",
    "layer_specs",
    "mix_specs",
    "replay_time",
    "sampled_specs",
    "stored",
    "tag_recompute",
    "typical_replay",
]
