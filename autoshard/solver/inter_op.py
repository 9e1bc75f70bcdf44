"""The inter-op stage program: split a model's layer sequence into pipeline stages (Alpa's inter-op DP).

Setting. The model is a sequence of pieces: a head piece (everything before the repeated layers: embeddings),
``L`` layers, and a tail piece (final norm, output projection, loss). Each piece has, for one sub-mesh shape
and one micro-batch size, a ``PieceCost`` taken from the intra-op plan of that piece on that sub-mesh
(``autoshard.pipeline_costs``): the time of one micro-batch's forward + backward, the once-per-step work
(gradient reduction that is not hidden, which runs once after all micro-batches), the training-state bytes per
device and the activation bytes one in-flight micro-batch keeps per device.

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

plus, for all, the slowest stage's once-per-step work and the point-to-point sends of the boundary activations
(forward) and their gradients (backward), 2 (S - 1) sends on the critical path.

The DP. For a fixed S, B and schedule, T grows with sum t_i (fixed: every layer runs somewhere) and max t_i, so
the best split minimizes the largest stage time subject to every stage's memory: f[s][j] = the smallest
possible max stage time of the first s stages holding the first j layers, over the last stage's start i. This is
O(S L^2) per (S, B, schedule), exact for any per-layer costs (identical layers are the common case).
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

    def __add__(self, other: PieceCost) -> PieceCost:
        return PieceCost(self.time_s + other.time_s, self.step_s + other.step_s,
                         self.state_bytes + other.state_bytes, self.act_bytes + other.act_bytes)


ZERO = PieceCost(0.0)


@dataclass(frozen=True)
class StageSplit:
    """A solved pipeline: layer ranges per stage, schedule, micro-batches and the predicted step."""

    layers: tuple[tuple[int, int], ...]  # [start, stop) of the layer sequence, per stage
    schedule: str
    microbatches: int
    chunks: int  # model chunks per rank (interleaved schedules), 1 otherwise
    stage_time_s: tuple[float, ...]  # per micro-batch, per stage
    stage_memory_bytes: tuple[int, ...]  # state + in-flight activations, per device of each stage
    step_time_s: float
    bubble_fraction: float  # idle share of the step on the busiest stage

    @property
    def stages(self) -> int:
        return len(self.layers)


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
    prefix = [ZERO]
    for c in layers:
        prefix.append(prefix[-1] + c)

    def piece(i: int, j: int, k: int) -> PieceCost:
        """Layers [i, j) as the k-th of the n_pieces pieces."""
        p = PieceCost(prefix[j].time_s - prefix[i].time_s, prefix[j].step_s - prefix[i].step_s,
                      prefix[j].state_bytes - prefix[i].state_bytes, prefix[j].act_bytes - prefix[i].act_bytes)
        if k == 0:
            p = p + head
        if k == n_pieces - 1:
            p = p + tail
        return p

    def fits(p: PieceCost, k: int) -> bool:
        if memory_budget is None:
            return True
        rank = k % stages
        # a rank's memory is the sum over its chunks; with balanced chunks, chunks x this piece
        mem = chunks * (p.state_bytes + in_flight(schedule, rank, stages, microbatches, chunks) * p.act_bytes)
        return mem <= memory_budget

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
                p = piece(i, j, k - 1)
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
    pieces = [piece(i, j, k) for k, (i, j) in enumerate(bounds)]
    per_rank = [ZERO] * stages
    for k, p in enumerate(pieces):
        per_rank[k % stages] = per_rank[k % stages] + p
    times = [r.time_s + (p2p_s * 2 if stages > 1 else 0.0) for r in per_rank]
    memory = [int(c.state_bytes + in_flight(schedule, r, stages, microbatches, chunks) * c.act_bytes)
              for r, c in enumerate(per_rank)]
    if memory_budget is not None and max(memory) > memory_budget:
        return None  # balanced chunks passed the per-piece check, but a rank's sum over its chunks does not fit
    loop, bubble = pipeline_time(schedule, times, microbatches, chunks)
    step = loop + max(r.step_s for r in per_rank)
    return StageSplit(tuple(bounds), schedule, microbatches, chunks, tuple(times), tuple(memory), step, bubble)


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
) -> StageSplit | None:
    """The fastest split over the schedules that can run (and chunk counts for interleaved ones)."""
    found: list[StageSplit] = []
    for schedule in schedules:
        chunk_options = range(2, max_chunks + 1) if schedule.startswith("Interleaved") else (1,)
        for chunks in chunk_options:
            if check_schedule(schedule, stages, microbatches, chunks):
                continue
            s = split_layers(layers, head, tail, stages, microbatches, schedule, chunks, memory_budget, p2p_s)
            if s is not None:
                found.append(s)
    return min(found, key=lambda s: (s.step_time_s, SCHEDULES.index(s.schedule), s.chunks)) if found else None


__all__ = ["SCHEDULES", "PieceCost", "StageSplit", "best_split", "check_schedule", "in_flight", "pipeline_time",
           "split_layers"]
