"""Pricing one configuration of the stage search: exactly, from its own intra-op solve, or estimated from solved
neighbours.

A configuration (S stages of a sub-mesh, B micro-batches) is split by the inter-op DP from the pieces of its key's
plan (``pipeline.solves``): its free plan and, where the memory budget binds, the fallback recipes solved on the
same program. An estimate takes the pieces of a solved configuration instead:

- of the same kind of sub-mesh (the same axes but the outermost's size) at the same micro-batch per device, a
  device's own work is the same: its pieces are taken as they are, except that the collectives on the outer axis
  are priced again for its size (a parameter's or gradient's bytes stay, an activation's grow with the axis), an
  fsdp recipe's training state is spread over the larger or smaller axis, and the optimizer step follows the state
  (within 1.5% of the exact values on Llama-3-70B over 128 nodes, most within 0.3%);
- at another micro-batch per device, per-micro-batch time and activations are affine in it through a second solved
  size of the kind (fixed latencies plus work: between proportional and constant), else proportional to it: a
  rough guide, which is why the search solves each micro-batch size it walks to.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from autoshard.cluster.profile import ClusterProfile
from autoshard.config import PlanConfig
from autoshard.pipeline.costs import optimizer_step_s
from autoshard.pipeline.solves import FREE, Key, KeyCosts, StageSolves
from autoshard.solver.inter_op import SCHEDULES, PieceCost, StageSplit, best_split

log = logging.getLogger(__name__)

FALLBACK_RECIPES = ("fsdp+tp", "fsdp", "tp", "ddp")
Config = tuple[int, tuple[int, ...], tuple[str, ...], int]  # (stages, sub-mesh shape, axis names, micro-batches)


@dataclass(frozen=True)
class PipelineOption:
    """One configuration: S stages of ``submesh`` each, B micro-batches, and its split (None: no fit)."""

    stages: int
    submesh: tuple[int, ...]
    microbatches: int
    split: StageSplit | None
    note: str = ""
    recipe: str = ""  # "": free intra-op plan and DP split; "tp"/"ddp": a fixed layout; "pp+tp+dp": Megatron's recipe
    layout: str = ""  # the stage plan's layouts, e.g. "dp=6 x tp=8; tokens [S(0), R]; layers.*.attn.wq [R, S(0)]"
    estimated: bool = False  # priced from another configuration's solve (see the module docstring), not its own
    names: tuple[str, ...] = ()  # the sub-mesh's axis names in the search
    p2p_s: float = 0.0  # one boundary send
    costs: KeyCosts | None = dataclasses.field(default=None, compare=False, repr=False)  # the pieces split

    @property
    def step_time_s(self) -> float:
        return self.split.step_time_s if self.split is not None else math.inf

    @property
    def recompute(self) -> bool:
        return self.split is not None and self.split.recompute


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose, and how hard it looks (see the module docstring)."""

    boundary: str = "share"  # "share": each device sends its share of a boundary; "whole": the whole activation
    schedules: tuple[str, ...] = SCHEDULES
    microbatches: int | None = None  # fixed micro-batch count
    recompute: bool | None = None  # None: where only it fits (or it is faster); False / True fixes it
    fallback: tuple[str, ...] = FALLBACK_RECIPES  # recipes weighed where the memory budget binds
    sizes: int = 4  # micro-batch sizes (per device) walked per kind of sub-mesh, at most
    exhaustive: bool = False  # solve every configuration exactly
    # solve what its class estimates within this much of the best solved (0: only what is estimated faster).
    # Estimates are within 0.3% of the exact values on Llama-3-70B over 128 nodes (solving what is estimated a
    # little slower finds nothing), within about 15% on small models whose costs are mostly latencies.
    margin: float = 0.0
    polish: bool = True  # the winner's own solve when it took another key's layouts
    start: int | None = None  # the seed's stage count (None: the middle rung)


def p2p_seconds(cluster: ClusterProfile, world: int, stages: int, boundary: float) -> float:
    """One boundary send of ``boundary`` bytes per device over the link between stages of ``world`` devices."""
    if stages <= 1:
        return 0.0
    spans = world > cluster.devices_per_node or (cluster.nodes > 1 and world * stages > cluster.devices_per_node)
    link = cluster.inter_node if spans else cluster.intra_node
    return link.latency + boundary / link.bandwidth


def kind(sub: tuple[int, ...], names: tuple[str, ...]) -> tuple:
    """A sub-mesh's kind: its axes but the outermost's size (whose devices' work is the same per device)."""
    return sub[1:], names


def _scaled(c: PieceCost, r: float) -> PieceCost:
    return dataclasses.replace(
        c, time_s=c.time_s * r, fwd_s=c.fwd_s * r, act_bytes=int(c.act_bytes * r), input_bytes=int(c.input_bytes * r)
    )


