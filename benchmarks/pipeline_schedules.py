"""Pipeline schedules measured: the bubble of 1F1B, interleaved 1F1B and interleaved zero-bubble, side by side.

    python benchmarks/pipeline_schedules.py                 # 2 gloo ranks (pp=2), zoo GPT, 8 micro-batches
    python benchmarks/pipeline_schedules.py --quick         # a smaller model, fewer steps (smoke run)

The same model and batch compiled by ``autoshard.compile`` on a ("pp",) mesh of 2 gloo ranks (one thread each),
with each schedule forced (``schedule=``): 1F1B with 2 stages, interleaved 1F1B and interleaved zero-bubble with
2 model chunks per rank (4 stages; the zero-bubble schedule runs each stage's backward in an input part and a
later weight part). For each: the median step after warm-up, and each rank's busy time, the time spent inside
its stage programs (forward, backward, and the zero-bubble schedule's two backward parts), timed around every
call. The measured bubble is ``1 - busy / step`` (the mean of the ranks'): the time a rank waits for its
neighbour, plus the boundary sends. Next to it the plan's predicted bubble (``solver/inter_op.py``). Every row's
first loss is printed: the same on every row (the same model trained on the same batch).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import torch

log = logging.getLogger("pipeline_schedules")

SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble")


def _worker(rank: int, world: int, arg: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import autoshard
    from autoshard.compiler.compile import CompiledProgram
    from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
    from autoshard.testing.bench import time_steps

    torch.set_num_threads(1)
    busy = [0.0]
    for name in ("forward_many", "backward_many", "backward_input", "backward_weight"):
        inner = getattr(CompiledProgram, name)

        def timed(self: Any, *a: Any, _inner: Any = inner, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _inner(self, *a, **k)
            finally:
                busy[0] += time.perf_counter() - t

        setattr(CompiledProgram, name, timed)
    cfg = GPTConfig(**arg["cfg"])
    torch.manual_seed(0)
    model = GPT(cfg)
    inputs = gpt_example_inputs(cfg, arg["batch"])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    sharded = autoshard.compile(
        model, mesh, inputs, schedule=arg["schedule"], microbatches=arg["microbatches"], backend=arg["backend"]
    )
    first = float(sharded.step(*inputs))
    steps: list[float] = []

    def one() -> None:
        b0 = busy[0]
        sharded.step(*inputs)
        steps.append(busy[0] - b0)

    timing = time_steps(one, arg["steps"], arg["warmup"])
    timed_busy = steps[arg["warmup"] :]
    return {
        "step_s": timing.median_s,
        "busy_s": statistics.median(timed_busy),
        "first_loss": first,
        "predicted_bubble": sharded.plan.bubble_fraction,
        "predicted_step_s": sharded.plan.step_time_s,
        "stages": len(sharded.plan.stages),
    }


def main() -> None:
    from autoshard.testing.launch import launch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backend", default="inductor", choices=("eager", "inductor"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = dict(n_layer=8, d_model=256, n_head=4, vocab=256, seq_len=128, bias=False)
    steps, warmup, batch = args.steps, 2, 2 * args.microbatches
    if args.quick:
        cfg.update(n_layer=4, d_model=64, seq_len=32)
        steps, warmup = 2, 1
    print(
        f"# pipeline schedules: zoo GPT {cfg['n_layer']} layers, d {cfg['d_model']}, seq {cfg['seq_len']}, batch "
        f"{batch} in {args.microbatches} micro-batches; 2 gloo ranks (pp=2), 1 thread each, on this machine's "
        f"2 cores; {args.backend}; median of {steps} steps after {warmup} warm-up"
    )
    print(
        "| schedule | stages | step (ms) | busy per rank (ms) | bubble measured | bubble predicted | step vs 1F1B "
        "| first loss |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for schedule in SCHEDULES:
        arg = {
            "cfg": cfg,
            "batch": batch,
            "schedule": schedule,
            "microbatches": args.microbatches,
            "backend": args.backend,
            "steps": steps,
            "warmup": warmup,
        }
        res = launch(2, _worker, arg, timeout=1800)
        step = statistics.mean(r["step_s"] for r in res)
        bubble = statistics.mean(1 - r["busy_s"] / r["step_s"] for r in res)
        busy = statistics.mean(r["busy_s"] for r in res)
        base = base or step
        print(
            f"| {schedule} | {res[0]['stages']} | {step * 1e3:.1f} | {busy * 1e3:.1f} | {bubble:.1%} | "
            f"{res[0]['predicted_bubble']:.1%} | {step / base:.3f} | {res[0]['first_loss']:.5f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
