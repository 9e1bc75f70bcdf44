"""Megatron-LM's GPT weak-scaling table (SC21) against autoshard's pipeline cost model and search, no device.

    python benchmarks/megatron_table.py                 # every row (a few minutes on 2 cores)
    python benchmarks/megatron_table.py --rows 1.7 39.1 # rows whose parameter count (billions) starts so
    python benchmarks/megatron_table.py --quick         # 2 micro-batch sizes walked (faster)
    python benchmarks/megatron_table.py --exhaustive    # the search solves every configuration, estimates none

For each published row: GPT with hidden h, l layers, h / 128 heads, sequence 2048, vocabulary 51200, 16-bit
parameters with fp32 master weights and Adam moments (``optimizer="adamw-mixed"``: 16 bytes per parameter), on
``gpus / 8`` nodes of the ``a100-80gb`` profile with an 80 GiB budget per device, at the published global batch.
The model is built on the meta device, meshes live on fake process groups, and two of the identical layers are
captured and stand for all of them (``sample_layers=2``), so a 1T-parameter model plans in seconds.

(a) "fixed": the published TP / PP (DP = gpus / (TP x PP)) priced by ``evaluate_config``: every stage is a
    ``dp x tp`` sub-mesh planned with Megatron's tensor-parallel layout pinned (``recipe="tp"``), the layers are
    split evenly, every layer recomputes its forward in backward (Megatron's full activation recomputation).
    Micro-batches (stated rule): Megatron ran micro-batch size 1 or 2 with 1F1B or interleaved 1F1B; we take the
    fastest of micro-batch size {1, 2} x {1F1B, interleaved 1F1B with 2-4 chunks that divide the layers evenly}
    that fits. TFLOP/s per GPU = Megatron's model FLOPs per step / predicted step / GPUs, with the FLOPs of
    Narayanan et al. 2021 (eq. 3, recomputation counted): 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)).
(b) "search": ``search_pipeline`` on the same cluster, batch and budget: stage counts (whole nodes per stage),
    micro-batch counts, the free intra-op plan of a stage's sub-mesh, the inter-op DP split, every schedule and
    recomputation only where it fits or is faster. Its TFLOP/s counts the same FLOPs per step (Megatron's count,
    recomputation included, whether or not the plan recomputes), so (b) / (a) is the ratio of step times.

Goals: (a) / published within 0.85-1.15 on every row; (b) / (a) >= 1.00 on every row. All numbers are the cost
model's predictions, not measurements. GPT here has no biases (``bias=False``): Megatron's GPT has them but they
are < 0.01% of its FLOPs, and autoshard's strategies do not yet offer a row-parallel ``addmm`` whose bias joins a
Partial output (the pinned TP recipe then moves the weight instead: ``--bias`` shows it).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass

import torch

from autoshard.cluster.presets import get_cluster
from autoshard.config import PlanConfig
from autoshard.models.gpt import GPT, GPTConfig
from autoshard.pipeline.megatron import evaluate_config, megatron_recipe
from autoshard.pipeline.pricing import PipelineOption
from autoshard.pipeline.search import search_pipeline

# GPT weak scaling, Megatron-LM (Narayanan et al., SC'21), NVIDIA Selene: 8x A100-80GB per node (NVSwitch), 8x HDR
# InfiniBand (200 Gb/s) per node.
# Source: NVIDIA/Megatron-LM README table image images/cases_april2021.png and its text: vocab 51200, sequence 2048,
# mixed precision, FLOPs end-to-end (incl. data loading, optimizer, logging). "model parallel size" = TP*PP; above 8,
# TP=8 and PP=mp/8.
# Attention heads are not in that table; hidden/128 is a reasonable choice for a benchmark. peak = 312 TFLOP/s (A100
# bf16/fp16 dense).
# params_b, hidden, layers, model_parallel, tp, pp, gpus, global_batch, tflops_per_gpu, pct_peak, aggregate_pflops
PUBLISHED = (
    (1.7, 2304, 24, 1, 1, 1, 32, 512, 137, 44, 4.4),
    (3.6, 3072, 30, 2, 2, 1, 64, 512, 138, 44, 8.8),
    (7.5, 4096, 36, 4, 4, 1, 128, 512, 142, 46, 18.2),
    (18.4, 6144, 40, 8, 8, 1, 256, 1024, 135, 43, 34.6),
    (39.1, 8192, 48, 16, 8, 2, 512, 1536, 138, 44, 70.8),
    (76.1, 10240, 60, 32, 8, 4, 1024, 1792, 140, 45, 143.8),
    (145.6, 12288, 80, 64, 8, 8, 1536, 2304, 148, 47, 227.1),
    (310.1, 16384, 96, 128, 8, 16, 1920, 2160, 155, 50, 297.4),
    (529.6, 20480, 105, 280, 8, 35, 2520, 2520, 163, 52, 410.2),
    (1008.0, 25600, 128, 512, 8, 64, 3072, 3072, 163, 52, 502.0),
)

SEQ, VOCAB, HEAD_DIM, GIB = 2048, 51200, 128, 2**30


@dataclass(frozen=True)
class Row:
    params_b: float
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def flops_per_step(self) -> float:
        b, s, n_layers, h, v = self.batch, SEQ, self.layers, self.hidden, VOCAB
        return 96.0 * b * s * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h))


def rows() -> list[Row]:
    return [Row(p, h, layers, tp, pp, g, b, t) for p, h, layers, _, tp, pp, g, b, t, _, _ in PUBLISHED]


def tflops(row: Row, option: PipelineOption) -> float:
    return row.flops_per_step() / option.step_time_s / row.gpus / 1e12 if option.split else 0.0


def published_config(row: Row, model: GPT, inputs: tuple, cluster, config: PlanConfig) -> PipelineOption | None:
    """(a): the published TP/PP/DP, the fastest of micro-batch sizes 1 and 2 (schedules: evaluate_config's)."""
    best = None
    for mbs in (1, 2):
        b = row.batch // (row.dp * mbs)
        if row.batch % (row.dp * mbs) or b < row.pp:
            continue
        o = evaluate_config(
            model, inputs, cluster, config, tp=row.tp, pp=row.pp, dp=row.dp, microbatches=b, recompute=True
        )
        if o.split is not None and (best is None or o.step_time_s < best.step_time_s):
            best = o
    return best


def short_layout(layout: str) -> str:
    """The mesh, the layers' input activation and the attention / MLP weights of the layout summary."""
    keep = ("dp=", "tp=", "act ", "layers.*.attn.wq ", "layers.*.mlp.fc1 ", "layers.*.mlp.fc2 ")
    return "; ".join(p.replace("layers.*.", "") for p in layout.split("; ") if p.startswith(keep))


def describe(o: PipelineOption | None) -> str:
    if o is None or o.split is None:
        return "does not fit"
    s = o.split
    sched = s.schedule + (f" x{s.chunks}" if s.chunks > 1 else "")
    mem = max(s.stage_memory_bytes) / GIB
    return (
        f"PP {o.stages} of {o.submesh}, B={o.microbatches}, {sched}, "
        f"{'recompute' if s.recompute else 'no recompute'}, {mem:.0f} GiB"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="*", default=None, help="rows whose parameter count (billions) starts with these")
    ap.add_argument("--quick", action="store_true", help="walk 2 micro-batch sizes, not 4")
    ap.add_argument(
        "--exhaustive", action="store_true", help="solve every configuration (default: the estimate-guided search)"
    )
    ap.add_argument(
        "--megatron-recipe", action="store_true", help="also price the pp+tp+dp recipe (smallest PP that fits)"
    )
    ap.add_argument("--bias", action="store_true", help="GPT with biases (see the module docstring)")
    ap.add_argument("--no-search", action="store_true", help="only (a), the published configurations")
    ap.add_argument("--microbatch-options", type=int, default=4, help="micro-batch sizes the search walks")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    chosen = [r for r in rows() if not args.rows or any(f"{r.params_b:g}".startswith(p) for p in args.rows)]
    header = (
        "| model | GPUs | batch | published TP/PP/DP | (a) fixed config | published TFLOP/s | (a) TFLOP/s | "
        "(a)/pub | (b) search: stages, layout | (b) schedule | (b) TFLOP/s | (b)/(a) |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    fidelity, gains = [], []
    t_all = time.perf_counter()
    for row in chosen:
        t0 = time.perf_counter()
        cfg = GPTConfig(
            n_layer=row.layers,
            d_model=row.hidden,
            n_head=row.hidden // HEAD_DIM,
            vocab=VOCAB,
            seq_len=SEQ,
            bias=args.bias,
        )
        with torch.device("meta"):
            model = GPT(cfg).to(torch.bfloat16)
        inputs = tuple(torch.empty((row.batch, SEQ), dtype=torch.long, device="meta") for _ in range(2))
        cluster = get_cluster(f"a100-80gb:{row.gpus // 8}x8")
        config = PlanConfig(sample_layers=2, optimizer="adamw-mixed", memory_budget=80 * GIB, solve_recipes=False)
        fixed = published_config(row, model, inputs, cluster, config)
        options = (
            []
            if args.no_search
            else search_pipeline(
                model,
                inputs,
                cluster,
                config,
                microbatch_options=2 if args.quick else args.microbatch_options,
                recompute=None,
                exhaustive=args.exhaustive,
            )
        )
        best = next((o for o in options if o.split is not None and not o.estimated), None)
        a = tflops(row, fixed) if fixed else 0.0
        b = tflops(row, best) if best else 0.0
        fidelity.append(a / row.tflops)
        gains.append(b / a if a else 0.0)
        extra = ""
        if args.megatron_recipe:
            base = megatron_recipe(model, inputs, cluster, config)
            extra = f" [pp+tp+dp: {base.note}, {tflops(row, base):.0f} TFLOP/s]"
        search = (
            f"{describe(best)}; {best.recipe + ' recipe; ' if best.recipe else ''}{short_layout(best.layout)}"
            if best
            else "-"
        )
        sched = f"{best.split.schedule} x{best.split.chunks}" if best and best.split else "-"
        lines.append(
            f"| GPT {row.params_b:g}B (h {row.hidden}, l {row.layers}) | {row.gpus} | {row.batch} | "
            f"{row.tp}/{row.pp}/{row.dp} | {describe(fixed)} | {row.tflops:.0f} | {a:.0f} | {a / row.tflops:.2f} | "
            f"{search}{extra} | {sched} | {b:.0f} | {b / a if a else math.nan:.2f} |"
        )
        print(lines[-1] + f"  <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)
    print()
    print("\n".join(lines))
    print()
    ok_a = sum(0.85 <= f <= 1.15 for f in fidelity)
    ok_b = sum(g >= 1.0 for g in gains)
    print(
        f"(a)/published within +-15%: {ok_a}/{len(fidelity)} rows (range {min(fidelity):.2f}-{max(fidelity):.2f}); "
        f"(b)/(a) >= 1.00: {ok_b}/{len(gains)} rows (range {min(gains):.2f}-{max(gains):.2f}); "
        f"{time.perf_counter() - t_all:.0f} s"
    )


if __name__ == "__main__":
    main()
