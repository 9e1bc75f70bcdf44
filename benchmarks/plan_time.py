"""How long autoshard takes to plan Llama-3 8B on a 64-device 2-D mesh, without any device.

    python benchmarks/plan_time.py                       # 32 layers, batch 8 x seq 2048, (dp 8, tp 8), H100 8x8
    python benchmarks/plan_time.py --layers 2            # quick check
    python benchmarks/plan_time.py --profile             # also cProfile the planning call (top 25, cumulative)

The model is built on the meta device and the mesh lives on a fake process group (world size = mesh size),
so nothing is allocated and no GPU is needed. The batch is pinned to ``Shard(0)`` on ``dp``; everything else
is left to the solver. The reference is Meta's autoparallel on the same model and mesh shape: ILP build
~15 s + CBC solve ~37 s = ~52 s (/work/shared/data/README.md). Progress goes to logging (stderr); the table
is the program's output (stdout).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import logging
import math
import pstats
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoshard.cluster import get_cluster
from autoshard.config import PlanConfig
from autoshard.models.llama import Llama, LlamaConfig, llama_example_inputs
from autoshard.planner import plan_graph

log = logging.getLogger("plan_time")

AUTOPARALLEL_S = 52.0  # Llama-3 8B, 64 GPUs, 2-D mesh: ILP build ~15 s + CBC solve ~37 s


def _parse_mesh(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--mesh wants '<dp>x<tp>', e.g. 8x8; got {text!r}")
    return int(parts[0]), int(parts[1])


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32, help="transformer layers (Llama-3 8B has 32)")
    p.add_argument("--mesh", type=_parse_mesh, default=(8, 8), help="'<dp>x<tp>' (default 8x8)")
    p.add_argument("--cluster", default=None, help="cluster preset (default h100-sxm:<dp>x<tp>)")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--time-limit", type=float, default=30.0, help="solver time limit (s)")
    p.add_argument("--profile", action="store_true", help="cProfile the planning call; print the top 25")
    return p.parse_args(argv)


def _row(name: str, value: object) -> str:
    return f"  {name:<36} {value}"


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    a = _args(argv)
    dp, tp = a.mesh
    world = dp * tp
    cluster = get_cluster(a.cluster or f"h100-sxm:{dp}x{tp}")

    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))  # outside any FakeTensorMode
        cfg = dataclasses.replace(LlamaConfig.llama3_8b(seq_len=a.seq), n_layer=a.layers)
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = Llama(cfg).to(getattr(torch, a.dtype))
        inputs = llama_example_inputs(cfg, a.batch, a.seq)
        n_params = sum(p.numel() for p in model.parameters())
        log.info("built %d-layer Llama (%.2f B params, %s) on meta in %.2f s", a.layers, n_params / 1e9, a.dtype,
                 time.perf_counter() - t0)  # fmt: skip

        config = PlanConfig(constraints={"inputs": {"dp": Shard(0)}}, time_limit_s=a.time_limit)
        prof = cProfile.Profile() if a.profile else None
        if prof is not None:
            prof.enable()
        plan, _, ctx = plan_graph(model, inputs, mesh, cluster, config)
        if prof is not None:
            prof.disable()
    finally:
        dist.destroy_process_group()

    tm = ctx.timings
    canon = ctx.layer_of_group or {g.id: g.id for g in ctx.groups}
    decision_groups = sum(1 for g, c in canon.items() if g == c)
    total = tm["total"]
    s = plan.solver
    gap = (s.objective_s - s.bound_s) / s.objective_s if s.objective_s else math.nan
    lines = [
        f"autoshard plan time: Llama-3 8B shape, {a.layers} layers, batch {a.batch} x seq {a.seq}, {a.dtype}, "
        f"mesh (dp {dp}, tp {tp}), {cluster.name}",
        _row("nodes captured", ctx.stats.get("nodes_captured")),
        _row("nodes after coarsening (groups)", ctx.stats.get("groups", len(ctx.groups))),
        _row("decision groups (after sharing)", f"{decision_groups}  ({ctx.stats.get('shared_layers', 0)} layers shared)"),
        _row("candidate strategies", ctx.stats.get("strategies")),
        _row("solver variables", s.variables),
        _row("capture s", f"{tm.get('capture', 0.0):.2f}"),
        _row("coarsen + share_layers s", f"{tm.get('coarsen', 0.0) + tm.get('share_layers', 0.0):.2f}"),
        _row("strategies s", f"{tm.get('strategies', 0.0):.2f}"),
        _row("build+solve s (ILP build + CP-SAT)", f"{tm.get('solve', 0.0):.2f}  (solver wall {s.wall_s:.2f})"),
        _row("total s (incl. plan report)", f"{total:.2f}"),
        _row("solver status", s.status),
        _row("objective s (predicted step)", f"{s.objective_s:.6f}"),
        _row("bound s", f"{s.bound_s:.6f}  (gap {gap:.2%})"),
        _row("plan step_time_s", f"{plan.step_time_s:.6f}"),
        _row(f"vs autoparallel ~{AUTOPARALLEL_S:.0f} s", f"{total / AUTOPARALLEL_S:.3f}x ({AUTOPARALLEL_S / total:.1f}x faster)"),
    ]
    print("\n".join(lines))
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue())


if __name__ == "__main__":
    main()
