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
possible max stage time of the first s stages holding the first j layers, over the last stage's start i. This is
O(S L^2) per (S, B, schedule), exact for any per-layer costs (identical layers are the common case).
``even_split`` instead cuts the layers into equal runs (Megatron's layout: it needs L divisible by S x v).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")


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
        return PieceCost(self.time_s + other.time_s, self.step_s + other.step_s,
                         self.state_bytes + other.state_bytes, self.act_bytes + other.act_bytes,
                         self.fwd_s + other.fwd_s, self.input_bytes + other.input_bytes)


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
    raise ValueError(f"schedule {schedule!r} is not known; use one of {SCHEDULES}")


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
        raise ValueError(f"schedule {schedule!r} is not known; use one of {SCHEDULES}")
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
    """Prefix sums over the layers (and a range max for recomputation's working set): any [i, j) in O(1)."""

    def __init__(self, layers: Sequence[PieceCost], head: PieceCost, tail: PieceCost, n_pieces: int,
                 recompute: bool) -> None:
        self.head, self.tail, self.last, self.recompute = head, tail, n_pieces - 1, recompute
        self.sums = [(0.0, 0.0, 0, 0)]
        for c in layers:
            t, st, state, kept = self.sums[-1]
            self.sums.append((t + c.time_s + (c.fwd_s if recompute else 0.0), st + c.step_s, state + c.state_bytes,
                              kept + (c.input_bytes if recompute else c.act_bytes)))
        self.acts = [c.act_bytes for c in layers]
        self._max: dict[tuple[int, int], int] = {}

    def work(self, i: int, j: int) -> int:
        if not self.recompute or i >= j:
            return 0
        key = (i, j)
        if key not in self._max:
            self._max[key] = max(self.acts[i:j])
        return self._max[key]

    def piece(self, i: int, j: int, k: int) -> _Piece:
        """Layers [i, j) as the k-th piece (the first holds the head, the last the tail)."""
        a, b = self.sums[i], self.sums[j]
        p = [b[0] - a[0], b[1] - a[1], b[2] - a[2], b[3] - a[3]]
        for c, on in ((self.head, k == 0), (self.tail, k == self.last)):
            if on:  # head and tail keep their activations: recomputation covers the repeated layers only
                p = [p[0] + c.time_s, p[1] + c.step_s, p[2] + c.state_bytes, p[3] + c.act_bytes]
        return _Piece(p[0], p[1], p[2], p[3], self.work(i, j))


def _assemble(costs: _Costs, bounds: Sequence[tuple[int, int]], stages: int, microbatches: int, schedule: str,
              chunks: int, memory_budget: int | None, p2p_s: float) -> StageSplit | None:
    """The StageSplit of pieces ``bounds`` (piece k on rank k % stages); None when a rank exceeds the budget."""
    pieces = [costs.piece(i, j, k) for k, (i, j) in enumerate(bounds)]
    times, memory, once = [], [], []
    for r in range(stages):
        mine = pieces[r::stages]
        sends = 2 * len(mine) * p2p_s if stages > 1 else 0.0
        times.append(sum(p.time_s for p in mine) + sends)
        flight = in_flight(schedule, r, stages, microbatches, chunks)
        memory.append(int(sum(p.state_bytes for p in mine) + flight * sum(p.kept_bytes for p in mine)
                          + max(p.work_bytes for p in mine)))
        once.append(sum(p.step_s for p in mine))
    if memory_budget is not None and max(memory) > memory_budget:
        return None
    loop, bubble = pipeline_time(schedule, times, microbatches, chunks)
    return StageSplit(tuple(bounds), schedule, microbatches, chunks, tuple(times), tuple(memory), loop + max(once),
                      bubble, costs.recompute)


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
    """The best contiguous split of ``layers`` into ``stages`` ranks (None when no split fits the budget).

    With ``chunks`` > 1 (interleaved) the layers are cut into ``stages * chunks`` pieces and rank r holds pieces
    r, r + S, ...; the DP then balances the pieces (the standard interleaved layout) and a rank's time and memory
    are the sums over its chunks. ``p2p_s`` is the time of one boundary send (activation or its gradient).
    """
    why = check_schedule(schedule, stages, microbatches, chunks)
    if why:
        raise ValueError(why)
    n_pieces = stages * chunks
    n = len(layers)
    if n < n_pieces:
        return None
    costs = _Costs(layers, head, tail, n_pieces, recompute)

    def fits(p: _Piece, k: int) -> bool:
        if memory_budget is None:
            return True
        # a rank's memory is the sum over its chunks; with balanced chunks, chunks x this piece
        flight = in_flight(schedule, k % stages, stages, microbatches, chunks)
        return chunks * (p.state_bytes + flight * p.kept_bytes) + p.work_bytes <= memory_budget

    inf = math.inf
    # f[k][j]: smallest max piece time for pieces 0..k-1 covering layers [0, j)
    f = [[inf] * (n + 1) for _ in range(n_pieces + 1)]
    arg = [[-1] * (n + 1) for _ in range(n_pieces + 1)]
    f[0][0] = 0.0
    for k in range(1, n_pieces + 1):
        for j in range(k, n - (n_pieces - k) + 1):
            best, at = inf, -1
            for i in range(k - 1, j):
                if f[k - 1][i] == inf:
                    continue
                p = costs.piece(i, j, k - 1)
                if not fits(p, k - 1):
                    continue
                val = max(f[k - 1][i], p.time_s)
                if val < best:
                    best, at = val, i
            f[k][j], arg[k][j] = best, at
    if f[n_pieces][n] == inf:
        return None
    bounds = []
    j = n
    for k in range(n_pieces, 0, -1):
        i = arg[k][j]
        bounds.append((i, j))
        j = i
    bounds.reverse()
    # None when balanced chunks passed the per-piece check but a rank's sum over its chunks does not fit
    return _assemble(costs, bounds, stages, microbatches, schedule, chunks, memory_budget, p2p_s)


def even_bounds(n: int, pieces: int) -> list[tuple[int, int]]:
    """``n`` layers in ``pieces`` contiguous runs of equal length; when ``pieces`` does not divide ``n`` the
    first ``n % pieces`` runs take one layer more."""
    if not 1 <= pieces <= n:
        raise ValueError(f"cannot cut {n} layers into {pieces} non-empty pieces")
    q, r = divmod(n, pieces)
    out, at = [], 0
    for k in range(pieces):
        size = q + (k < r)
        out.append((at, at + size))
        at += size
    return out


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
        raise ValueError(why)
    if len(layers) < stages * chunks:
        return None
    costs = _Costs(layers, head, tail, stages * chunks, recompute)
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

    ``recompute``: False or True fixes it; None tries both and keeps recomputation only where it is faster
    (never, for the same schedule and chunks) or where only it fits. ``even``: Megatron's equal split
    (:func:`even_split`, interleaving only when the chunks divide the layers evenly) instead of the DP."""
    found: list[StageSplit] = []
    choices = (False, True) if recompute is None else (bool(recompute),)
    n = len(layers)
    for schedule in schedules:
        chunk_options = range(2, max_chunks + 1) if schedule.startswith("Interleaved") else (1,)
        for chunks in chunk_options:
            if check_schedule(schedule, stages, microbatches, chunks):
                continue
            if even and chunks > 1 and n % (stages * chunks):
                continue
            for rc in choices:
                fn = even_split if even else split_layers
                s = fn(layers, head, tail, stages, microbatches, schedule, chunks, memory_budget, p2p_s, rc)
                if s is not None:
                    found.append(s)
    key = (lambda s: (s.step_time_s, s.recompute, SCHEDULES.index(s.schedule), s.chunks))
    return min(found, key=key) if found else None


__all__ = ["SCHEDULES", "PieceCost", "StageSplit", "best_split", "check_schedule", "even_bounds", "even_split",
           "in_flight", "pipeline_time", "split_layers"]
