"""The solve pass's memory constraint with the step's whole peak (part of ``solve``, not a pass of its own).

The integer program's memory is a sum over decision groups (state in each group's layouts, saved activations);
the step's peak also holds temporaries (``autoshard/cost/memory.py``) that depend on the whole solution, not on
one group, except the gradients that wait whole for their reduce-scatter, which the program's memory row counts
(``IntraOpProblem.pair_waits``: on their edges, or the least each parameter's layout implies). ``solve_within`` keeps
the budget honest by a fixed point: solve under the budget, price the solution's temporaries, and while the whole peak
is over the budget solve again with the temporaries the row does not count held back from it (a few rounds; they change
little between rounds, as the layouts that set them do). A budget that no round meets raises ``InfeasibleBudget`` naming
the peak of the last round.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch.fx as fx

from autoshard.compiler.context import PassContext
from autoshard.cost.memory import temporaries, transients
from autoshard.errors import InfeasibleBudget
from autoshard.ir import NodeSharding
from autoshard.notation import format_bytes
from autoshard.solver.intra_op import Solution

log = logging.getLogger(__name__)

ROUNDS = 4


def layouts_of(ctx: PassContext, sol: Solution) -> dict[str, NodeSharding]:
    """Every node's layout under ``sol`` (what ``annotate`` writes on the graph), by node name."""
    out: dict[str, NodeSharding] = {}
    for g in ctx.groups:
        s = ctx.strategies[g.id][sol.choice[g.id]]
        for i, name in enumerate(g.members):
            first = i == 0 and g.kind == "parameter"
            out[name] = NodeSharding(
                g.id,
                s.outputs[i],
                s.inputs[i],
                s.grad_placements if first else None,
                s.state_placements if first else None,
                s.offload if first else "",
            )
    return out


def temporaries_of(gm: fx.GraphModule, ctx: PassContext, sol: Solution) -> int:
    """The bytes ``sol``'s step holds at its peak beyond the solver's sum (``MemoryBreakdown.temporaries``)."""
    acts = opt = 0.0
    for g in ctx.groups:
        s = ctx.strategies[g.id][sol.choice[g.id]]
        w = ctx.group_weight.get(g.id, 1.0)
        acts += w * s.activation_bytes
        opt += w * s.optimizer_bytes
    factor = ctx.config.optimizer_factor
    layouts = layouts_of(ctx, sol)
    t = transients(
        gm,
        ctx.mesh_shape,
        ctx.output_roles,
        layouts,
        weight=lambda n: ctx.group_weight.get(layouts[n.name].group, 1.0) if n.name in layouts else 1.0,
    )
    return temporaries(t, acts, opt / factor if factor else 0.0)


def step_floor(ctx: PassContext, pins: dict[int, set[int]] | None = None) -> int:
    """The least peak any choice of this program can have (over the candidates ``pins`` leave), at any batch size:
    the step's peak holds each group's state (parameters, gradients, optimizer state) and at least the optimizer
    step's temporaries less the saved activations (``cost.memory.temporaries``) on top of those activations, and
    neither term shrinks with the batch. Separable over the decision groups, so the least of each is summed."""
    canon = ctx.layer_of_group or {g.id: g.id for g in ctx.groups}
    factor = ctx.config.optimizer_factor
    members: dict[int, list[int]] = {}
    for g in ctx.groups:
        members.setdefault(canon[g.id], []).append(g.id)
    total = 0.0
    for c, gids in members.items():
        keep = (pins or {}).get(c)
        total += min(
            sum(ctx.group_weight.get(g, 1.0) * _state_and_step(ctx.strategies[g][i], factor) for g in gids)
            for i in range(len(ctx.strategies[c]))
            if keep is None or i in keep
        )
    return math.floor(total * (1 - 1e-9))


def _state_and_step(s: Any, factor: int) -> float:
    return s.param_bytes + s.grad_bytes + s.optimizer_bytes + (s.optimizer_bytes / factor if factor else 0.0)


def solve_within(gm: fx.GraphModule, ctx: PassContext, budget: int | None, **kw: Any) -> Solution:
    """``ctx.problem.solve`` under ``budget`` counting the whole peak (see the module docstring).

    Each round holds back the last solution's temporaries (at least its excess over the budget). A hold-back
    the solver proves infeasible is not the end: the plans a tighter budget forces have temporaries of their
    own, often smaller (fewer gradient buckets, no gathered weights), so the rounds then bisect between the
    largest hold-back that still had a plan and the smallest that had none."""
    sol = ctx.problem.solve(memory_budget=budget, **kw)
    if budget is None:
        return sol
    what = kw.get("what", "plan")
    held, solvable, unsolvable = 0, 0, budget  # hold-backs known to leave a plan / to leave none
    proof: tuple[int, int] | None = None  # (least bytes, temporaries) when the last solve found no plan
    for _ in range(ROUNDS + 4):
        extra = temporaries_of(gm, ctx, sol)
        if sol.memory_bytes + extra <= budget:
            return sol
        solvable = max(solvable, held)
        # (the gradients waiting for their reduce-scatter are in the program's memory row already)
        want = max(held + 1, extra - sol.waiting_bytes, held + (sol.memory_bytes + extra - budget))
        if want >= unsolvable:
            want = (solvable + unsolvable) // 2
        if want <= solvable:
            break
        log.info(
            "solve %s: peak %s with %s of temporaries is over the budget %s; solving again with %s held back",
            what,
            format_bytes(sol.memory_bytes + extra),
            format_bytes(extra),
            format_bytes(budget),
            format_bytes(want),
        )
        try:
            sol, held, proof = ctx.problem.solve(memory_budget=budget - want, **kw), want, None
        except InfeasibleBudget as e:
            unsolvable, proof = want, ((e.least_bytes or budget - want) + extra, extra)
    if proof is not None:
        least, extra = proof
        raise InfeasibleBudget(
            f"memory_budget={format_bytes(budget)} per device is below what any {what} needs with the step's "
            f"temporaries: about {format_bytes(least)} (the state and saved activations sharded as far as the mesh "
            f"allows, plus {format_bytes(extra)} of backward temporaries and gathered weights). Raise the budget, "
            "use more devices, or a smaller batch.",
            int(least),
        )
    peak = sol.memory_bytes + temporaries_of(gm, ctx, sol)
    raise InfeasibleBudget(
        f"memory_budget={format_bytes(budget)} per device: the plan that fits it on the solver's count still peaks "
        f"at {format_bytes(peak)} with the step's temporaries (backward temporaries, gathered weights); raise the "
        f"budget to at least {format_bytes(peak)}, use more devices, or a smaller batch.",
        int(peak),
    )


__all__ = ["layouts_of", "solve_within", "step_floor", "temporaries_of"]
