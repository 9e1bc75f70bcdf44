"""The one stage search: pipeline stages chosen jointly with the intra-op plan, for ``plan`` and for ``compile``.

Configurations. Each rung of the stage ladder (S stages of a sub-mesh: whole nodes per stage, or one node split
evenly, for offline plans; the ``pp`` axis's split of the mesh in ``compile``) with each micro-batch count B
(:func:`microbatch_counts`, or the fixed count). A configuration is priced from the intra-op plan of the whole
model on one stage's sub-mesh at the micro-batch size (``pipeline.solves``), cut into head / layer / tail pieces
(``pipeline.costs``) and split into S stages by the inter-op DP (``solver.inter_op``) under the memory budget, with
the schedule that fits best, with or without activation recomputation. S = 1 is the intra-op plan of the whole
cluster, over the whole batch at once or accumulating gradients over B micro-batches. Where the stage memory budget
binds, the leaner manual recipes (fsdp+tp, fsdp, tp, ddp) are solved on the same program and split too, and the
fastest split wins (``PipelineOption.recipe`` names the recipe then).

What differs between ``compile`` and offline plans (:class:`SearchSpace`), for reasons of their own:

- boundary layout: ``compile``'s stages exchange whole (Replicate) activations, so every device sends the whole
  boundary activation (``boundary="whole"``); offline plans price Megatron's scatter/gather, each device sending
  its share of it (``"share"``). Sends go over the inter-node network when stages span nodes, else the intra-node
  link (:func:`p2p_seconds`);
- schedules: ``compile`` picks only what it runs (``runtime.pipelined.EXECUTABLE_SCHEDULES``: all of them, the
  zero-bubble one with its stages' backward split);
- recomputation and the recipes: ``compile`` plans every stage freely and does not recompute;
- the stage counts, and a micro-batch count the user fixed.

How much is solved. Configurations fall into classes: a kind of sub-mesh (its axes but the outermost's size) at
one micro-batch per device. Inside a class a device's own work is the same, so one solved configuration prices
the others closely (``pipeline.pricing``: estimates within 0.3% on Llama-3-70B); across classes only roughly. The
search starts at the seed (the middle rung, or ``start``; its middle micro-batch count), solves it, and walks each
kind's micro-batch sizes from there towards the faster neighbour while it gets faster (first the way the
estimates point; at most ``sizes`` sizes). In each class it visits it solves the configuration estimated
fastest, then every other one estimated faster than the best solved (within ``margin``, widened to how far the
estimates were off so far: small, latency-bound models change their layouts with the sub-mesh). What it leaves
is listed with its estimate, marked ``estimated`` (``exhaustive``: solve every configuration). The solves share
work (``pipeline.solves``): one capture per micro-batch count, and a configuration of a solved class takes its
layouts instead of a solve of its own; the chosen one gets its own solve (``polish``), kept when faster.

The optimizer step runs once per step on every device over its own training state; it is memory-bound
(:func:`optimizer_step_s`) and is added to each piece's once-per-step work. Megatron-LM's fixed configurations are
priced in ``pipeline.megatron``; their rows have ``recipe == "pp+tp+dp"``, free options ``recipe == ""``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from torch import nn

from autoshard.cluster.profile import ClusterProfile
from autoshard.config import PlanConfig
from autoshard.errors import InputError
from autoshard.pipeline.pricing import Config, PipelineOption, Pricer, SearchSpace, kind
from autoshard.pipeline.solves import FakeStageMeshes, Key, StageSolves
from autoshard.solver.inter_op import SCHEDULES

log = logging.getLogger(__name__)

MEGATRON = "pp+tp+dp"
Rung = tuple[int, tuple[int, ...], tuple[str, ...]]  # (stages, stage sub-mesh shape, its axis names)


def stage_meshes(cluster: ClusterProfile) -> list[tuple[int, tuple[int, ...]]]:
    """(stages, stage sub-mesh shape) options: whole nodes per stage (S | nodes), or one node split evenly."""
    per, nodes = cluster.devices_per_node, cluster.nodes
    out = []
    for s in range(1, nodes + 1):
        if nodes % s == 0:
            k = nodes // s
            out.append((s, (k, per) if k > 1 else (per,)))
    if nodes == 1:
        for s in range(2, per + 1):
            if per % s == 0:
                out.append((s, (per // s,)))
    return out


def microbatch_counts(batch: int, stages: int, world: int, per_node: int) -> list[int]:
    """Micro-batch counts B worth planning for S stages of ``world`` devices, fewest first: micro-batches of m
    sequences, m from one per node of the stage (a node-wide TP group's micro-batch size 1) doubling up to
    ``batch / S``, where B = batch / m is whole and >= S; one stage also takes the whole batch (B = 1)."""
    counts, m = [], max(1, world // per_node)
    while m <= batch // stages:
        if batch % m == 0:
            counts.append(batch // m)
        m *= 2
    if stages == 1 and 1 not in counts:
        counts.append(1)
    return sorted(counts)


def stage_start(model: nn.Module, cluster: ClusterProfile, config: PlanConfig, counts: Sequence[int]) -> int:
    """The fewest stages (of ``counts``) whose share of the training state (parameters, gradients, optimizer
    state) fits a node's devices within the memory budget, as with TP over the node and the state replicated
    over DP (Megatron users' rule for the pipeline depth; a search can start there, ``SearchSpace.start``)."""
    budget = config.memory_budget or cluster.device.memory_bytes
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * (2 + config.optimizer_factor)
    per_node = cluster.devices_per_node * budget
    return next((s for s in sorted(counts) if state / s <= per_node), max(counts))


def search_stages(
    model: nn.Module,
    inputs: Any,
    cluster: ClusterProfile,
    config: PlanConfig,
    rungs: Sequence[Rung],
    space: SearchSpace,
    solves: StageSolves,
) -> list[PipelineOption]:
    """Every configuration of ``rungs`` (stage counts that need more stages than the model has layers are left
    out) with its best split: the solved ones fastest first, then the estimated ones (see the module docstring).
    ``config.memory_budget`` is the per-device budget every stage must fit. Both ``autoshard.plan(pipeline="auto")``
    and ``compile`` with stages search here; ``solves`` holds their intra-op solves (``pipeline.solves``)."""
    from autoshard.pipeline.blocks import main_sequence

    depth = (main_sequence(model) or ("", 1))[1]
    batch = solves.batch
    configs: list[Config] = []
    options: list[PipelineOption] = []
    for stages, sub, names in rungs:
        if stages > depth:
            continue
        if space.microbatches is not None and batch % space.microbatches:
            raise InputError(f"microbatches={space.microbatches} does not divide the global batch {batch}")
        counts = (
            [space.microbatches]
            if space.microbatches
            else microbatch_counts(batch, stages, math.prod(sub), cluster.devices_per_node)
        )
        if not counts:
            options.append(PipelineOption(stages, sub, 0, None, f"global batch {batch} has no multiple of {stages}"))
        configs += [(stages, sub, names, b) for b in counts]
    if not configs:
        return options
    run = Pricer(cluster, config, space, solves)
    start = space.start if any(c[0] == space.start for c in configs) else configs[len(configs) // 2][0]
    first = [c for c in configs if c[0] == start]
    seed = first[len(first) // 2]
    done: dict[Config, PipelineOption] = {}

    errors: list[float] = []  # how far estimates made before solves were from them

    def solve(c: Config) -> PipelineOption:
        if c not in done:
            guess = run.estimate(c, list(done.values())).step_time_s if done else math.inf
            done[c] = run.exact(c, list(done.values()))
            if math.isfinite(guess) and math.isfinite(done[c].step_time_s):
                errors.append(abs(guess / done[c].step_time_s - 1))
                log.debug("pipeline: %s estimated %.6f s, solved %.6f s", c, guess, done[c].step_time_s)
        return done[c]

    def per(c: Config) -> Fraction:  # the micro-batch per device
        return Fraction(batch, c[3] * math.prod(c[1]))

    def refine(sort: tuple, b: Fraction) -> float:
        """The class of ``kind`` sub-meshes at micro-batch ``b`` per device: its most promising configuration
        solved (by the estimate across classes), then the others its solves estimate within the margin."""
        members = [c for c in configs if (kind(c[1], c[2]), per(c)) == (sort, b)]
        if not any(c in done for c in members):
            solve(
                seed
                if seed in members
                else min(members, key=lambda c: (run.estimate(c, list(done.values())).step_time_s, c[0]))
            )
        while True:
            inside = [done[c] for c in members if c in done]
            rest = [c for c in members if c not in done]
            if not rest:
                break
            guess = {c: run.estimate(c, inside).step_time_s for c in rest}
            c = min(rest, key=lambda c: (guess[c], c[0]))
            # the margin widens to how far the estimates so far were off (latency-bound models' layouts change with
            # the sub-mesh, and their estimates are rough)
            margin = min(0.1, max([space.margin, *errors]))
            if math.isinf(guess[c]) or guess[c] > min(o.step_time_s for o in done.values()) * (1 + margin):
                break
            solve(c)
        return min(done[c].step_time_s for c in members if c in done)

    if space.exhaustive:
        for c in configs:
            solve(c)
    kinds: dict[tuple, list[Fraction]] = {}
    for c in sorted(configs, key=lambda c: (c != seed, per(c))):
        kinds.setdefault(kind(c[1], c[2]), [])
        if per(c) not in kinds[kind(c[1], c[2])]:
            kinds[kind(c[1], c[2])].append(per(c))
    for sort, sizes in kinds.items():
        sizes.sort()
        at = min(range(len(sizes)), key=lambda i: abs(math.log2(sizes[i] / per(seed))))
        _walk(
            len(sizes),
            lambda i, sort=sort, sizes=sizes: refine(sort, sizes[i]),
            max(1, space.sizes),
            at,
            lambda i, sort=sort, sizes=sizes: min(
                run.estimate(c, list(done.values())).step_time_s
                for c in configs
                if (kind(c[1], c[2]), per(c)) == (sort, sizes[i])
            ),
        )
    solved = list(done.values())
    pending = [c for c in configs if c not in done]
    winner = min(solved, key=lambda o: o.step_time_s)
    if space.polish and winner.split is not None and winner.recipe == (config.recipe or "") and not space.exhaustive:
        solved = [_polish(run, winner, o) if o is winner else o for o in solved]
    options += solved + [run.estimate(c, solved) for c in pending]
    options.sort(key=lambda o: (o.estimated, o.step_time_s, o.stages, o.recipe))
    log.info(
        "pipeline: %d configurations, %d solved exactly (%d intra-op solves, %d carried over), %d estimated",
        len(configs),
        len(solved),
        solves.solved,
        solves.carried,
        len(pending),
    )
    return options


def _walk(n: int, value: Callable[[int], float], budget: int, first: int, guess: Callable[[int], float]) -> None:
    """Evaluate ``value`` at most ``budget`` times over indices 0..n-1 (micro-batch sizes, smallest first): at
    ``first``, then towards the neighbour that is smaller while it keeps getting smaller (``value`` taken to be
    unimodal: the bubble shrinks with smaller micro-batches, the per-micro-batch efficiency and the memory headroom
    with larger ones), first the way ``guess`` (an estimate) says is better, larger ones on a tie. From an infinite
    start (nothing fits) it goes to smaller ones first."""
    seen: dict[int, float] = {}

    def at(i: int) -> float:
        if i not in seen:
            seen[i] = value(i)
        return seen[i]

    def hint(i: int) -> float:
        return guess(i) if 0 <= i < n else math.inf

    i = first
    ways = (-1, 1) if math.isinf(at(first)) or hint(first - 1) < hint(first + 1) else (1, -1)
    for step in ways:
        while len(seen) < budget and 0 <= i + step < n and (i + step) not in seen:
            if at(i + step) < at(i) or math.isinf(at(i)):
                i += step
            else:
                break
        if i != first:
            break  # it moved one way: the other way was not better from the start


def _polish(run: Pricer, winner: PipelineOption, current: PipelineOption) -> PipelineOption:
    """The winner's key solved on its own when it took another key's layouts; kept when its split is faster."""
    key: Key = (winner.submesh, winner.names, winner.microbatches)
    source = run.solves.carried_from(key)
    if source is None:
        return current
    old, _ = run.solves.resolve(winner.stages, key)
    again = run.exact((winner.stages, winner.submesh, winner.names, winner.microbatches))
    if again.step_time_s <= current.step_time_s:
        return again
    run.solves.restore(key, old, source, current.costs)
    return current


def search_pipeline(
    model: nn.Module,
    example_inputs: Sequence[Any],
    cluster: ClusterProfile,
    config: PlanConfig,
    microbatch_options: int = 4,
    schedules: Sequence[str] = SCHEDULES,
    *,
    recompute: bool | None = None,
    stage_options: Sequence[int] | None = None,
    exhaustive: bool = False,
    solves: StageSolves | None = None,
) -> list[PipelineOption]:
    """Offline plans' stage search (:func:`search_stages` on fake sub-meshes of ``cluster``, boundaries priced as
    each device's share): every configuration, fastest first, estimated ones last. ``recompute``: None lets each
    split use activation recomputation where only it fits (or it is faster); True/False fixes it.
    ``stage_options`` limits the stage counts tried; ``microbatch_options`` caps the micro-batch sizes (per
    device) walked per kind of sub-mesh. (``pipeline.megatron.megatron_recipe`` prices Megatron's recipe to
    compare with.)"""
    from autoshard.cluster.meshes import mesh_names
    from autoshard.pipeline.blocks import main_sequence

    found = main_sequence(model)
    solves = solves or StageSolves(
        model, example_inputs, config, FakeStageMeshes(cluster), found[0] if found else "", strict_inputs=False
    )
    rungs = [
        (s, sub, mesh_names(sub)) for s, sub in stage_meshes(cluster) if stage_options is None or s in stage_options
    ]
    space = SearchSpace(
        schedules=tuple(schedules), recompute=recompute, sizes=microbatch_options, exhaustive=exhaustive
    )
    return search_stages(model, example_inputs, cluster, config, rungs, space, solves)


__all__ = ["MEGATRON", "microbatch_counts", "search_pipeline", "search_stages", "stage_meshes", "stage_start"]
