"""The gradient-accumulation search: the fewest micro-batches whose plan fits the memory budget.

``compile(..., memory_budget=...)`` without ``microbatches``: when no plan of the whole batch fits, 2, 4, 8, ...
micro-batches (each dividing every batched input and leaving every data-parallel shard non-empty) are planned in
turn and the first that fits is kept, with the :class:`~autoshard.runtime.accumulate.Accumulation` that
``ShardedModule.step`` runs. On a process group every rank takes the same branch (rank 0's verdict).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from autoshard.cluster.profile import ClusterProfile
from autoshard.compiler.context import PlanningCache
from autoshard.config import PlanConfig
from autoshard.errors import InfeasibleBudget, RankFailed
from autoshard.inputs import Call, signature_of
from autoshard.messages import warn
from autoshard.notation import describe, format_bytes
from autoshard.plans.plan import Plan, RecipeSummary
from autoshard.runtime.accumulate import Accumulation, accumulated_plan, batched_inputs, loss_weighting, micro_example
from autoshard.runtime.lazy import DATA_PARALLEL_NAMES
from autoshard.search.planned import Planned
from autoshard.search.recompute import plan_graph
from autoshard.search.sample_coupling import Coupling, coupling
from autoshard.solver.recipes import recipe_placements

log = logging.getLogger(__name__)

Caches = dict[int, PlanningCache]  # the planning cache of each micro-batch count (one example shape each)


def plan_accumulated(
    model: nn.Module,
    inputs: tuple | dict | Call,
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    real_group: bool,
    microbatches: int | None,
    weigh_next: bool = False,
    progress: Any = None,
    caches: Caches | None = None,
    recipes_known: Callable[[tuple[RecipeSummary, ...]], None] | None = None,
) -> tuple[Planned, Accumulation | None]:
    """The plan of the whole batch, or of one of ``microbatches`` micro-batches (given, or the fewest that fit the
    memory budget when the whole batch does not), with the Accumulation that ``ShardedModule.step`` runs.
    ``weigh_next``: the next count after the fewest that fit is planned too and the faster step kept (the fewest
    may fit only by sharding or recomputing more than twice as many micro-batches need). ``progress`` reaches
    the planner (``autoshard.plan``'s callback); ``caches``: the captures by micro-batch count, shared with other
    searches of the same call (``search/recipes_alone.py``); ``recipes_known``: the whole batch's recipes as soon
    as its search knows them (``search/recompute.py: plan_graph``)."""
    caches = caches if caches is not None else {}
    if microbatches is not None:
        found = plan_micro(model, inputs, mesh, cluster, config, real_group, int(microbatches), progress, caches)
        if int(microbatches) > 1:
            found_coupling = coupling(found[0], batched_inputs(signature_of(inputs)[1]))
            if found_coupling.mixes:
                warn(
                    log,
                    "microbatches=%d: this model mixes the samples of its batch before the loss (%s); each "
                    "micro-batch sees only its own samples, so the step is not the whole batch's",
                    int(microbatches),
                    found_coupling.mixes,
                )
            else:
                _warn_unknown(found_coupling, int(microbatches))
        return found
    if config.memory_budget is None:
        return plan_micro(model, inputs, mesh, cluster, config, real_group, 1, progress, caches)
    whole_plan, whole = _agreed(
        real_group,
        lambda: plan_micro(model, inputs, mesh, cluster, config, real_group, 1, progress, caches, recipes_known),
    )
    if whole is None:
        if weigh_next and _recomputes(whole_plan[0].plan):
            return _accumulate_instead(model, inputs, mesh, cluster, config, real_group, whole_plan, progress, caches)
        return whole_plan
    least = whole.least_bytes
    tried: list[str] = []
    for k in _microbatch_counts(inputs, mesh, config):
        floor = whole.micro_floor(k)
        if floor is not None and floor > config.memory_budget:  # (proven from the whole batch's solves)
            tried.append(f"{k}: at least {format_bytes(floor)}")
            least = int(floor) if least is None or floor < least else least
            continue
        found, err = _agreed(
            real_group, lambda k=k: plan_micro(model, inputs, mesh, cluster, config, real_group, k, progress, caches)
        )
        if err is not None:
            tried.append(f"{k}: {format_bytes(err.least_bytes) if err.least_bytes else 'none fits'}")
            least = err.least_bytes if err.least_bytes and (least is None or err.least_bytes < least) else least
            continue
        peak = found[0].plan.peak_memory.total
        if peak > config.memory_budget:  # the solver's constraint may count less than the plan's full peak
            tried.append(f"{k}: predicted peak {format_bytes(peak)}")
            least = peak if least is None or peak < least else least
            continue
        found_coupling = coupling(found[0], batched_inputs(signature_of(inputs)[1]))
        mixed = found_coupling.mixes
        if mixed is not None:  # accumulation would fit, but it would change what the model computes
            raise InfeasibleBudget(
                f"{str(whole).rstrip('.')}. Gradient accumulation over {k} micro-batches would fit, but this model "
                f"mixes the samples of its batch before the loss: {mixed}; each micro-batch would see only its own "
                f"samples, which is not the model's training step. Raise the budget, use more devices or a smaller "
                f"batch, or pass microbatches={k} to train on micro-batch statistics knowingly",
                least,
                accumulation=f"{k} micro-batches would fit, but the model mixes the samples of its batch "
                f"before the loss: {mixed} (microbatches={k}, --microbatches {k}, trains on micro-batch statistics "
                "knowingly)",
            ) from whole
        _warn_unknown(found_coupling, k)
        log.info(
            "plan: the whole batch does not fit memory_budget=%s (%s); gradient accumulation over %d "
            "micro-batches fits (predicted peak %s per device)",
            format_bytes(config.memory_budget),
            whole,
            k,
            format_bytes(peak),
        )
        if weigh_next:
            found = _faster_of(found, _next_fit(model, inputs, mesh, cluster, config, real_group, k, progress, caches))
        return found
    smallest = f"; the smallest budget any plan needs is {format_bytes(least)}" if least else ""
    counts = f"micro-batches tried: {'; '.join(tried) or 'none, the batch does not split further'}"
    raise InfeasibleBudget(
        f"{str(whole).rstrip('.')}. Gradient accumulation did not fit either ({counts}){smallest}",
        least,
        accumulation=counts,
    ) from whole


def _warn_unknown(found: Coupling, k: int) -> None:
    """Warn that accumulation over ``k`` micro-batches is kept though the batch could not be followed through
    some ops (``Coupling.unknown``): whether those keep the samples apart is not known."""
    if found.unknown:
        more = f" and {len(found.unknown) - 1} more" if len(found.unknown) > 1 else ""
        warn(
            log,
            "gradient accumulation over %d micro-batches: the batch could not be followed through %s%s; "
            "accumulation assumes they keep the samples of the batch apart (no op found to mix them). If one "
            "does mix them, raise the memory budget or pass microbatches=1",
            k,
            found.unknown[0],
            more,
        )


def _recomputes(plan: Plan) -> bool:
    return bool(plan.recompute or plan.recompute_layers)


def _accumulate_instead(
    model: nn.Module,
    inputs: tuple | dict | Call,
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    real_group: bool,
    whole: tuple[Planned, Accumulation | None],
    progress: Any = None,
    caches: Caches | None = None,
) -> tuple[Planned, Accumulation | None]:
    """The whole batch fits only by recomputing: micro-batches are the other way to hold fewer activations at once.
    Plan 2, 4, ... micro-batches while each fits, is faster than the best so far and the one before still
    recomputes; keep the fastest. Not where the model mixes its samples (accumulation would change the step)."""
    best = whole
    for k in _microbatch_counts(inputs, mesh, config):
        floor = _unbudgeted_floor(model, inputs, mesh, cluster, config, real_group, k, caches)
        if floor * (1.0 - FLOOR_SLACK) >= best[0].plan.step_time_s - 1e-12:
            log.info(
                "plan: %d micro-batches cannot step faster than %.6f s (within %.0f%%) even without a memory "
                "budget, not faster than %d recomputing %s (%.6f s); not planned",
                k,
                floor,
                FLOOR_SLACK * 100,
                best[0].plan.microbatches,
                describe(best[0].plan.recompute_layers) or "every layer",
                best[0].plan.step_time_s,
            )
            break
        found, err = _agreed(
            real_group, lambda k=k: plan_micro(model, inputs, mesh, cluster, config, real_group, k, progress, caches)
        )
        if err is not None or found[0].plan.peak_memory.total > config.memory_budget:
            break
        if found[0].plan.step_time_s >= best[0].plan.step_time_s - 1e-12:
            break
        found_coupling = coupling(found[0], batched_inputs(signature_of(inputs)[1]))
        if found_coupling.mixes is not None or found_coupling.unknown:
            break  # (the whole batch fits: no accumulation whose step is not the batch's, nor one unknown)
        log.info(
            "plan: %d micro-batches step in %.6f s (%s), faster than %d recomputing %s (%.6f s); keeping %d",
            k,
            found[0].plan.step_time_s,
            describe(found[0].plan.recompute_layers) or "nothing recomputed",
            best[0].plan.microbatches,
            describe(best[0].plan.recompute_layers) or "every layer",
            best[0].plan.step_time_s,
            k,
        )
        best = found
        if not _recomputes(found[0].plan):
            break
    return best


# The floor below is the integer program's bound, and a plan's step is its own count of the chosen layouts (a
# recipe's solution is kept where that count is lower, search/planned.py): the two differ by the objective's
# pricing of bundles by shares, measured up to 2.7% (docs/benchmarks.md, "What the integer program and the lowering
# count"; GPT-2 124M's 2 micro-batches under 4 GB: the plan 0.6% below the unbudgeted solve). A count is skipped
# only when its floor is above the plan that recomputes by more than that.
FLOOR_SLACK = 0.03


def _unbudgeted_floor(
    model: nn.Module,
    inputs: tuple | dict | Call,
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    real_group: bool,
    k: int,
    caches: Caches | None,
) -> float:
    """A floor on the step of any plan of ``k`` micro-batches under the budget: the step of the plan of ``k``
    with no budget, nothing recomputed and no recipe solved alongside, at its solver's bound (a budget only
    removes choices, and recomputation only adds time), up to the objective's pricing (``FLOOR_SLACK``). One
    solve of the program the budgeted search captures anyway: its capture is kept in ``caches`` for that search."""
    free = PlanningCache()
    held = caches.get(k) if caches is not None else None
    if held is not None:
        free.captured = held.captured
    relaxed = dataclasses.replace(config, memory_budget=None, solve_recipes=False, recompute=())
    found, _ = _agreed(
        real_group, lambda: plan_micro(model, inputs, mesh, cluster, relaxed, real_group, k, caches={k: free})
    )
    if caches is not None and free.captured is not None:
        kept = caches.setdefault(k, PlanningCache())
        kept.captured = kept.captured or free.captured
    if found is None:
        return 0.0
    one = found[0].plan  # the step of k micro-batches (accumulated_plan), at the solver's bound
    return one.step_time_s * (1.0 - min(max(one.solver.gap, 0.0), 1.0))


def _next_fit(
    model: nn.Module,
    inputs: tuple | dict | Call,
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    real_group: bool,
    k: int,
    progress: Any = None,
    caches: Caches | None = None,
) -> tuple[Planned, Accumulation | None] | None:
    """The plan of the next micro-batch count after ``k`` when one exists and it fits the budget, else None."""
    later = [n for n in _microbatch_counts(inputs, mesh, config) if n > k]
    if not later:
        return None
    found, err = _agreed(
        real_group, lambda: plan_micro(model, inputs, mesh, cluster, config, real_group, later[0], progress, caches)
    )
    if err is not None or found[0].plan.peak_memory.total > config.memory_budget:
        return None
    return found


def _faster_of(
    first: tuple[Planned, Accumulation | None], other: tuple[Planned, Accumulation | None] | None
) -> tuple[Planned, Accumulation | None]:
    if other is None or other[0].plan.step_time_s >= first[0].plan.step_time_s:
        return first
    log.info(
        "plan: %d micro-batches step in %.6f s, faster than %d (%.6f s); keeping %d",
        other[0].plan.microbatches,
        other[0].plan.step_time_s,
        first[0].plan.microbatches,
        first[0].plan.step_time_s,
        other[0].plan.microbatches,
    )
    return other


def _agreed(real_group: bool, attempt: Callable[[], Any]) -> tuple[Any, InfeasibleBudget | None]:
    """``attempt()`` on every rank: (its result, None), or (None, the error) when the budget is infeasible; other
    errors are raised. On a real group rank 0 solves and the other ranks hear of its error only as a
    RuntimeError (``autoshard/compiler/solve.py``): rank 0's verdict is broadcast so that every rank takes the same
    branch."""
    result, err = None, None
    try:
        result = attempt()
    except Exception as e:  # noqa: BLE001 - sorted below, on every rank alike
        err = e
    if real_group:
        box: list[Any] = [err if isinstance(err, InfeasibleBudget) else ("failed" if err is not None else None)]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], InfeasibleBudget):
            return None, box[0]
        if err is None and box[0] is not None:
            raise RankFailed("rank 0 could not plan (see its error); this rank stops too")
    if isinstance(err, InfeasibleBudget):
        return None, err
    if err is not None:
        raise err
    return result, None


def plan_micro(
    model: nn.Module,
    inputs: tuple | dict | Call,
    mesh: DeviceMesh,
    cluster: ClusterProfile,
    config: PlanConfig,
    real_group: bool,
    k: int,
    progress: Any = None,
    caches: Caches | None = None,
    recipes_known: Callable[[tuple[RecipeSummary, ...]], None] | None = None,
) -> tuple[Planned, Accumulation | None]:
    """Plan one of ``k`` micro-batches of ``inputs``; the plan says ``microbatches=k``. ``caches``: the capture of
    each count, kept for the next plan of the same count; ``recipes_known``: as ``plan_graph``'s."""
    cache = caches.setdefault(k, PlanningCache()) if caches is not None else None
    if k == 1:
        return plan_graph(
            model,
            inputs,
            mesh,
            cluster,
            config,
            real_group,
            progress=progress,
            cache=cache,
            recipes_known=recipes_known,
        ), None
    sig, tensors = signature_of(inputs)
    one = plan_graph(
        model,
        micro_example(sig, tensors, k),
        mesh,
        cluster,
        config,
        real_group,
        progress=progress,
        cache=cache,
        recipes_known=recipes_known,
    )
    weighting = loss_weighting(one.graph, one.ctx.output_roles)
    return one.with_plan(accumulated_plan(one.plan, k)), Accumulation(k, batched_inputs(tensors), weighting)


