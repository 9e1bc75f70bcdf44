"""A saved plan's choices instead of a new solve (part of ``solve``, not a pass of its own): ``compile(model, mesh,
inputs, plan=saved)``.

The captured program is first checked against the plan's fingerprint (``autoshard/plans/fingerprint.py``): a plan made
for another program, input shapes, mesh, cluster, precision or torch/autoshard version is refused with the parts
that differ. Then every decision group takes the candidate the plan names: an op group the one whose anchor has
the plan's output and input placements (``OpDecision``), a parameter or input the one with the plan's layouts
(``TensorLayout``: placements, gradient and state layouts, offload), a group with one candidate that one. A plan
that names no candidate of some group is refused naming the node. The solution is priced by the same integer
program (``IntraOpProblem.evaluate``), so the rebuilt plan predicts what the saved one did.
"""

from __future__ import annotations

import torch.fx as fx

from autoshard.compiler.context import PassContext
from autoshard.errors import InputError
from autoshard.ir import GroupStrategy
from autoshard.notation import placements_tuple
from autoshard.plans.fingerprint import fingerprint, mismatch
from autoshard.solver.intra_op import Solution


def _tensor_key(s: GroupStrategy) -> tuple:
    zero = s.state_placements is not None
    return (
        placements_tuple(s.outputs[0][0]),
        placements_tuple(s.grad_placements) if zero else (),
        placements_tuple(s.state_placements),
        s.offload,
    )


def _op_key(s: GroupStrategy) -> tuple:
    return placements_tuple(s.outputs[0][0]), tuple(placements_tuple(p) for p in s.inputs[0])


def _key_or_none(key: object, s: GroupStrategy) -> tuple | None:
    """A candidate's key, or None for one with a placement the plan notation cannot name (DTensor's
    ``_StridedShard``, which torch 2.13 offers for some views): no plan names it, so it never matches."""
    try:
        return key(s)  # type: ignore[operator]
    except InputError:
        return None


def _nameable(s: GroupStrategy) -> bool:
    """Whether every layout of candidate ``s`` (each member's outputs and inputs) is one a plan can name."""
    try:
        for outs, ins in zip(s.outputs, s.inputs):
            for p in (*outs, *ins):
                if p is not None:
                    placements_tuple(p)
    except InputError:
        return False
    return True


def program_fingerprint(gm: fx.GraphModule, ctx: PassContext) -> tuple[tuple[str, str], ...]:
    names = ctx.signature.names if ctx.signature is not None else ()
    return fingerprint(gm, ctx.mesh_shape, ctx.mesh_names, ctx.cluster, ctx.config, names)


def reused_solution(gm: fx.GraphModule, ctx: PassContext, plan: object) -> Solution:
    """The solution that realises ``plan`` on this captured program (see the module docstring)."""
    stages = getattr(plan, "stages", ())
    if len(stages) != 1:
        raise InputError(
            f"plan= runs a single-stage plan; this one has {len(stages)} pipeline stages (compile with "
            "the 'pp' mesh and let it plan the stages)"
        )
    if plan.fingerprint:
        diff = mismatch(plan.fingerprint, program_fingerprint(gm, ctx))
        if diff:
            raise InputError(
                "plan= was made for another program; what differs: "
                + "; ".join(diff)
                + ". Re-plan (autoshard.plan / compile without plan=) for this one."
            )
    tensors = {t.name: (t.placements, t.grad_placements, t.state_placements, t.offload) for t in stages[0].tensors}
    ops = {d.node: (d.output, d.inputs) for d in stages[0].ops}
    nodes = {n.name: n for n in gm.graph.nodes}
    choice_c: dict[int, int] = {}
    ties: dict[int, list[int]] = {}
    for c in ctx.problem.canon_ids:
        group = next(g for g in ctx.groups if g.id == c)
        cands = ctx.strategies[c]
        if len(cands) == 1:
            choice_c[c] = 0
            continue
        anchor = nodes[group.anchor]
        role = anchor.meta.get("autoshard_role")
        if role is not None and role.name in tensors:
            want, key = tensors[role.name], _tensor_key
        elif group.anchor in ops:
            want, key = ops[group.anchor], _op_key
        else:
            raise InputError(
                f"plan= names no layout for {group.anchor} ({anchor.target}); the plan does not match "
                "this program: re-plan it"
            )
        hits = [i for i, s in enumerate(cands) if _key_or_none(key, s) == want]
        hits = [i for i in hits if _nameable(cands[i])] or hits
        if not hits:
            raise InputError(
                f"plan= asks {group.anchor} ({anchor.target}) for {want}, which is not one of its "
                f"{len(cands)} candidates here; re-plan it for this program"
            )
        choice_c[c] = hits[0]
        if len(hits) > 1:
            ties[c] = hits
    # candidates that agree on what a plan names (the anchor's layouts) may differ in their other members': of
    # those (every layout one the notation names first), the one the program prices cheapest
    for _ in range(2):
        for c, hits in ties.items():
            choice_c[c] = min(hits, key=lambda i: ctx.problem.evaluate({**choice_c, c: i}))
    canon = ctx.layer_of_group or {}
    choice = {g.id: choice_c[canon.get(g.id, g.id)] for g in ctx.groups}
    objective = ctx.problem.evaluate(choice_c)
    return Solution(choice, "REUSED", objective, objective, ctx.problem.build_s, 0, int(ctx.problem.memory(choice_c)))


__all__ = ["program_fingerprint", "reused_solution"]
