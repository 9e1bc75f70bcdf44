"""torchtitan's published Llama-3.1-8B rows, priced: how close the cost model comes, and how far the plan gets.

    python benchmarks/torchtitan_table.py        # two rows, about a minute on 2 cores

torchtitan's docs/performance.md (Tables 1 and 3; nobody here measured them): FSDP + torch.compile in bf16
(parameters in bf16 for compute, gradients reduced in fp32), sequence 8192, local batch 2, selective activation
checkpointing, on H100s of Meta's Grand Teton hosts. The cluster profile is the ``h100-96gb-500w`` preset
(``autoshard/cluster/presets.py`` lists what it assumes: 95 GiB, 2.4 TB/s HBM2e, NVLink inside a host and 400 Gb/s
RDMA per GPU between hosts; the 500 W power cap is not modelled).

1. Fidelity: the ``fsdp`` recipe recomputing every layer selectively (autoshard's selective mode saves every
   matmul's and attention's output and replays the rest; torchtitan's op-level policy also replays every second
   matmul, so it holds less) against the published tokens/s per GPU and memory. Goals: throughput within
   0.9-1.1 and memory within 10%.
2. Ahead of the peer: the solved plan under the machine's memory (95 GiB), its predicted tokens/s per GPU
   against the published figure. Goal: >= 1.10x where memory binds. Beside it, what bounds any plan: the
   tokens/s of the plan without a memory budget (nothing recomputed: the compute floor of the layouts) and the
   solver's bound on the budgeted plan.

Predictions of the cost model, not measurements.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import autoshard
from autoshard.notation import describe

GIB = 2**30


@dataclass(frozen=True)
class Published:
    table: str
    nodes: int
    tokens_per_gpu_s: float
    memory_gib: float
    local_batch: int = 2
    seq: int = 8192

    @property
    def gpus(self) -> int:
        return self.nodes * 8

    @property
    def cluster(self) -> str:
        return f"h100-96gb-500w:{self.nodes}x8"


ROWS = (
    Published("Table 1: 8 GPUs", 1, 6667, 77.0),
    Published("Table 3: 128 GPUs", 16, 6514, 62.0),
)


def _tps(plan: autoshard.Plan, row: Published) -> float:
    return row.local_batch * row.gpus * row.seq / plan.step_time_s / row.gpus


def run(rows: tuple[Published, ...]) -> None:
    common = dict(seq=8192, mixed_precision="bf16")
    print("fidelity: the fsdp recipe, every layer recomputed selectively, against torchtitan's published rows")
    print(
        f"{'row':<20}{'pred tok/s/GPU':>16}{'published':>11}{'ratio':>7}{'pred GiB':>10}{'published':>11}"
        f"{'ratio':>7}  goal"
    )
    plans = {}
    for r in rows:
        gb = r.local_batch * r.gpus
        p = autoshard.plan(
            "llama3-8b",
            cluster=r.cluster,
            global_batch=gb,
            recipe="fsdp",
            recompute=("layers:selective",),
            memory_budget="none",
            **common,
        )
        plans[r.table] = p
        t, m = _tps(p, r), p.peak_memory.total / GIB
        ok = 0.9 <= t / r.tokens_per_gpu_s <= 1.1 and abs(m / r.memory_gib - 1) <= 0.10
        print(
            f"{r.table:<20}{t:>16,.0f}{r.tokens_per_gpu_s:>11,.0f}{t / r.tokens_per_gpu_s:>7.3f}{m:>10.1f}"
            f"{r.memory_gib:>11.1f}{m / r.memory_gib:>7.3f}  {'met' if ok else 'NOT met'}"
        )
        mem = p.peak_memory
        print(
            f"{'':<20}memory: parameters {mem.parameters / GIB:.1f}, gradients {mem.gradients / GIB:.1f}, optimizer "
            f"{mem.optimizer / GIB:.1f}, activations {mem.activations / GIB:.1f}, temporaries "
            f"{mem.temporaries / GIB:.1f} GiB; step {p.step_time_s:.3f} s (compute {p.stages[0].compute_s:.3f}, "
            f"exposed communication {p.stages[0].comm_s:.3f})"
        )
    print()
    print("the solved plan on the same machine, under its 95 GiB, against the published figure")
    print(f"{'row':<20}{'plan tok/s/GPU':>16}{'x published':>13}{'GiB':>7}{'no budget':>11}{'bound':>9}{'s':>6}  plan")
    for r in rows:
        gb = r.local_batch * r.gpus
        t0 = time.perf_counter()
        p = autoshard.plan("llama3-8b", cluster=r.cluster, global_batch=gb, **common)
        wall = time.perf_counter() - t0
        free = autoshard.plan(
            "llama3-8b", cluster=r.cluster, global_batch=gb, memory_budget="none", solve_recipes=False, **common
        )
        t = _tps(p, r)
        bound = r.local_batch * r.seq / (p.solver.bound_s * p.microbatches) if p.solver.bound_s > 0 else float("nan")
        how = "; ".join(
            x
            for x in (
                describe(p.recompute_layers) and f"recompute {describe(p.recompute_layers)}",
                p.microbatches > 1 and f"{p.microbatches} micro-batches",
            )
            if x
        )
        how = how or "nothing recomputed"
        best = p.best_recipe()
        alone = f"{best.name} {r.local_batch * r.seq / best.step_time_s:,.0f} tok/s/GPU" if best else "none fits"
        print(
            f"{r.table:<20}{t:>16,.0f}{t / r.tokens_per_gpu_s:>12.3f}x{p.peak_memory.total / GIB:>7.1f}"
            f"{_tps(free, r):>11,.0f}{bound:>9,.0f}{wall:>6.1f}  {how}; best recipe alone: {alone}"
        )


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    run(ROWS)


if __name__ == "__main__":
    main()