class Pricer:
    """Prices configurations for one run of the stage search (``pipeline.search.search_stages``)."""

    def __init__(self, cluster: ClusterProfile, config: PlanConfig, space: SearchSpace, solves: StageSolves) -> None:
        self.cluster, self.space, self.solves, self.budget = cluster, space, solves, config.memory_budget
        self.optimizer_factor = config.optimizer_factor
        self.estimates: dict[Config, tuple[tuple, PipelineOption]] = {}
        self._moved: dict[tuple, list[tuple[float, float, float]]] = {}

    def moved(self, kc: KeyCosts, ref: tuple[int, ...], sub: tuple[int, ...]) -> list[tuple[float, float, float]]:
        """Per piece, how its (time, forward, per-step) seconds change when its collectives on the outermost axis
        run over ``sub[0]`` devices instead of ``ref[0]`` (at the same micro-batch per device: a parameter's or
        gradient's bytes stay, an activation's grow with the axis); (0, 0, 0) on the same shape."""
        from autoshard.cost.comm import axis_collective_time
        from autoshard.solver.pricing import GRAD_SINK_CREDIT

        if ref == sub or len(ref) != len(sub):
            return [(0.0, 0.0, 0.0)] * (len(kc.layers) + 2)
        key = (id(kc), ref, sub)
        if key not in self._moved:
            was, now = self.solves.meshes.cluster(math.prod(ref)), self.solves.meshes.cluster(math.prod(sub))
            price: dict[tuple, float] = {}
            out = []
            for found in kc.outer:
                dt = dfwd = dstep = 0.0
                for kind, nbytes, grad, fwd, state in found:
                    k = (kind, nbytes, state)
                    if k not in price:
                        grown = nbytes if state else int(nbytes * sub[0] / ref[0])
                        price[k] = axis_collective_time(kind, grown, sub, 0, now) - axis_collective_time(
                            kind, nbytes, ref, 0, was
                        )
                    if grad:
                        dstep += price[k] * (1.0 - GRAD_SINK_CREDIT)
                    else:
                        dt += price[k]
                        dfwd += price[k] if fwd else 0.0
                out.append((dt, dfwd, dstep))
            self._moved[key] = out if out else [(0.0, 0.0, 0.0)] * (len(kc.layers) + 2)
        return self._moved[key]

    def p2p(self, c: Config, kc: KeyCosts) -> float:
        world = math.prod(c[1])
        share = kc.boundary_bytes * (1 if self.space.boundary == "whole" else 1 / world)
        return p2p_seconds(self.cluster, world, c[0], share)

    def split(self, c: Config, kc: KeyCosts, limit: int | None) -> StageSplit | None:
        stages, _, _, b = c
        sched = ("GPipe",) if b == 1 else ("1F1B",) if stages == 1 else self.space.schedules
        return best_split(
            list(kc.layers), kc.head, kc.tail, stages, b, limit, self.p2p(c, kc), sched, recompute=self.space.recompute
        )

    def best_of(
        self,
        c: Config,
        costs: Callable[[str], KeyCosts | None],
        estimated: str = "",
        hint: Callable[[str], KeyCosts | None] | None = None,
        slack: float = 0.0,
    ) -> PipelineOption:
        """The fastest split of ``c`` over its free plan and, where the budget binds, the fallback recipes (a
        recipe whose ``hint`` estimate is more than ``slack`` slower than the best so far is not priced)."""
        stages, sub, names, b = c
        free = costs(FREE)
        best = (self.split(c, free, self.budget), free) if free is not None else (None, None)
        if self.space.fallback and self.budget is not None and free is not None:
            unbounded = self.split(c, free, None) if best[0] is not None else None
            if best[0] is None or (unbounded is not None and unbounded.step_time_s < best[0].step_time_s * (1 - 1e-9)):
                from autoshard.solver.recipes import applicable

                for recipe in (r for r in self.space.fallback if r in applicable(sub)):
                    guess = hint(recipe) if hint is not None and best[0] is not None else None
                    near = self.split(c, guess, self.budget) if guess is not None else None
                    if near is not None and near.step_time_s > best[0].step_time_s * (1 + slack):
                        continue
                    kc = costs(recipe)
                    got = self.split(c, kc, self.budget) if kc is not None else None
                    if got is not None and (best[0] is None or got.step_time_s < best[0].step_time_s):
                        best = (got, kc)
        split, kc = best
        note = "" if split is not None else "no split fits the memory budget"
        if estimated:
            note = estimated + (f"; {note}" if note else "")
        return PipelineOption(
            stages,
            sub,
            b,
            split,
            note,
            kc.recipe if kc else "",
            kc.layout if kc else "",
            bool(estimated),
            names,
            self.p2p(c, kc) if kc else 0.0,
            kc,
        )

    def exact(self, c: Config, solved: Sequence[PipelineOption] = ()) -> PipelineOption:
        """``c`` priced from its own key's solves; a fallback recipe that the ``solved`` configurations estimate
        out of reach is not solved (slower by 1% estimated from its own class, by 5% from another size)."""
        stages, sub, names, b = c
        per = Fraction(self.solves.batch, b * math.prod(sub))
        same = [
            o
            for o in solved
            if kind(o.submesh, o.names) == kind(sub, names)
            and Fraction(self.solves.batch, o.microbatches * math.prod(o.submesh)) == per
        ]
        basis = self.basis(c, same or solved) if solved else None
        opt = self.best_of(
            c,
            lambda r: self.solves.costs(stages, (sub, names, b), r),
            hint=basis[2] if basis is not None else None,
            slack=0.01 if same else 0.05,
        )
        split = opt.split
        log.info(
            "pipeline: %d stages of %s, %d micro-batches: %s",
            stages,
            sub,
            b,
            f"{split.step_time_s:.6f} s ({split.schedule}{', recompute' if split.recompute else ''}"
            f"{', recipe ' + opt.recipe if opt.recipe else ''})"
            if split
            else opt.note,
        )
        return opt

    def estimate(self, c: Config, solved: Sequence[PipelineOption]) -> PipelineOption:
        """``c`` priced from the solved options nearest to it (see the module docstring)."""
        stages, sub, names, b = c
        found = self.basis(c, solved)
        if found is None:
            return PipelineOption(stages, sub, b, None, "not estimated", estimated=True, names=names)
        cache, ref, costs = found
        if c in self.estimates and self.estimates[c][0] == cache:
            return self.estimates[c][1]
        opt = self.best_of(c, costs, f"estimated from {ref.stages} stages of {ref.submesh} x {ref.microbatches}")
        self.estimates[c] = (cache, opt)
        return opt

    def basis(
        self, c: Config, solved: Sequence[PipelineOption]
    ) -> tuple[tuple, PipelineOption, Callable[[str], KeyCosts | None]] | None:
        """What ``c`` is estimated from: (a cache key, the nearest solved option, its pieces per recipe made over
        to ``c``); None with nothing solved. Per-micro-batch costs are affine in the micro-batch per device through
        a second solved option of the kind at another size (fixed latencies plus work), else proportional to it."""
        stages, sub, names, b = c
        per = self.solves.batch / b / math.prod(sub)

        def per_of(o: PipelineOption) -> float:
            return self.solves.batch / o.microbatches / math.prod(o.submesh)

        def key_of(o: PipelineOption) -> Key:
            return (o.submesh, o.names, o.microbatches)

        def gap(o: PipelineOption) -> tuple[bool, float]:
            return (
                kind(o.submesh, o.names) != kind(sub, names),
                abs(math.log2(per_of(o) / per)) + 0.5 * abs(math.log2(math.prod(o.submesh) / math.prod(sub))),
            )

        refs = sorted((o for o in solved if self.solves.known(key_of(o)) is not None), key=gap)
        if not refs:
            return None
        ref = refs[0]
        other = next((o for o in refs[1:] if not gap(o)[0] and not gap(ref)[0] and per_of(o) != per_of(ref)), None)
        p0 = per_of(ref)
        dev, f = self.cluster.device, self.optimizer_factor

        def fit(x0: float, x1: float | None) -> float:
            linear = x0 * per / p0
            if x1 is None or other is None:
                return linear
            v = x0 + (x1 - x0) / (per_of(other) - p0) * (per - p0)
            return min(max(v, min(linear, x0)), max(linear, x0))

        def piece(c0: PieceCost, c1: PieceCost | None, shard: float, moved: tuple[float, float, float]) -> PieceCost:
            state = int(c0.state_bytes * shard)
            step = c0.step_s + moved[2] + optimizer_step_s(state, dev, f) - optimizer_step_s(c0.state_bytes, dev, f)
            return dataclasses.replace(
                c0,
                time_s=fit(c0.time_s, c1 and c1.time_s) + moved[0],
                fwd_s=fit(c0.fwd_s, c1 and c1.fwd_s) + moved[1],
                step_s=max(0.0, step),
                state_bytes=state,
                act_bytes=int(fit(c0.act_bytes, c1 and c1.act_bytes)),
                input_bytes=int(fit(c0.input_bytes, c1 and c1.input_bytes)),
            )

        def costs(recipe: str) -> KeyCosts | None:
            kc = self.solves.known(key_of(ref), recipe)
            k1 = self.solves.known(key_of(other), recipe) if other is not None else None
            if kc is None:
                return None
            # fsdp recipes shard the training state over the outer axis, the others keep it whole there
            shard = math.prod(ref.submesh) / math.prod(sub) if "fsdp" in recipe else 1.0
            moved = self.moved(kc, ref.submesh, sub)
            pieces = [
                piece(x, y, shard, d)
                for x, y, d in zip(
                    (kc.head, *kc.layers, kc.tail),
                    (k1.head, *k1.layers, k1.tail) if k1 else [None] * (len(kc.layers) + 2),
                    moved,
                )
            ]
            return dataclasses.replace(
                kc,
                head=pieces[0],
                layers=tuple(pieces[1:-1]),
                tail=pieces[-1],
                boundary_bytes=int(kc.boundary_bytes * ref.microbatches / b),
            )

        return (key_of(ref), key_of(other) if other else None), ref, costs


__all__ = ["FALLBACK_RECIPES", "Config", "PipelineOption", "Pricer", "SearchSpace", "kind", "p2p_seconds"]
