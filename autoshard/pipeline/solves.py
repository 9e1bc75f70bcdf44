"""The intra-op solves behind the stage search, made once and reused.

The stage search (``pipeline.search``) prices a configuration (S stages of a sub-mesh, B micro-batches) from the
intra-op plan of the whole model on one stage's sub-mesh at the micro-batch size: its *key* (sub-mesh shape, axis
names, B). :class:`StageSolves` keeps, for one model, example call and config, what it made on the way:

- the captured graph per micro-batch count B: capture does not depend on the mesh, so coarsen .. solve run on the
  same captured graph for every sub-mesh (they only write node metadata, which a key's layouts overwrite again,
  ``annotate``, before its graph is read);
- per key: the context after ``strategies``, the free plan (solved for time alone; the config's recipe when it
  names one), each manual recipe solved on the same program when asked, and each solution's pieces
  (``pipeline.costs``, the optimizer step added) with the boundary activation's global bytes;
- reuse across stage counts: what a device computes and sends inside its stage depends on its share of the
  micro-batch and on the mesh's inner axes, not on how many stages there are, so a key whose per-device
  micro-batch and inner axes match an already solved key's takes that key's layouts (the same placements for every
  decision group, costed exactly on its own graph: a real plan, within a few percent of its own optimum on the zoo)
  instead of a new CP-SAT solve. :meth:`StageSolves.resolve` makes that key's own solve (the chosen configuration's).

Where the sub-meshes live is a :class:`StageMeshes`: a fake process group per sub-mesh for offline plans
(:class:`FakeStageMeshes`), the real ``pp`` sub-meshes in ``compile`` (``pipeline/compile_stages.py``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
from collections.abc import Iterator
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoshard.cluster.profile import ClusterProfile
from autoshard.compiler.context import PassContext
from autoshard.config import PlanConfig
from autoshard.errors import InputError
from autoshard.ir import repeated_layers
from autoshard.pipeline.costs import boundary_node, with_optimizer
from autoshard.solver.inter_op import PieceCost

if TYPE_CHECKING:
    from autoshard.plans.plan import Plan
    from autoshard.solver.intra_op import Solution

log = logging.getLogger(__name__)

Key = tuple[tuple[int, ...], tuple[str, ...], int]  # (sub-mesh shape, axis names, micro-batch count)
FREE = ""  # the free plan's label among a key's solutions (else a recipe name)


class StageMeshes(Protocol):
    """Where stage sub-meshes are planned: ``mesh`` gives the sub-mesh of ``stages`` stages to plan on (for the
    duration), ``cluster`` the cluster a sub-mesh of ``world`` devices is priced on; ``broadcast``: rank 0 solves
    and sends its solution (a real process group)."""

    broadcast: bool

    def mesh(
        self, stages: int, shape: tuple[int, ...], names: tuple[str, ...]
    ) -> contextlib.AbstractContextManager[DeviceMesh]: ...

    def cluster(self, world: int) -> ClusterProfile: ...


def sub_cluster(cluster: ClusterProfile, world: int) -> ClusterProfile:
    """``cluster`` cut to ``world`` devices: whole nodes, or part of one."""
    per = cluster.devices_per_node
    return cluster.with_size(max(1, world // per), min(world, per))


class FakeStageMeshes:
    """Offline planning: each sub-mesh on a ``fake`` process group of its size, priced as part of ``cluster``."""

    broadcast = False

    def __init__(self, cluster: ClusterProfile) -> None:
        self.full = cluster

    @contextlib.contextmanager
    def mesh(self, stages: int, shape: tuple[int, ...], names: tuple[str, ...]) -> Iterator[DeviceMesh]:
        from torch.distributed.device_mesh import init_device_mesh

        from autoshard.cluster.meshes import fake_world

        with fake_world(math.prod(shape)):
            yield init_device_mesh("cpu", shape, mesh_dim_names=names)

    def cluster(self, world: int) -> ClusterProfile:
        return sub_cluster(self.full, world)


def micro_call(call: Any, parts: int) -> Any:
    """The first of ``parts`` micro-batches of a call (every tensor cut along dim 0), shaped like the call."""
    from autoshard.inputs import Call, signature_of

    sig, tensors = signature_of(call)
    for name, t in zip(sig.names, tensors):
        if t.ndim == 0 or t.shape[0] % parts:
            raise InputError(
                f"argument {name} of shape {tuple(t.shape)}: pipeline micro-batches cut every input "
                f"along dim 0 into {parts}, which must divide it"
            )
    args, kwargs = sig.unflatten([t[: t.shape[0] // parts] for t in tensors])
    return Call(args, kwargs) if kwargs else args


def micro_inputs(inputs: Any, parts: int) -> Any:
    """Offline planning's micro-batch: the first of ``parts`` of every batched input of a positional call (an
    input whose dim 0 ``parts`` does not divide is left whole); other calls as :func:`micro_call`."""
    if not isinstance(inputs, (tuple, list)):
        return micro_call(inputs, parts)
    return tuple(
        x[: x.shape[0] // parts] if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] % parts == 0 else x
        for x in inputs
    )


def layout_summary(plan: Plan, limit: int = 10, activation: str = "") -> str:
    """The mesh, ``activation`` (e.g. the layers' input placement) and the placements of the first input and of
    the weight matrices (one entry per distinct parameter name, layer indices folded to ``*``), e.g.
    ``dp=6 x tp=8; act [S(0), R]; tokens [S(0), R]; wte [S(0), S(1)]``."""
    import re

    stage = plan.stages[0]
    parts = [" x ".join(f"{n}={s}" for n, s in zip(plan.mesh.names, plan.mesh.shape))]
    limit += bool(activation)
    if activation:
        parts.append(activation)
    seen: set[str] = set()
    inputs = [t for t in stage.tensors if t.role == "input"]
    weights = [t for t in stage.tensors if t.role == "parameter" and len(t.shape) >= 2]
    for t in inputs[:1] + weights:
        name = re.sub(r"\.\d+\.", ".*.", t.name).removesuffix(".weight")
        if name in seen:
            continue
        seen.add(name)
        parts.append(f"{name} [{', '.join(t.placements)}]")
        if len(parts) > limit:
            break
    return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class KeyCosts:
    """One solution of a key as the stage DP sees it."""

    head: PieceCost
    layers: tuple[PieceCost, ...]
    tail: PieceCost
    boundary_bytes: int  # global bytes of the activation a stage boundary sends
    layout: str  # ``layout_summary`` of the stage plan
    recipe: str  # "" for the free plan
    source: str  # how its layouts were found: "solved", or "layouts of the (128, 8) solve"
    outer: tuple[Any, ...] = ()  # per piece, its collectives on the outermost axis (``costs.piece_detail``)


@dataclasses.dataclass
class _Entry:
    stages: int  # the stage count it was first made for (its mesh in compile)
    gm: fx.GraphModule
    ctx: PassContext
    solutions: dict[str, Any]  # FREE or recipe name -> Solution (None: the recipe does not apply)
    source: Key | None  # the key whose layouts the free plan took (None: solved here)
    costs: dict[str, KeyCosts | None] = dataclasses.field(default_factory=dict)


def _per_device(key: Key, batch: int) -> tuple[Fraction, tuple[int, ...], tuple[str, ...]]:
    shape, names, b = key
    return Fraction(batch, b * math.prod(shape)), shape[1:], names


class StageSolves:
    """The keys solved for one model, example call and config (see the module docstring). ``container`` is the
    repeated layers' module path the pieces follow; ``reuse`` lets a key take a matching solved key's layouts."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        config: PlanConfig,
        meshes: StageMeshes,
        container: str,
        reuse: bool = True,
        strict_inputs: bool = True,
    ) -> None:
        from autoshard.inputs import signature_of

        self.model, self.inputs, self.meshes, self.container, self.reuse = model, inputs, meshes, container, reuse
        self.micro = micro_call if strict_inputs else micro_inputs
        self.config = dataclasses.replace(config, memory_budget=None, solve_recipes=False)
        sampled = repeated_layers(model) if config.sample_layers else None
        if sampled is not None and sampled[0] != container:
            # sampled capture stands the first layers of ``sampled`` for all of them; the pieces follow
            # ``container``, another sequence (a hybrid stack beside a list of identical blocks): capture all
            self.config = dataclasses.replace(self.config, sample_layers=None)
        self.batch = int(signature_of(inputs)[1][0].shape[0])
        self.captured: dict[int, tuple[fx.GraphModule, PassContext]] = {}
        self._keys: dict[Key, _Entry] = {}
        self._on_graph: dict[int, tuple[Key, str]] = {}  # B -> the key and solution written on its graph
        self.solved = self.carried = 0  # free plans solved by CP-SAT / carried over from another key

    # --- graphs and contexts ---------------------------------------------------------------------------------

    def capture(self, b: int, mesh: DeviceMesh, cluster: ClusterProfile) -> tuple[fx.GraphModule, PassContext]:
        """The captured graph of one of ``b`` micro-batches (made on first use) and its capture context."""
        from autoshard.compiler.runner import run_passes

        if b not in self.captured:
            ctx = PassContext(
                mesh=mesh,
                cluster=cluster,
                config=self.config,
                broadcast_solution=self.meshes.broadcast,
                example_inputs=self.micro(self.inputs, b) if b > 1 else self.inputs,
            )
            self.captured[b] = (run_passes(self.model, ctx, "capture", "capture"), ctx)
        return self.captured[b]

    def context(
        self, b: int, mesh: DeviceMesh, cluster: ClusterProfile, config: PlanConfig, progress: Any = None
    ) -> tuple[fx.GraphModule, PassContext]:
        """A fresh context on ``mesh`` carrying the capture's products (the graph is shared: run the passes from
        coarsen on); the constraints are checked against this mesh's axis names as capture checks them."""
        gm, cap = self.capture(b, mesh, cluster)
        ctx = PassContext(
            mesh=mesh,
            cluster=cluster,
            config=config,
            broadcast_solution=self.meshes.broadcast,
            progress=progress,
            example_inputs=cap.example_inputs,
        )
        blank = PassContext(mesh=mesh, cluster=cluster, config=config)
        for f in dataclasses.fields(PassContext):
            value = getattr(cap, f.name)
            if f.name not in ("mesh", "cluster", "config", "progress", "timings") and value != getattr(blank, f.name):
                setattr(ctx, f.name, copy.copy(value))
        params = [n for n, _ in self.model.named_parameters(remove_duplicate=False)]
        config.check_constraints(params, ctx.signature.names if ctx.signature else (), ctx.mesh_names)
        self._on_graph.pop(b, None)
        return gm, ctx

    def _entry(self, stages: int, key: Key) -> _Entry:
        """``key``'s graph and context through ``strategies`` (solutions are made when asked)."""
        from autoshard.compiler.runner import run_passes

        if key not in self._keys:
            shape, names, b = key
            with self.meshes.mesh(stages, shape, names) as mesh:
                gm, ctx = self.context(b, mesh, self.meshes.cluster(math.prod(shape)), self.config)
                gm = run_passes(gm, ctx, "coarsen", "strategies")
            self._keys[key] = _Entry(stages, gm, ctx, {}, None)
        return self._keys[key]

    def _free(self, entry: _Entry, key: Key) -> Any:
        """The free plan: a matching solved key's layouts carried over, else solved here."""
        from autoshard.compiler.runner import run_passes
        from autoshard.compiler.solve import annotate

        source = self._source(key) if self.reuse else None
        sol = None if source is None else self._carry(self._keys[source], entry.ctx, source)
        self._on_graph.pop(key[2], None)
        if sol is None:
            with self.meshes.mesh(entry.stages, key[0], key[1]):
                run_passes(entry.gm, entry.ctx, "solve", "solve")
            self.solved += 1
        else:
            entry.ctx.solution, entry.source = sol, source
            annotate(entry.gm, entry.ctx, sol)
            self.carried += 1
        self._on_graph[key[2]] = (key, FREE)
        return entry.ctx.solution

    def _source(self, key: Key) -> Key | None:
        """The solved key with the same per-device micro-batch and inner axes nearest in size, if any."""
        want = _per_device(key, self.batch)
        same = [
            k
            for k, e in self._keys.items()
            if FREE in e.solutions and e.source is None and _per_device(k, self.batch) == want
        ]
        return min(same, key=lambda k: abs(math.log(math.prod(k[0]) / math.prod(key[0]))), default=None)

    @staticmethod
    def _carry(src: _Entry, ctx: PassContext, source: Key) -> Any:
        """``src``'s free layouts as a solution of ``ctx`` (None when some group has no such candidate)."""
        from autoshard.solver.intra_op import Solution

        sol = src.solutions[FREE]
        choice = {}
        for g in ctx.groups:
            if len(src.ctx.groups) <= g.id or src.ctx.groups[g.id].anchor != g.anchor:
                return None
            want = src.ctx.strategies[g.id][sol.choice[g.id]]
            hit = next(
                (
                    i
                    for i, s in enumerate(ctx.strategies[g.id])
                    if (s.outputs, s.inputs, s.grad_placements, s.state_placements, s.offload)
                    == (want.outputs, want.inputs, want.grad_placements, want.state_placements, want.offload)
                ),
                None,
            )
            if hit is None:
                return None
            choice[g.id] = hit
        status = f"FEASIBLE (the layouts of the {source[0]} solve at the same micro-batch per device)"
        return Solution(choice, status, math.nan, math.nan, 0.0, 0, 0)

    def _write(self, key: Key, label: str) -> _Entry:
        """Put ``key``'s ``label`` solution on its graph (shared by every key of its micro-batch count)."""
        from autoshard.compiler.solve import annotate

        entry = self._keys[key]
        if self._on_graph.get(key[2]) != (key, label):
            annotate(entry.gm, entry.ctx, entry.solutions[label])
            self._on_graph[key[2]] = (key, label)
        return entry

    # --- what the search asks --------------------------------------------------------------------------------

    def costs(self, stages: int, key: Key, recipe: str = FREE) -> KeyCosts | None:
        """The pieces of ``key``'s free plan or of a recipe solved on its program (None: the recipe does not
        apply to this sub-mesh or has no solution)."""
        from autoshard.notation import placement_str
        from autoshard.pipeline.costs import piece_detail
        from autoshard.search.planned import build_plan

        entry = self._entry(stages, key)
        if recipe not in entry.costs:
            sol = self._solution(entry, key, recipe)
            if sol is None:
                entry.costs[recipe] = None
                return None
            self._write(key, recipe)
            gm, ctx = entry.gm, entry.ctx
            dev, f = ctx.cluster.device, self.config.optimizer_factor
            head, layers, tail, outer = piece_detail(gm, ctx, sol, container=self.container)
            node = boundary_node(gm, ctx)
            act = "" if node is None else f"act [{', '.join(map(placement_str, node.meta['autoshard'].outputs[0]))}]"
            label = recipe or (self.config.recipe or "")
            plan = build_plan(gm, ctx, sol, recipe=label)
            if math.isnan(sol.objective_s):  # carried layouts: their objective is what they cost here; no bound
                sol = dataclasses.replace(sol, objective_s=plan.step_time_s, bound_s=0.0)
                entry.solutions[recipe] = sol
                if recipe == FREE:
                    ctx.solution = sol
            src = entry.source if recipe == FREE else None
            entry.costs[recipe] = KeyCosts(
                with_optimizer(head, dev, f),
                tuple(with_optimizer(c, dev, f) for c in layers),
                with_optimizer(tail, dev, f),
                0 if node is None else node.meta["val"].numel() * node.meta["val"].element_size(),
                layout_summary(plan, activation=act),
                label,
                "solved" if src is None else f"layouts of the {src[0]} solve",
                tuple(outer),
            )
        return entry.costs[recipe]

    def _solution(self, entry: _Entry, key: Key, recipe: str) -> Any:
        from autoshard.compiler.solve_recipes import solve_recipe

        if recipe not in entry.solutions and recipe == FREE:
            entry.solutions[FREE] = self._free(entry, key)
        if recipe not in entry.solutions:
            ctx = entry.ctx
            if ctx.problem is None:  # a carried-over plan was not solved here: the program is made now
                from autoshard.solver.intra_op import IntraOpProblem

                canon = ctx.layer_of_group or {g.id: g.id for g in ctx.groups}
                ctx.problem = IntraOpProblem(
                    entry.gm,
                    ctx.groups,
                    ctx.strategies,
                    canon,
                    ctx.output_roles,
                    ctx.mesh_shape,
                    ctx.cluster,
                    ctx.group_weight,
                    grad_itemsize=ctx.config.reduce_itemsize,
                )
            res = solve_recipe(recipe, entry.gm, ctx)
            entry.solutions[recipe] = res.solution
        return entry.solutions[recipe]

    def plan(self, mesh: DeviceMesh, cluster: ClusterProfile, config: PlanConfig, progress: Any = None) -> Plan:
        """``search/recompute.py: plan_graph``'s Plan of the whole batch on ``mesh`` under ``config``, from the kept
        capture."""
        from autoshard.compiler.runner import run_passes
        from autoshard.search.planned import build_plan, recipe_summaries

        gm, ctx = self.context(1, mesh, cluster, config, progress)
        gm = run_passes(gm, ctx, "coarsen", "solve")
        plan = build_plan(gm, ctx, recipe=ctx.config.recipe or "")
        if ctx.recipes:
            plan = dataclasses.replace(plan, recipes=recipe_summaries(gm, ctx, against=plan))
        self._on_graph.pop(1, None)
        log.info("plan: predicted step %.6f s (capture kept from the stage search)", plan.step_time_s)
        return plan

    def known(self, key: Key, recipe: str = FREE) -> KeyCosts | None:
        """Costs already made for ``key`` (None when not made: nothing is solved here)."""
        entry = self._keys.get(key)
        return None if entry is None else entry.costs.get(recipe)

    def carried_from(self, key: Key) -> Key | None:
        entry = self._keys.get(key)
        return None if entry is None else entry.source

    def resolve(self, stages: int, key: Key) -> tuple[Any, KeyCosts | None]:
        """Solve ``key``'s own free plan when it took another key's layouts; returns the carried-over solution
        (to put back with :meth:`restore` if the solve is not better for the pipeline) and the new costs."""
        from autoshard.compiler.runner import run_passes

        entry = self._entry(stages, key)
        old = self._solution(entry, key, FREE)
        if entry.source is None:
            return old, entry.costs.get(FREE)
        with self.meshes.mesh(stages, key[0], key[1]):
            self._on_graph.pop(key[2], None)
            run_passes(entry.gm, entry.ctx, "solve", "solve")
        self.solved += 1
        self._on_graph[key[2]] = (key, FREE)
        entry.solutions[FREE], entry.source = entry.ctx.solution, None
        entry.costs.pop(FREE, None)
        return old, self.costs(stages, key)

    def restore(self, key: Key, solution: Solution, source: Key, costs: KeyCosts | None) -> None:
        entry = self._keys[key]
        entry.solutions[FREE], entry.source, entry.ctx.solution = solution, source, solution
        entry.costs[FREE] = costs
        self._on_graph.pop(key[2], None)

    def graph(self, stages: int, key: Key, recipe: str = FREE) -> tuple[fx.GraphModule, PassContext, Any]:
        """``key``'s graph with the ``recipe`` solution written on it, its context and that solution."""
        entry = self._entry(stages, key)
        sol = self._solution(entry, key, recipe)
        if sol is None:
            raise InputError(f"recipe {recipe!r} has no solution on sub-mesh {key[0]}")
        self._write(key, recipe)
        return entry.gm, entry.ctx, sol


__all__ = [
    "FREE",
    "FakeStageMeshes",
    "Key",
    "KeyCosts",
    "StageMeshes",
    "StageSolves",
    "layout_summary",
    "micro_call",
    "micro_inputs",
    "sub_cluster",
]
