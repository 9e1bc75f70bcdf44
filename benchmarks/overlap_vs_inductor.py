"""autoshard's overlap pass against Inductor's FX overlap scheduler, measured on the same lowered programs.

    python benchmarks/overlap_vs_inductor.py                 # GPT and HF GPT-2, ddp and fsdp, 2 ranks
    python benchmarks/overlap_vs_inductor.py --steps 40 --model hf --recipes fsdp

Issue 14 asks to keep one mechanism for ordering and bundling collectives: ours (``autoshard/compiler/overlap.py``
raises each gradient bucket's collective to just after its last input and sinks every wait to its first use; the buckets
and per-layer gather groups are made by the lowering, ``autoshard/compiler/lower_buckets.py``) or Inductor's
(``schedule_overlap_bucketing``: a list scheduler driven by runtime estimates, with its own collective
bucketing). For each model and forced recipe, one launch builds the program twice from the same plan:

- ``ours``: the pass pipeline as shipped;
- ``inductor``: the ``overlap`` pass disabled, then Inductor's scheduler (with bucketing) run on the forward and
  the backward graph (``autoshard/_torch_compat/overlap.py``), every node's runtime given by autoshard's cost
  model on the calibrated-free ``cpu`` profile (collectives by the alpha-beta model, ops by the roofline).

Both then compile with Inductor and train with AdamW; the steps go round-robin over the two (the machine's load
falls on both alike), median of rank 0's step times. The first loss must agree (same plan, same numbers).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import torch
import torch.fx as fx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runtime_vs_manual import global_inputs, make_model  # noqa: E402

import autoshard  # noqa: E402
from autoshard._torch_compat.overlap import available, inductor_schedule_overlap  # noqa: E402
from autoshard.cluster.presets import get_cluster  # noqa: E402
from autoshard.cluster.profile import ClusterProfile  # noqa: E402
from autoshard.compiler.lower import collective_counts  # noqa: E402
from autoshard.cost.comm import collective_time  # noqa: E402
from autoshard.cost.compute import compute_time, op_bytes, op_flops  # noqa: E402
from autoshard.testing.bench import Variant, side_by_side  # noqa: E402

PROFILE = "cpu"
_KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


def cost_model_estimator(cluster: ClusterProfile, group_size: int) -> Any:
    """``estimate(node, override_size) -> ms``: a collective by the alpha-beta model over ``group_size`` ranks on
    the intra-node link (its full, gathered size), any other op by the roofline of ``autoshard/cost/compute.py``."""
    link, device = cluster.intra_node, cluster.device

    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    def estimate(node: fx.Node, override_size: int | None = None) -> float | None:
        if node.op != "call_function":
            return None
        t = node.target
        if getattr(t, "namespace", "") == "_c10d_functional":
            name = t._opname
            if name not in _KINDS:
                return 0.0
            v = val(node.args[0])
            nbytes = override_size or v.numel() * v.element_size()
            full = nbytes * group_size if name == "all_gather_into_tensor" else nbytes
            return collective_time(_KINDS[name], full, group_size, link) * 1e3
        args = torch.utils._pytree.tree_map(val, node.args)
        kwargs = torch.utils._pytree.tree_map(val, node.kwargs)
        out = node.meta.get("val")
        try:
            return compute_time(op_flops(t, args, kwargs, out), op_bytes(args, kwargs, out), device, "float32") * 1e3
        except Exception:  # an op the counter cannot size (no tensor output): free
            return 0.0

    return estimate


def make_variants(rank: int, world: int, setup: tuple[str, str]) -> list[Variant]:
    from torch.distributed.device_mesh import init_device_mesh

    kind, recipe = setup
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    inputs = global_inputs(kind)

    def variant(mode: str) -> Variant:
        def build() -> Any:
            opts = {} if mode == "ours" else {"disable_passes": ["overlap"]}
            sharded = autoshard.compile(make_model(kind), mesh, inputs, recipe=recipe, cluster=PROFILE, **opts)
            program = sharded._program
            if mode == "inductor":
                estimate = cost_model_estimator(get_cluster(PROFILE), world)
                program.fw_gm = inductor_schedule_overlap(program.fw_gm, estimate)
                program.bw_gm = inductor_schedule_overlap(program.bw_gm, estimate)
            opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3, foreach=True)

            def step() -> float:
                loss = sharded.step(**inputs) if isinstance(inputs, dict) else sharded.step(*inputs)
                opt.step()
                opt.zero_grad(set_to_none=True)
                return float(loss)

            fw, bw = collective_counts(program.fw_gm), collective_counts(program.bw_gm)
            step.notes = {"collectives": f"fw {sum(fw.values())}, bw {sum(bw.values())}"}  # type: ignore[attr-defined]
            return step

        return mode, build

    return [variant("ours"), variant("inductor")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt", "hf", "both"), default="both")
    ap.add_argument("--recipes", nargs="+", default=["ddp", "fsdp"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not available():
        raise SystemExit("this torch has no torch._inductor.fx_passes.overlap_scheduling")
    print(
        f"# overlap: autoshard's pass vs Inductor's scheduler; 2 gloo ranks, 1 thread each; median of {args.steps} "
        f"steps after {args.warmup}, round-robin; torch {torch.__version__}\n"
    )
    print("| model | recipe | ours ms | inductor ms | inductor / ours | collectives (ours; inductor) | first loss |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("gpt", "hf") if args.model == "both" else (args.model,):
        for recipe in args.recipes:
            rows = {
                r.name: r
                for r in side_by_side(2, make_variants, args.steps, args.warmup, arg=(kind, recipe), interleave=True)
            }
            ours, ind = rows["ours"], rows["inductor"]
            if ours.timing is None or ind.timing is None:
                print(f"| {kind} | {recipe} | failed: {(ours.error or ind.error or '')[:80]} | | | | |")
                continue
            same = ours.extra.get("first") == ind.extra.get("first")
            print(
                f"| {kind} | {recipe} | {ours.median_s * 1e3:.1f} | {ind.median_s * 1e3:.1f} | "
                f"{ind.median_s / ours.median_s:.2f} | {ours.extra['collectives']}; {ind.extra['collectives']} | "
                f"{ours.extra.get('first', float('nan')):.5f}{'' if same else ' (differs!)'} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