def _microbatch_counts(inputs: tuple | dict | Call, mesh: DeviceMesh, config: PlanConfig) -> list[int]:
    """2, 4, 8, ... micro-batches that divide every batched input's dim 0 and leave each data-parallel shard of
    a micro-batch non-empty and even (inputs pinned ``Shard(0)`` on mesh axes, or the mesh's data-parallel axes;
    a recipe's batch axes: ``solver/recipes.py``)."""
    sig, tensors = signature_of(inputs)
    names = tuple(mesh.mesh_dim_names or (f"d{i}" for i in range(mesh.ndim)))
    batched = [(i, t) for i, (t, b) in enumerate(zip(tensors, batched_inputs(tensors))) if b]
    if not batched:
        return []
    dp = math.prod(s for n, s in zip(names, mesh.shape) if n in DATA_PARALLEL_NAMES)
    need = []  # per batched input: what its micro-batch's dim 0 must be a multiple of
    for i, t in batched:
        pinned = config.constraint_for(f"input[{i}]", "input", names, alias=sig.names[i]) or ()
        split = math.prod(s for p, s in zip(pinned, mesh.shape) if isinstance(p, Shard) and p.dim == 0)
        if config.recipe is not None and t.dim():  # a recipe splits the batch its own way (ddp: over every axis)
            target, _ = recipe_placements(config.recipe, "", "input", "", tuple(t.shape), tuple(mesh.shape))
            split = math.lcm(
                max(split, 1), math.prod(s for p, s in zip(target, mesh.shape) if isinstance(p, Shard) and p.dim == 0)
            )
        need.append((t.shape[0], max(split, 1), dp))
    out, k = [], 2
    while all(b // k >= 1 for b, _, _ in need):
        if all(b % k == 0 and (b // k) % split == 0 and b // k >= d for b, split, d in need):
            out.append(k)
        k *= 2
    return out


__all__ = ["Caches", "plan_accumulated", "plan_micro"]
