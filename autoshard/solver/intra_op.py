"""The intra-op integer program (Alpa's formulation, solved with OR-Tools CP-SAT).

Variables. For every canonical decision group c (identical repeated layers share one c, with multiplicity
m_c) and candidate i: a boolean x[c,i], with AddExactlyOne over i. A group with one candidate has no variable.

Edges. A tensor produced in group u and read by group v costs R[i,j] = the time to redistribute the producer's
layout under u's candidate i to the layout v's candidate j requires (``autoshard/solver/pricing.py`` prices every
term).
Candidates are bucketed by the layout that matters to the edge (src layouts P, dst layouts Q), so the edge
has |P|·|Q| booleans e[p,q] in the tight "marginal" form:
    Σ_q e[p,q] = Σ_{i in p} x[u,i]      Σ_p e[p,q] = Σ_{j in q} x[v,j]
An edge with |P| = 1 or |Q| = 1 is a unary cost on the other side; one whose two ends map to the same
canonical group (a self edge, or the same position in two shared layers) is the diagonal R[i,i].
Graph outputs are edges too: the loss must end Replicate (an all-reduce of a Partial loss) and every gradient
must end in its parameter's layout (parameter <-> gradient consistency: an all-reduce for a replicated
parameter, a reduce-scatter for a sharded one).

Bundles. A move the lowering makes one collective with others (``autoshard/buckets.py``: a gradient's bucketed
all-reduce or reduce-scatter, a layer's parameter gathers, ZeRO's masters after the step) pays its bytes at full
bandwidth and its share of the bundle's latency and sync: a gradient the part of one 25 MiB bucket its bytes fill,
a parameter one in its layer's gather group (``ir.gather_group_sizes``), a master one in every parameter. The shares
of a bundle whose members are all chosen sum to one latency, as the lowering pays it; no variable is added.

Objective. min Σ m_c (compute + internal comm)[c,i] x[c,i] + Σ_edges m_e R[p,q] e[p,q], in integer
nanoseconds: the predicted step time of a program that does not overlap communication with compute.

Memory. With a per-device budget B: Σ m_c (state + saved activations)[c,i] x[c,i] + Σ_gradient edges
W[p,q] e[p,q] <= B (units of about a millionth of B), where state = parameter + gradient + optimizer bytes and
W the bytes of a gradient made larger than its layout, which waits whole for its bucket's reduce-scatter (two
layers' worth at the backward's peak, so an edge standing for several layers counts twice). The step's other
temporaries are held back from B by ``compiler/solve_memory.py``. Without the gradient terms memory is separable
over groups, so Σ m_c min_i mem[c,i] is a lower bound on any plan; a budget below it is reported before solving.

Determinism: fixed seed, fixed worker count, candidates and edges in graph order.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch.fx as fx
from ortools.sat.python import cp_model

from autoshard.cluster.profile import ClusterProfile
from autoshard.errors import InfeasibleBudget, InputError, SolverTimeout
from autoshard.ir import Group, GroupStrategy
from autoshard.notation import format_bytes, placements_str
from autoshard.solver.pricing import price_choices
from autoshard.solver.proto_text import boolean, equal, exactly_one, load, minimize, zero

log = logging.getLogger(__name__)

NS = 1e9
RELATIVE_GAP = 1e-6  # a solve stops within this fraction of its proven bound
EXACT_WAITS = 0.25  # the share of the budget gradients waiting for their reduce-scatter may hold, above which the
# memory row counts them on their edges (``IntraOpProblem._exact_waits``)


@dataclass(frozen=True)
class Solution:
    choice: dict[int, int]  # group id -> strategy index
    status: str
    objective_s: float
    bound_s: float
    wall_s: float
    variables: int
    memory_bytes: int
    # of the step's temporaries, the bytes the program's memory row also counted (gradients waiting whole for their
    # bucket's reduce-scatter): ``compiler/solve_memory.py`` holds back the rest
    waiting_bytes: int = 0


class IntraOpProblem:
    """The integer program of one captured graph, built once and solved under different side conditions.

    ``solve`` may be called several times (the solved plan, then each manual recipe as the same program with
    parameter and input layouts pinned); ``evaluate`` prices any complete choice exactly as the objective does,
    which is how a recipe's predicted time and the "never worse than the best recipe" check are computed.
    ``weights`` scales a group's costs (a captured layer standing in for several identical uncaptured ones).
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        groups: Sequence[Group],
        strategies: dict[int, list[GroupStrategy]],
        canon: dict[int, int],
        output_roles: Sequence,
        mesh_shape: tuple[int, ...],
        cluster: ClusterProfile,
        weights: dict[int, float] | None = None,
        grad_itemsize: int | None = None,
    ) -> None:
        t0 = time.perf_counter()
        self.groups = list(groups)
        self.strategies = strategies
        self.canon = canon
        self.mesh_shape = mesh_shape
        prices = price_choices(gm, groups, strategies, canon, output_roles, mesh_shape, cluster, weights, grad_itemsize)
        self.canon_ids = prices.canon_ids
        self.unary, self.pair_costs, self.pair_waits = prices.unary, prices.pair_costs, prices.pair_waits
        self.unary_waits, self.mem = prices.unary_waits, prices.mem
        self.variables = 0
        self.rounding_ns = 0.0
        self._models: dict[frozenset | None, tuple] = {}
        self._lock = threading.Lock()
        self.build_s = time.perf_counter() - t0

    def _build(
        self, allowed: dict[int, list[int]]
    ) -> tuple[cp_model.CpModel, dict[int, list[int]], float, dict[int, dict[tuple[int, int], int]]]:
        """The CP-SAT model over the allowed candidates only (pinned groups shrink, and their edges collapse to
        unary costs): booleans ``x[c][j]`` for the j-th allowed candidate (their indices in the model), the edges in
        marginal form, the objective's constant (the groups left with one candidate), and each edge's booleans by
        (src layout, dst layout), by its index in ``pair_costs``.
        Written as CpModelProto text and parsed once (``autoshard/solver/proto_text.py``)."""
        unary = {c: [self.unary[c][i] for i in allowed[c]] for c in self.canon_ids}
        variables: list[str] = []
        constraints: list[str] = []
        x: dict[int, list[int]] = {}
        for c in self.canon_ids:
            if len(allowed[c]) > 1:
                x[c] = list(range(len(variables), len(variables) + len(allowed[c])))
                variables.extend(boolean(f"x{c}_{i}") for i in allowed[c])
                constraints.append(exactly_one(x[c]))
        n_edges = 0
        obj_vars: list[int] = []
        obj_coeffs: list[float] = []
        edge_vars: dict[int, dict[tuple[int, int], int]] = {}
        for k, (cu, cv, pu_all, qv_all, R) in enumerate(self.pair_costs):
            pu = [pu_all[i] for i in allowed[cu]]
            qv = [qv_all[j] for j in allowed[cv]]
            P = sorted(set(pu))
            Q = sorted(set(qv))
            if len(P) == 1:
                for j, q in enumerate(qv):
                    unary[cv][j] += R[P[0]][q]
                continue
            if len(Q) == 1:
                for i, p in enumerate(pu):
                    unary[cu][i] += R[p][Q[0]]
                continue
            first = len(variables)
            e = {(p, q): first + n for n, (p, q) in enumerate((p, q) for p in P for q in Q)}
            edge_vars[k] = e
            variables.extend([boolean()] * len(e))
            n_edges += 1
            by_p: dict[int, list[int]] = defaultdict(list)
            by_q: dict[int, list[int]] = defaultdict(list)
            for i, a in enumerate(pu):
                by_p[a].append(x[cu][i])
            for j, b in enumerate(qv):
                by_q[b].append(x[cv][j])
            # sum_q e[p, q] - sum of x[u, i] with layout p = 0, and likewise for each q
            for p in P:
                constraints.append(equal([e[p, q] for q in Q], by_p[p]))
            for q in Q:
                constraints.append(equal([e[p, q] for p in P], by_q[q]))
            for (p, q), v in e.items():
                if math.isinf(R[p][q]):
                    constraints.append(zero(v))  # a move the runtime cannot make
                elif R[p][q] > 0:
                    obj_vars.append(v)
                    obj_coeffs.append(R[p][q])
        const = 0.0
        for c in self.canon_ids:
            if c in x:
                for v, u in zip(x[c], unary[c]):
                    if math.isinf(u):
                        constraints.append(zero(v))
                    elif u > 0:
                        obj_vars.append(v)
                        obj_coeffs.append(u)
            else:
                const += unary[c][0]
        if math.isinf(const):
            raise InputError(self._impossible_message(allowed))
        model = cp_model.CpModel()
        load(model, "\n".join([*variables, *constraints, minimize(obj_vars, (int(round(w * NS)) for w in obj_coeffs))]))
        self.variables = max(self.variables, len(variables))
        # each chosen term is rounded to a nanosecond: a gap below half a nanosecond per group and edge is rounding,
        # not a better plan (the 70B's stage solves found their optimum in 0.3 s and spent 2 s closing an 8 ns gap)
        self.rounding_ns = 0.5 * (len(x) + n_edges)
        return model, x, const, edge_vars

    def __getstate__(self) -> dict:
        """Copies and pickles leave the built model and its lock behind (a copy builds its own when it solves)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_models", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _models={}, _lock=threading.Lock())

    def _copy_of(
        self, order: dict[int, list[int]], key: frozenset | None
    ) -> tuple[cp_model.CpModel, dict[int, list], float, float, dict[int, dict[tuple[int, int], int]]]:
        """A copy of the model over the candidates ``order`` lists per group (built on first use of ``key``, under a
        lock: the plan and the recipes solve on a thread pool), its candidate booleans, the objective's constant,
        its rounding (``rounding_ns``) and its edges' booleans by proto index (``_build``)."""
        with self._lock:
            if key not in self._models:
                model, index, const, edges = self._build(order)
                self._models[key] = (model, index, const, self.rounding_ns, edges)
            model, index, const, rounding, edges = self._models[key]
            copy = model.Clone()
        return (
            copy,
            {c: [copy.GetBoolVarFromProtoIndex(i) for i in ids] for c, ids in index.items()},
            const,
            rounding,
            edges,
        )

    def _impossible_message(self, allowed: dict[int, list[int]]) -> str:
        by_id = {g.id: g for g in self.groups}
        for c in self.canon_ids:
            if len(allowed[c]) == 1 and math.isinf(self.unary[c][allowed[c][0]]):
                g = by_id[c]
                s = self.strategies[c][allowed[c][0]]
                return (
                    f"group {g.anchor} has a single allowed layout ({placements_str(s.outputs[0][0])}) whose input or "
                    f"output needs a redistribution DTensor cannot make on mesh {self.mesh_shape}; unpin it or choose "
                    "another recipe"
                )
        return f"the pinned layouts need a redistribution DTensor cannot make on mesh {self.mesh_shape}"

    def min_memory(self) -> float:
        """The least memory per device any choice needs (memory is separable over groups)."""
        return sum(min(v) for v in self.mem.values())

    def evaluate(self, choice: dict[int, int]) -> float:
        """Objective (seconds) of a choice given per canonical group, exactly as the program prices it."""
        total = sum(self.unary[c][choice[c]] for c in self.canon_ids)
        for cu, cv, pu, qv, R in self.pair_costs:
            total += R[pu[choice[cu]]][qv[choice[cv]]]
        return total

    def memory(self, choice: dict[int, int]) -> float:
        return sum(self.mem[c][choice[c]] for c in self.canon_ids)

    def waiting(self, choice: dict[int, int], exact: bool = True) -> float:
        """The bytes of gradients waiting whole for their reduce-scatter that the memory row counts for ``choice``
        (``pair_waits``; not ``exact``: each edge's least for the parameter's layout, ``_exact_waits``)."""
        total = sum(self.unary_waits[c][choice[c]] for c in self.canon_ids)
        for (cu, cv, pu, qv, _), W in zip(self.pair_costs, self.pair_waits):
            if W is not None:
                total += W[pu[choice[cu]]][qv[choice[cv]]] if exact else min(W[p][qv[choice[cv]]] for p in set(pu))
        return total

    def _exact_waits(self, budget: int) -> bool:
        """Whether the memory row prices the waiting gradients on their edges (exact) rather than each at the least
        its parameter's layout implies (``waiting(exact=False)``, on the parameter's own booleans): only where they
        could hold more than ``EXACT_WAITS`` of the budget. The edge terms make budgeted solves of big models much
        slower (Mixtral-8x7B (8, 8) under 80 GB: 2-9 s -> 30 s, cut short), where the gradients that may wait are
        11% of the budget at most, 1% in its plans, and the hold-back of ``compiler/solve_memory.py`` meets them; on a
        small model they can be most of it (GPT on 8 ranks at 600 KiB: 426 KiB), and only the exact terms let the
        program see them."""
        most = sum(max(v) for v in self.unary_waits.values())
        most += sum(max(max(row) for row in W) for W in self.pair_waits if W is not None)
        return most > EXACT_WAITS * budget

    def solve(
        self,
        *,
        memory_budget: int | None,
        time_limit_s: float,
        pins: dict[int, set[int]] | None = None,
        num_workers: int = 1,
        seed: int = 0,
        what: str = "plan",
        exclude: Sequence[dict[int, int]] = (),
        within: Mapping[int, frozenset[int]] | None = None,
    ) -> Solution:
        """Minimize the step time under ``memory_budget``; ``pins`` restricts canonical groups to candidate
        subsets (a manual recipe); ``exclude``: choices ({canonical group: candidate}) the solution must differ
        from in at least one of their groups (the next-best distinct plans, for autotuning). ``within``: candidate
        subsets that contain the pins, shared by several solves (recipes that pin the same ops alike): the model
        over them is built once and copied for each, smaller than the model of every candidate."""
        t0 = time.perf_counter()
        canon_ids = self.canon_ids
        allowed = {c: set(range(len(self.strategies[c]))) for c in canon_ids}
        for c, keep in (pins or {}).items():
            allowed[c] &= set(keep)
            if not allowed[c]:
                raise InputError(f"{what}: group {c} has no candidate left after pinning")
        if memory_budget is not None:
            least = sum(min(self.mem[c][i] for i in allowed[c]) for c in canon_ids)
            kinds = {g.id: g.kind for g in self.groups}
            fixed = sum(min(self.mem[c][i] for i in allowed[c]) for c in canon_ids if kinds.get(c) == "parameter")
            if least > memory_budget:
                raise InfeasibleBudget(
                    f"memory_budget={format_bytes(memory_budget)} per device is below what any {what} needs: the "
                    f"smallest is {format_bytes(int(least))} (parameters, gradients, optimizer state and saved "
                    f"activations all sharded as far as mesh {self.mesh_shape} allows). Raise the budget to at "
                    f"least {format_bytes(int(least))}, use more devices, or a smaller batch.",
                    int(least),
                    fixed_bytes=int(fixed),
                )
        single = [c for c in canon_ids if len(allowed[c]) == 1 and math.isinf(self.unary[c][min(allowed[c])])]
        if single:
            raise InputError(self._impossible_message({c: sorted(allowed[c]) for c in canon_ids}))
        # one model of every candidate (or of ``within``'s), built once (the Python half of a solve); each solve runs
        # on a copy with the candidates its pins leave out fixed to 0
        order = {c: list(range(len(self.strategies[c]))) for c in canon_ids}
        if within:
            order.update({c: sorted(keep) for c, keep in within.items()})
            if any(not allowed[c] <= set(order[c]) for c in canon_ids):
                raise InputError(f"{what}: its pins leave candidates outside the shared model ``within``")
        model, x, const, rounding, edges = self._copy_of(order, frozenset(within.items()) if within else None)
        for c, vs in x.items():
            for i, v in zip(order[c], vs):
                if i not in allowed[c]:
                    model.Add(v == 0)
        for other in exclude:
            same = [x[c][order[c].index(i)] for c, i in other.items() if c in x and i in order[c]]
            model.Add(sum(same) <= len(same) - 1)  # (no free group in it: infeasible, no other plan)
        exact = memory_budget is None or self._exact_waits(memory_budget)  # (how the row counts waiting gradients)
        if memory_budget is not None:
            mem = {c: [a + b for a, b in zip(self.mem[c], self.unary_waits[c])] for c in canon_ids}
            edge_terms: list[tuple[int, float]] = []
            for k, W in enumerate(self.pair_waits):  # the waiting gradients, on their edges' booleans
                if W is None:
                    continue
                cu, cv, pu, qv, _ = self.pair_costs[k]
                if not exact:  # the least the parameter's layout implies, on its own booleans
                    mem[cv] = [a + min(W[p][qv[j]] for p in set(pu)) for j, a in enumerate(mem[cv])]
                elif k in edges:
                    edge_terms += [(idx, W[p][q]) for (p, q), idx in edges[k].items() if W[p][q] > 0]
                elif len({pu[i] for i in order[cu]}) == 1:  # collapsed onto the consumer's side (as ``_build``)
                    p = pu[order[cu][0]]
                    mem[cv] = [a + W[p][qv[j]] for j, a in enumerate(mem[cv])]
                else:
                    q = qv[order[cv][0]]
                    mem[cu] = [a + W[pu[i]][q] for i, a in enumerate(mem[cu])]
            fixed = sum(mem[c][order[c][0]] for c in canon_ids if c not in x)
            # bytes in units of about a millionth of the budget, each group's rounded up: the solver's count never
            # under-counts (a 600 KiB budget counted in KiB lost up to a KiB per group, ~15% of it on a small model)
            unit = 2 ** max(0, int(memory_budget).bit_length() - 21)
            terms = [(v, -int(-mem[c][i] // unit)) for c in x for i, v in zip(order[c], x[c]) if i in allowed[c]]
            terms += [(model.GetBoolVarFromProtoIndex(idx), -int(-w // unit)) for idx, w in edge_terms]
            model.Add(
                cp_model.LinearExpr.weighted_sum([v for v, _ in terms], [w for _, w in terms])
                <= int((memory_budget - fixed) // unit)
            )
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = float(time_limit_s)
        solver.parameters.num_workers = max(1, int(num_workers))
        solver.parameters.random_seed = int(seed)
        solver.parameters.absolute_gap_limit = max(1.0, rounding)
        # a millionth of the step (microseconds on a step of seconds, far below what the cost model resolves): the
        # first solution is usually that close to the LP bound, and proving the last nanoseconds took 1.5 s of 1.8
        # on Llama-3-70B's recipes on (16, 8, 8). The solve pass keeps a recipe that still beats the plan.
        solver.parameters.relative_gap_limit = RELATIVE_GAP
        solver.parameters.linearization_level = 2
        # presolve costs 3-10x the search on these models (Mixtral (8, 8): 8.3 s of 8.4 s) and proves nothing the
        # LP relaxation of the edge marginals does not: every zoo plan, recipe and budgeted round of
        # benchmarks/plan_time.py reached the same optimum without it
        solver.parameters.cp_model_presolve = False
        solver.parameters.cp_model_probing_level = 0
        # the edge marginals are the LP relaxation that proves these models optimal at the first solution: load
        # them all up front instead of as violated cuts (Llama-3-8B on (8, 8): 2.1 s -> 0.3 s per solve)
        solver.parameters.add_lp_constraints_lazily = False
        # clause vivification between restarts re-walked the search tree: 3.1 s of Mixtral (8, 8)'s 3.6 s plan solve
        # (43k of its 58k decisions), for no clause it learned (the search has no conflicts on these models)
        solver.parameters.use_sat_inprocessing = False
        # the symmetry finder ran on every solve's load (0.05-0.08 s of a 0.35 s recipe solve) and the search, which
        # has no conflicts to learn from, never used what it found
        solver.parameters.symmetry_level = 0
        solver.parameters.log_search_progress = os.environ.get("AUTOSHARD_SOLVER_LOG", "") == "1"
        status = solver.Solve(model)
        name = solver.StatusName(status)
        if status == cp_model.INFEASIBLE and memory_budget is None:
            raise InputError(self._impossible_message({c: sorted(allowed[c]) for c in canon_ids}))
        if status == cp_model.INFEASIBLE:
            raise InfeasibleBudget(f"no {what} fits memory_budget={format_bytes(memory_budget)} (proven by the solver)")
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            raise SolverTimeout(
                f"the solver found no {what} ({name}) within {time_limit_s} s"
                + (f" under memory_budget={format_bytes(memory_budget)}" if memory_budget else "")
                + "; raise time_limit_s (or the budget)"
            )
        choice_c = {
            c: (next(i for i, v in zip(order[c], x[c]) if solver.Value(v)) if c in x else order[c][0])
            for c in canon_ids
        }
        objective = solver.ObjectiveValue() / NS + const
        bound = min(solver.BestObjectiveBound() / NS + const, objective)
        wall = time.perf_counter() - t0
        n_vars = len(model.Proto().variables)
        log.info(
            "solve %s: %s objective %.6f s bound %.6f s, %d variables, %.2f s",
            what,
            name,
            objective,
            bound,
            n_vars,
            wall,
        )
        choice = {g.id: choice_c[self.canon[g.id]] for g in self.groups}
        return Solution(
            choice,
            name,
            objective,
            bound,
            wall + self.build_s,
            n_vars,
            int(self.memory(choice_c)),
            int(self.waiting(choice_c, exact)),
        )
