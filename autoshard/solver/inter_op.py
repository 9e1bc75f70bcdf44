"""The inter-op stage program: split a model's layer sequence into pipeline stages (Alpa's inter-op DP).

Setting. The model is a sequence of pieces: a head piece (everything before the repeated layers: embeddings),
``L`` layers, and a tail piece (final norm, output projection, loss). Each piece has, for one sub-mesh shape
and one micro-batch size, a ``PieceCost`` taken from the intra-op plan of that piece on that sub-mesh
(``autoshard.pipeline.costs``): the time of one micro-batch's forward + backward (and the forward part of it),
the once-per-step work (gradient reduction that is not hidden, which runs once after all micro-batches), the
training-state bytes per device, the activation bytes one in-flight micro-batch keeps per device and the bytes
of the piece's input activation.

Every stage gets a sub-mesh of the same shape (the cluster is ``pp`` copies of it: Megatron's layout, and what a
``pp`` mesh axis over ``torch.distributed.pipelining`` runs). A stage holds a contiguous range of layers; the
first stage also holds the head piece, the last one the tail piece.

Schedules (``B`` micro-batches, ``S`` stages, stage times ``t_i`` per micro-batch, ``v`` chunks per rank):

- ``GPipe``:           T = sum_i t_i + (B - 1) max_i t_i;   stage i keeps B micro-batches in flight
- ``1F1B``:            same T;                              stage i keeps min(B, S - i)
- ``Interleaved1F1B``: T = B max_i t_i + (S - 1) max_i t_i / v  (the warm-up/drain bubble shrinks by v; needs
                       B a multiple of S); rank i keeps min(B, S - i) + (S - 1) / v micro-batches (the extra
                       chunks in flight, Narayanan et al. 2021 section 2.2.2)
- ``InterleavedZeroBubble``: the interleaved schedule with backward split into input- and weight-gradient
                       parts that fill the bubble: T = B max_i t_i + (S - 1) max_i t_i / (3 v)
                       (ZB-H1's bubble is about a third of 1F1B's, Qi et al. 2024); memory as interleaved.

plus, for all, the slowest stage's once-per-step work, and in each rank's time per micro-batch the
point-to-point sends of its boundary activations (forward) and their gradients (backward): 2 sends per chunk
it holds (2 v for an interleaved rank, whose micro-batch crosses v stage boundaries on it), not overlapped.

Activation recomputation (``recompute=True``; Megatron-LM's "full" recomputation, Narayanan et al. SC21 3.5):
each layer keeps only its input (``PieceCost.input_bytes``) for each in-flight micro-batch, and runs its forward
again right before its backward, so a layer's time per micro-batch grows by its forward (``fwd_s``, compute and
the forward collectives). While one layer runs backward its whole activation set exists again, once: a rank's
memory is ``state + in_flight x (sum of its layers' inputs + head/tail activations) + max_layer act_bytes``.
The head and tail pieces are not recomputed (Megatron checkpoints the transformer layers only).

The DP. For a fixed S, B and schedule, T grows with sum t_i (fixed: every layer runs somewhere) and max t_i, so
the best split minimizes the largest stage time subject to every stage's memory: f[s][j] = the smallest
possible max stage time of the first s stages holding the first j layers, over the last stage's start i, in numpy
over all (i, j) at once (O(S L^2), exact for any per-layer costs). A second pass keeps, among the splits with that
max, the most balanced one (the fastest stage slowest). Interleaved ranks hold several pieces and T depends on
the ranks' sums, so the DP over ranks (each rank's layers then dealt into its chunks) is weighed too.
``even_split`` instead cuts the layers into equal runs (Megatron's layout: it needs L divisible by S x v).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.errors import InputError

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")
SPLIT_BACKWARD = ("InterleavedZeroBubble",)  # backward split into input- and weight-gradient parts


@dataclass(frozen=True)
class PieceCost:
    """One piece (a layer, or the head/tail piece) on one sub-mesh at one micro-batch size, per device."""

    time_s: float  # forward + backward of one micro-batch (compute + activation communication)
    step_s: float = 0.0  # once per step: gradient reductions and other per-step communication not hidden
    state_bytes: int = 0  # parameters + gradients + optimizer state
    act_bytes: int = 0  # activations saved for backward by one micro-batch
    fwd_s: float = 0.0  # the forward share of time_s: what recomputation runs a second time
    input_bytes: int = 0  # the piece's input activation of one micro-batch: all recomputation keeps

    def __add__(self, other: PieceCost) -> PieceCost:
        return PieceCost(
            self.time_s + other.time_s,
            self.step_s + other.step_s,
            self.state_bytes + other.state_bytes,
            self.act_bytes + other.act_bytes,
            self.fwd_s + other.fwd_s,
            self.input_bytes + other.input_bytes,
        )


ZERO = PieceCost(0.0)


@dataclass(frozen=True)
class StageSplit:
    """A solved pipeline: layer ranges per stage, schedule, micro-batches and the predicted step."""

    layers: tuple[tuple[int, int], ...]  # [start, stop) of the layer sequence, per piece (chunk k on rank k % S)
    schedule: str
    microbatches: int
    chunks: int  # model chunks per rank (interleaved schedules), 1 otherwise
    stage_time_s: tuple[float, ...]  # per micro-batch, per stage (recomputation and boundary sends included)
    stage_memory_bytes: tuple[int, ...]  # state + in-flight activations, per device of each stage
    step_time_s: float
    bubble_fraction: float  # idle share of the step on the busiest stage
    recompute: bool = False  # every layer's forward runs again in backward; layers keep only their inputs

    @property
    def stages(self) -> int:
        return len(self.stage_time_s)


@dataclass(frozen=True)
class _Piece:
    """Layers [i, j) (plus head/tail) as one pipeline piece, with recomputation applied when asked."""

    time_s: float
    step_s: float
    state_bytes: int
    kept_bytes: int  # per in-flight micro-batch
    work_bytes: int  # once: the activations of the layer being recomputed


def in_flight(schedule: str, stage: int, stages: int, microbatches: int, chunks: int) -> float:
    """Micro-batches whose activations a stage keeps at its peak under ``schedule``."""
    if schedule == "GPipe":
        return float(microbatches)
    base = float(min(microbatches, stages - stage))
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return base + (stages - 1) / chunks
    if schedule == "1F1B":
        return base
    raise InputError(f"schedule {schedule!r} is not known; use one of {SCHEDULES}")


def pipeline_time(schedule: str, times: Sequence[float], microbatches: int, chunks: int) -> tuple[float, float]:
    """(step time of the micro-batch loop, bubble fraction) for per-micro-batch stage ``times``."""
    s, b, worst = len(times), microbatches, max(times)
    if schedule in ("GPipe", "1F1B"):
        total = sum(times) + (b - 1) * worst
    elif schedule == "Interleaved1F1B":
        total = b * worst + (s - 1) * worst / chunks
    elif schedule == "InterleavedZeroBubble":
        total = b * worst + (s - 1) * worst / (3 * chunks)
    else:
        raise InputError(f"schedule {schedule!r} is not known; use one of {SCHEDULES}")
    return total, (total - b * worst) / total if total else 0.0


def check_schedule(schedule: str, stages: int, microbatches: int, chunks: int) -> str | None:
    """Why ``schedule`` cannot run this configuration (None when it can): torch.distributed.pipelining's
    rules: at least as many micro-batches as stages for the 1F1B family, interleaving needs 2+ chunks per rank
    and a micro-batch count that is a multiple of the stages."""
    if schedule not in SCHEDULES:
        return f"schedule {schedule!r} is not known; use one of {SCHEDULES}"
    if schedule == "GPipe":
        return None if chunks == 1 else "GPipe runs one chunk per rank"
    if microbatches < stages:
        return f"{schedule} needs at least as many micro-batches as stages ({microbatches} < {stages})"
    if schedule == "1F1B":
        return None if chunks == 1 else "1F1B runs one chunk per rank"
    if chunks < 2:
        return f"{schedule} needs at least 2 model chunks per rank"
    if microbatches % stages:
        return f"{schedule} needs micro-batches ({microbatches}) to be a multiple of the stages ({stages})"
    return None


class _Costs:
    """Prefix sums over the layers: any [i, j) in O(1) (``piece``), and every [i, j) at once as (n + 1) x (n + 1)
    matrices for the DP (``matrices``); recomputation's working set is a range max."""

    def __init__(self, layers: Sequence[PieceCost], head: PieceCost, tail: PieceCost, recompute: bool) -> None:
        self.head, self.tail, self.recompute, self.n = head, tail, recompute, len(layers)
        self.sums = [(0.0, 0.0, 0, 0)]
        for c in layers:
            t, st, state, kept = self.sums[-1]
            self.sums.append(
                (
                    t + c.time_s + (c.fwd_s if recompute else 0.0),
                    st + c.step_s,
                    state + c.state_bytes,
                    kept + (c.input_bytes if recompute else c.act_bytes),
                )
            )
        self.acts = [c.act_bytes for c in layers]
        cols = np.array(self.sums, dtype=float)
        self._time, self._state, self._kept = (cols[None, :, q] - cols[:, None, q] for q in (0, 2, 3))
        self._work = np.zeros((self.n + 1, self.n + 1))
        if recompute:
            acts = np.array(self.acts, dtype=float)
            for i in range(self.n):
                self._work[i, i + 1 :] = np.maximum.accumulate(acts[i:])
        idx = np.arange(self.n + 1)
        self._length = idx[None, :] - idx[:, None]
        self.cuts: dict[tuple, list[list[tuple[int, int]]]] = {}  # _cut's results by memory rule

    def piece(self, i: int, j: int, k: int, last: int) -> _Piece:
        """Layers [i, j) as the k-th piece (the first holds the head, the ``last``-th the tail)."""
        a, b = self.sums[i], self.sums[j]
        p = [b[0] - a[0], b[1] - a[1], b[2] - a[2], b[3] - a[3]]
        for c, on in ((self.head, k == 0), (self.tail, k == last)):
            if on:  # head and tail keep their activations: recomputation covers the repeated layers only
                p = [p[0] + c.time_s, p[1] + c.step_s, p[2] + c.state_bytes, p[3] + c.act_bytes]
        return _Piece(p[0], p[1], p[2], p[3], max(self.acts[i:j]) if self.recompute and i < j else 0)

    def matrices(self, k: int, last: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(time, state, kept, work) of every [i, j) as the k-th piece, as ``piece`` computes them."""
        time, state, kept = self._time, self._state, self._kept
        for c, on in ((self.head, k == 0), (self.tail, k == last)):
            if on:
                time, state, kept = time + c.time_s, state + c.state_bytes, kept + c.act_bytes
        return time, state, kept, self._work


def _assemble(
    costs: _Costs,
    bounds: Sequence[tuple[int, int]],
    stages: int,
    microbatches: int,
    schedule: str,
    chunks: int,
    memory_budget: int | None,
    p2p_s: float,
) -> StageSplit | None:
    """The StageSplit of pieces ``bounds`` (piece k on rank k % stages); None when a rank exceeds the budget."""
    pieces = [costs.piece(i, j, k, len(bounds) - 1) for k, (i, j) in enumerate(bounds)]
    times, memory, once = [], [], []
    for r in range(stages):
        mine = pieces[r::stages]
        sends = 2 * len(mine) * p2p_s if stages > 1 else 0.0
        times.append(sum(p.time_s for p in mine) + sends)
        flight = in_flight(schedule, r, stages, microbatches, chunks)
        memory.append(
            int(
                sum(p.state_bytes for p in mine)
                + flight * sum(p.kept_bytes for p in mine)
                + max(p.work_bytes for p in mine)
            )
        )
        once.append(sum(p.step_s for p in mine))
    if memory_budget is not None and max(memory) > memory_budget:
        return None
    loop, bubble = pipeline_time(schedule, times, microbatches, chunks)
    return StageSplit(
        tuple(bounds),
        schedule,
        microbatches,
        chunks,
        tuple(times),
        tuple(memory),
        loop + max(once),
        bubble,
        costs.recompute,
    )


def _cut(
    costs: _Costs, pieces: int, flight: Callable[[int], float], scale: int, budget: int | None, min_len: int = 1
) -> list[list[tuple[int, int]]]:
    """Contiguous cuts of the layers into ``pieces`` runs of at least ``min_len`` layers, run k fitting where
    ``scale`` x (state + flight(k) x kept) + work <= ``budget``, whose slowest run is fastest: the first found (each
    run starting as early as it can) and the most balanced (the fastest run slowest). Two O(pieces n^2) passes over
    (n + 1)^2 matrices, remembered per memory rule; empty when no cut fits."""
    n = costs.n
    flights = tuple(flight(k) for k in range(pieces)) if budget is not None else None
    memo = (pieces, min_len, scale, budget, flights)
    if memo in costs.cuts:
        return costs.cuts[memo]
    times, masks = [], []
    for k in range(pieces):
        time, state, kept, work = costs.matrices(k, pieces - 1)
        ok = costs._length >= min_len
        times.append(time)
        masks.append(ok if flights is None else ok & (scale * (state + flights[k] * kept) + work <= budget))
    f = np.full(n + 1, np.inf)
    f[0] = 0.0
    first = []
    for t, m in zip(times, masks):  # f[j]: the smallest slowest run of the first k runs covering [0, j)
        val = np.where(m, np.maximum(f[:, None], t), np.inf)
        first.append(val.argmin(axis=0))
        f = val.min(axis=0)
    out: list[list[tuple[int, int]]] = []
    if np.isfinite(f[n]):
        limit = f[n] + abs(f[n]) * 1e-12
        g = np.full(n + 1, -np.inf)
        g[0] = np.inf
        balanced = []
        for t, m in zip(times, masks):  # g[j]: the largest fastest run, no run slower than the limit
            val = np.where(m & (t <= limit), np.minimum(g[:, None], t), -np.inf)
            balanced.append(val.argmax(axis=0))
            g = val.max(axis=0)
        for back in (first, balanced):
            bounds, j = [], n
            for k in range(pieces - 1, -1, -1):
                i = int(back[k][j])
                bounds.append((i, j))
                j = i
            out.append(bounds[::-1])
    costs.cuts[memo] = out
    return out


def _interleaved_by_rank(
    costs: _Costs, stages: int, microbatches: int, schedule: str, chunks: int, memory_budget: int | None
) -> list[tuple[int, int]] | None:
    """Interleaved pieces balanced by rank: a rank's time is the sum over its chunks, so the layers are first cut
    into ``stages`` contiguous runs as balanced as the DP makes them (head on the first, tail on the last), and each
    rank's share of layers is then dealt into its ``chunks`` pieces (piece c * stages + r is rank r's chunk c)."""
    flight = lambda r: in_flight(schedule, r, stages, microbatches, chunks)  # noqa: E731
    cuts = _cut(costs, stages, flight, 1, memory_budget, min_len=chunks)
    if not cuts:
        return None
    runs = cuts[-1]
    sizes = [[(j - i) // chunks + (c < (j - i) % chunks) for c in range(chunks)] for i, j in runs]
    bounds, at = [], 0
    for c in range(chunks):
        for r in range(stages):
            bounds.append((at, at + sizes[r][c]))
            at += sizes[r][c]
    return bounds


def _split(
    costs: _Costs, stages: int, microbatches: int, schedule: str, chunks: int, memory_budget: int | None, p2p_s: float
) -> StageSplit | None:
    n_pieces = stages * chunks
    if costs.n < n_pieces:
        return None

    flight = lambda k: in_flight(schedule, k % stages, stages, microbatches, chunks)  # noqa: E731
    # a rank's memory is the sum over its chunks; with balanced chunks, chunks x this piece
    found = []
    by_rank = _interleaved_by_rank(costs, stages, microbatches, schedule, chunks, memory_budget) if chunks > 1 else None
    for bounds in [*_cut(costs, n_pieces, flight, chunks, memory_budget), by_rank]:
        # None when balanced chunks passed the per-piece check but a rank's sum over its chunks does not fit
        s = (
            None
            if bounds is None
            else _assemble(costs, bounds, stages, microbatches, schedule, chunks, memory_budget, p2p_s)
        )
        if s is not None:
            found.append(s)

    # the faster, then the more balanced (slowest / fastest rank)
    def key(s: StageSplit) -> tuple:
        return (s.step_time_s, max(s.stage_time_s) / max(min(s.stage_time_s), 1e-300))

    return min(found, key=key) if found else None


def split_layers(
    layers: Sequence[PieceCost],
    head: PieceCost,
    tail: PieceCost,
    stages: int,
    microbatches: int,
    schedule: str = "1F1B",
    chunks: int = 1,
    memory_budget: int | None = None,
    p2p_s: float = 0.0,
    recompute: bool = False,
) -> StageSplit | None:
    """The best contiguous split of ``layers`` into ``stages`` ranks (None when no split fits the budget): the
    slowest stage as fast as it can be, and among such splits the most balanced (the fastest stage slowest).

    With ``chunks`` > 1 (interleaved) the layers are cut into ``stages * chunks`` pieces and rank r holds pieces
    r, r + S, ...; a rank's time and memory are the sums over its chunks. Two layouts are weighed: the DP over the
    pieces (balanced pieces) and the DP over the ranks with each rank's layers dealt into its chunks (balanced
    ranks, what the schedule's time depends on). ``p2p_s`` is the time of one boundary send (activation or its
    gradient).
    """
    why = check_schedule(schedule, stages, microbatches, chunks)
    if why:
        raise InputError(why)
    return _split(_Costs(layers, head, tail, recompute), stages, microbatches, schedule, chunks, memory_budget, p2p_s)


def even_bounds(n: int, pieces: int) -> list[tuple[int, int]]:
    """``n`` layers in ``pieces`` contiguous runs of equal length; when ``pieces`` does not divide ``n`` the
    first ``n % pieces`` runs take one layer more."""
    if not 1 <= pieces <= n:
        raise InputError(f"cannot cut {n} layers into {pieces} non-empty pieces")
    q, r = divmod(n, pieces)
    return [(k * q + min(k, r), (k + 1) * q + min(k + 1, r)) for k in range(pieces)]


def even_split(
    layers: Sequence[PieceCost],
    head: PieceCost,
    tail: PieceCost,
    stages: int,
    microbatches: int,
    schedule: str = "1F1B",
    chunks: int = 1,
    memory_budget: int | None = None,
    p2p_s: float = 0.0,
    recompute: bool = False,
) -> StageSplit | None:
    """Megatron-LM's split: every piece (of ``stages * chunks``) gets the same number of layers, the head on the
    first and the tail on the last, whatever they cost (None when a rank exceeds ``memory_budget``)."""
    why = check_schedule(schedule, stages, microbatches, chunks)
    if why:
        raise InputError(why)
    if len(layers) < stages * chunks:
        return None
    costs = _Costs(layers, head, tail, recompute)
    bounds = even_bounds(len(layers), stages * chunks)
    return _assemble(costs, bounds, stages, microbatches, schedule, chunks, memory_budget, p2p_s)


def best_split(
    layers: Sequence[PieceCost],
    head: PieceCost,
    tail: PieceCost,
    stages: int,
    microbatches: int,
    memory_budget: int | None = None,
    p2p_s: float = 0.0,
    schedules: Sequence[str] = SCHEDULES,
    max_chunks: int = 4,
    recompute: bool | None = False,
    even: bool = False,
) -> StageSplit | None:
    """The fastest split over the schedules that can run (and chunk counts for interleaved ones).

    ``recompute``: False or True fixes it; None tries both and keeps recomputation only where it is faster (where
    only a recomputing split fits, or fits balanced). ``even``: Megatron's equal split (:func:`even_split`,
    interleaving only when the chunks divide the layers evenly) instead of the DP. Candidates are tried from the
    lowest bound up (every rank an equal share of the work), until a bound exceeds the best split found."""
    costs = [_Costs(layers, head, tail, rc) for rc in ((False, True) if recompute is None else (bool(recompute),))]
    n = len(layers)
    tried = []
    for schedule in schedules:
        chunk_options = range(2, max_chunks + 1) if schedule.startswith("Interleaved") else (1,)
        for chunks in chunk_options:
            if check_schedule(schedule, stages, microbatches, chunks) or n < stages * chunks:
                continue
            if even and chunks > 1 and n % (stages * chunks):
                continue
            for c in costs:
                # no split beats every rank holding an equal share of the work (its sends included)
                share = (c.sums[-1][0] + c.head.time_s + c.tail.time_s) / stages + (
                    2 * chunks * p2p_s if stages > 1 else 0.0
                )
                bound = (
                    pipeline_time(schedule, [share] * stages, microbatches, chunks)[0]
                    + (c.sums[-1][1] + c.head.step_s + c.tail.step_s) / stages
                )
                tried.append((bound, len(tried), schedule, chunks, c))
    found: list[StageSplit] = []
    for bound, _, schedule, chunks, c in sorted(tried, key=lambda t: t[:2]):
        if found and bound > min(x.step_time_s for x in found) * (1 + 1e-9):
            break
        s = (
            _assemble(c, even_bounds(n, stages * chunks), stages, microbatches, schedule, chunks, memory_budget, p2p_s)
            if even
            else _split(c, stages, microbatches, schedule, chunks, memory_budget, p2p_s)
        )
        if s is not None:
            found.append(s)

    def key(s: StageSplit) -> tuple:
        return (s.step_time_s, s.recompute, SCHEDULES.index(s.schedule), s.chunks)

    return min(found, key=key) if found else None


__all__ = [
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "PieceCost",
    "StageSplit",
    "best_split",
    "check_schedule",
    "even_bounds",
    "even_split",
    "in_flight",
    "pipeline_time",
    "split_layers",
]
