"""``autoshard`` on the command line: plan a zoo model for a cluster from a laptop.

    autoshard plan --model llama3-70b --cluster h100-sxm:128x8 --seq 8192 --global-batch 512 \\
                   --memory-per-device 80GB --out plan.json --html plan.html
    autoshard plan --model path/to/config.json --cluster a100-80gb:4x8 --global-batch 64 --recipe fsdp
    autoshard plan --model gpt2-1.5b --cluster a100-80gb:4x8 --global-batch 64 --pipeline auto
    autoshard plan --model gpt2-1.5b --cluster a100-80gb:4x8 --global-batch 64 --mesh pp=4,tp=8
    autoshard plan --model llama3-70b --cluster a100-80gb:1x8 --seq 2048 --global-batch 8   # offloads: only that fits
    autoshard explain plan.json fsdp.json [--html why.html]   # why two plans differ, priced
    autoshard models          # the zoo
    autoshard clusters        # the cluster presets
    autoshard calibrate --out my_cpu.json [--ranks 4] [--quick]   # measure this machine -> --cluster my_cpu.json

Progress (capture, strategies, solve) goes to stderr, with a bar on long steps when stderr is a terminal; the
plan report goes to stdout; ``--out`` writes the plan as JSON (``autoshard.Plan.from_json`` reads it back).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from autoshard.cluster.presets import get_cluster, known_clusters
from autoshard.errors import InputError, SolverTimeout
from autoshard.models.zoo import get_model, known_models
from autoshard.notation import parse_bytes
from autoshard.plans.html.page import write_html
from autoshard.plans.report import report
from autoshard.plans.trace import predicted_trace, write_trace

log = logging.getLogger(__name__)

STAGES = ("model", "capture", "coarsen", "share_layers", "strategies", "solve")


class ProgressPrinter:
    """Prints one line per planning stage; redraws a bar in place while a stage reports fractions (tty only)."""

    def __init__(self, stream: TextIO, quiet: bool = False) -> None:
        self.stream = stream
        self.quiet = quiet
        self.tty = stream.isatty()
        self.t0 = time.perf_counter()
        self.open = False

    def __call__(self, stage: str, fraction: float, message: str) -> None:
        if self.quiet or stage in ("coarsen", "share_layers"):
            return
        elapsed = time.perf_counter() - self.t0
        if fraction >= 1.0 or stage == "model":
            self._end_bar()
            self.stream.write(f"[{elapsed:6.1f} s] {stage:<10} done  {message}\n")
        elif fraction <= 0.0 and not message:
            self._end_bar()
            self.stream.write(f"[{elapsed:6.1f} s] {stage:<10} ...\n")
        elif self.tty:
            width = 30
            filled = int(round(width * fraction))
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(f"\r[{elapsed:6.1f} s] {stage:<10} [{bar}] {fraction:4.0%} {message[:50]:<50}")
            self.open = True
        else:
            self.stream.write(f"[{elapsed:6.1f} s] {stage:<10} {fraction:4.0%} {message}\n")
        self.stream.flush()

    def _end_bar(self) -> None:
        if self.open:
            self.stream.write("\n")
            self.open = False


def _number(kind: type, least: float, strict: bool = False) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` at least ``least`` (above it if ``strict``), refused in one line
    naming the flag (argparse adds it) and the valid range."""
    what = ("a whole number" if kind is int else "a number") + (f" > {least}" if strict else f" >= {least}")

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < least or (strict and value == least) or value != value:  # (NaN)
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {what}")
        return value

    parse.__name__ = what  # (argparse names the type in its message)
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="autoshard", description="Plan sharded training of a model for a cluster.")
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plan", help="plan a model for a cluster (no GPU needed)")
    pl.add_argument("--model", required=True, help=f"zoo name ({', '.join(known_models())}) or a HF config.json")
    pl.add_argument(
        "--cluster", required=True, help=f"preset[:NODESxPER_NODE] ({', '.join(known_clusters())}) or .json"
    )
    pl.add_argument(
        "--mesh",
        default=None,
        help="mesh shape, e.g. 16x8x8 (default: NODES x PER_NODE), or named axes "
        "outer first, e.g. pp=4,tp=8 (a 'pp' axis fixes that many pipeline stages)",
    )
    pl.add_argument(
        "--pipeline",
        choices=("none", "auto"),
        default="none",
        help="auto: also weigh pipeline stages over sub-meshes (stage counts x micro-batches x "
        "schedules; costs a few extra solves) and keep them when faster (default: none)",
    )
    pl.add_argument("--seq", type=_number(int, 1), default=None, help="sequence length (default: the model's)")
    pl.add_argument(
        "--global-batch", type=_number(int, 1), required=True, help="sequences (samples) per optimizer step"
    )
    pl.add_argument(
        "--microbatches",
        type=_number(int, 1),
        default=None,
        help="gradient accumulation: the step as this many micro-batches of the global batch (default: "
        "the whole batch, or when it does not fit, the fewest micro-batches that fit or the next "
        "count, whichever steps faster)",
    )
    pl.add_argument("--memory-per-device", default=None, help="budget per device, e.g. 80GB (default: device memory)")
    pl.add_argument(
        "--recipe",
        default=None,
        help="plan a manual recipe instead: ddp, zero1, zero2, fsdp, hsdp, tp, fsdp+tp, ep (experts), cp (sequence)",
    )
    pl.add_argument(
        "--no-recipes",
        action="store_true",
        help="skip solving the manual recipes alongside the plan (and the comparison with them)",
    )
    pl.add_argument(
        "--offload",
        choices=("auto", "none", "optimizer", "params"),
        default="auto",
        help="optimizer state (and with 'params' the parameters) in host memory: auto = where device "
        "memory forces it (default), none, or forced for every parameter",
    )
    pl.add_argument(
        "--mixed-precision",
        choices=("none", "bf16"),
        default="none",
        help="bf16: fp32 parameters (masters), gradients and AdamW state, the step in bf16 "
        "(--precision-policy; default none: the model in bf16 throughout)",
    )
    pl.add_argument(
        "--reduce-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="with --mixed-precision bf16: the dtype gradients are reduced in",
    )
    pl.add_argument(
        "--precision-policy",
        choices=("params", "autocast"),
        default="params",
        help="with --mixed-precision bf16: 'params' casts the parameters to bf16 and runs the whole step "
        "in bf16 (FSDP2's MixedPrecisionPolicy, torchtitan's); 'autocast' runs torch.autocast",
    )
    pl.add_argument(
        "--time-limit", type=_number(float, 0.0, strict=True), default=30.0, help="solver time limit per solve, seconds"
    )
    pl.add_argument(
        "--sample-layers",
        type=_number(int, 0),
        default=3,
        help="repeated layers captured (they stand for all; 0: every layer)",
    )
    pl.add_argument("--out", default=None, help="write the plan as JSON here")
    pl.add_argument(
        "--html",
        default=None,
        help="write the plan as a self-contained HTML page here (layouts, memory, "
        "step time, pipeline schedule, recipes)",
    )
    pl.add_argument(
        "--trace",
        default=None,
        help="write the predicted step as a Chrome trace here (plan.json.gz; Perfetto and chrome://tracing open it)",
    )
    pl.add_argument("--full", action="store_true", help="print every layer and decision (no folding)")
    pl.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    pl.add_argument("-v", "--verbose", action="store_true", help="log every pass")
    ca = sub.add_parser("calibrate", help="measure this machine (matmul, memory, gloo collectives) into a profile")
    ca.add_argument("--out", required=True, help="write the cluster profile JSON here (use it as --cluster PATH)")
    ca.add_argument("--ranks", type=int, choices=(2, 4), default=4, help="gloo ranks: mesh (2,) or (2, 2)")
    ca.add_argument(
        "--threads", type=_number(int, 1), default=1, help="torch threads per rank for compute (default: 1)"
    )
    ca.add_argument("--name", default="calibrated-cpu", help="profile name")
    ca.add_argument("--quick", action="store_true", help="small sizes, few repetitions (seconds, noisier)")
    ca.add_argument("-v", "--verbose", action="store_true", help="log every measurement")
    pr = sub.add_parser(
        "profile", help="measure this machine into the profile cluster=None prices on (cached; --show prints it)"
    )
    pr.add_argument("--show", action="store_true", help="print the cached profile of this machine, measure nothing")
    pr.add_argument("--quick", action="store_true", help="small sizes, few repetitions (seconds, noisier)")
    ex = sub.add_parser("explain", help="why two saved plans differ: layouts, and the cost of each difference")
    ex.add_argument("a", help="a plan JSON (autoshard plan --out)")
    ex.add_argument("b", help="another plan JSON of the same model (e.g. autoshard plan --recipe fsdp --out)")
    ex.add_argument("--html", default=None, help="also write B's page with the comparison here")
    sub.add_parser("models", help="list the model zoo")
    sub.add_parser("clusters", help="list the cluster presets")
    return p


def _plan(a: argparse.Namespace) -> int:
    import autoshard
    from autoshard.cluster.meshes import parse_mesh_spec

    budget = parse_bytes(a.memory_per_device) if a.memory_per_device else None
    mesh = parse_mesh_spec(a.mesh) if a.mesh else None
    progress = ProgressPrinter(sys.stderr, quiet=a.quiet)
    plan = autoshard.plan(
        a.model,
        mesh,
        cluster=a.cluster,
        seq=a.seq,
        global_batch=a.global_batch,
        memory_budget=budget,
        progress=progress,
        recipe=a.recipe,
        solve_recipes=not a.no_recipes,
        time_limit_s=a.time_limit,
        sample_layers=a.sample_layers,
        pipeline=a.pipeline,
        microbatches=a.microbatches,
        offload=a.offload,
        mixed_precision=None if a.mixed_precision == "none" else a.mixed_precision,
        reduce_dtype=a.reduce_dtype,
        precision_policy=a.precision_policy,
    )
    sys.stdout.write(report(plan, collapse=not a.full))
    if a.out:
        Path(a.out).write_text(plan.to_json())
        sys.stderr.write(f"plan written to {a.out}\n")
    if a.html:
        write_html(plan, a.html)
        sys.stderr.write(f"plan page written to {a.html}\n")
    if a.trace:
        write_trace(predicted_trace(plan), a.trace)
        sys.stderr.write(f"predicted trace written to {a.trace} (open it in https://ui.perfetto.dev)\n")
    return 0


def _explain(a: argparse.Namespace) -> int:
    from autoshard.plans.explain import explain_lines
    from autoshard.plans.plan import Plan

    plans = []
    for path in (a.a, a.b):
        try:
            plans.append(Plan.from_json(Path(path).read_text()))
        except OSError as e:
            raise InputError(f"explain: cannot read the plan {path!r}: {e.strerror}") from None
    names = (Path(a.a).stem, Path(a.b).stem)
    sys.stdout.write("".join(f"{line}\n" for line in explain_lines(plans[0], plans[1], names)))
    if a.html:
        write_html(plans[1], a.html, compare=plans[0], names=names)
        sys.stderr.write(f"page written to {a.html}\n")
    return 0


def _calibrate(a: argparse.Namespace) -> int:
    from dataclasses import replace

    from autoshard.cluster.calibrate import calibrate, summary, write_profile
    from autoshard.cluster.calibration_config import CalibrationConfig

    cfg = CalibrationConfig.quick(a.ranks) if a.quick else CalibrationConfig(ranks=a.ranks)
    cfg = replace(cfg, threads=a.threads)
    sys.stderr.write(f"calibrating: {a.ranks} gloo ranks, mesh {cfg.mesh_shape()}, {cfg.threads} thread(s)...\n")
    result = calibrate(cfg, name=a.name)
    sys.stdout.write("".join(f"{line}\n" for line in summary(result)))
    write_profile(result, a.out)
    sys.stderr.write(f"profile written to {a.out} (autoshard plan ... --cluster {a.out})\n")
    return 0


def _profile(a: argparse.Namespace) -> int:
    """``autoshard profile``: this machine measured (``autoshard calibrate`` on its cores) into the cache
    ``cluster=None`` reads (``autoshard/cluster/machine.py``), or the cached profile shown."""
    import json

    from autoshard.cluster.calibrate import calibrate, summary, write_profile
    from autoshard.cluster.calibration_config import CalibrationConfig
    from autoshard.cluster.machine import machine_identity, profile_path, usable_cores
    from autoshard.cluster.profile import ClusterProfile

    path = profile_path()
    ident = machine_identity()
    sys.stdout.write(f"this machine: {ident['cpu']}, {ident['cores']} cores, {int(ident['memory']) / 2**30:.1f} GiB\n")
    if a.show:
        if not path.is_file():
            sys.stdout.write(
                "not profiled yet (cluster=None prices on this machine's memory at the 'cpu' preset's rates); "
                "run: autoshard profile\n"
            )
            return 1
        prof = ClusterProfile.from_dict(json.loads(path.read_text()))
        dev, link = prof.device, prof.intra_node
        fp32 = dev.peak_flops.get("float32", 0) / 1e9
        sys.stdout.write(
            f"profile {path}: {prof.devices_per_node} ranks, {dev.name}, fp32 {fp32:.0f} "
            f"GFLOP/s peak, memory {dev.memory_bandwidth / 1e9:.1f} GB/s, {link.name} {link.bandwidth / 1e9:.2f} GB/s, "
            f"{link.latency * 1e6:.0f} us\n"
        )
        return 0
    ranks = 4 if usable_cores() >= 4 else 2
    cfg = CalibrationConfig.quick(ranks) if a.quick else CalibrationConfig(ranks=ranks)
    sys.stderr.write(f"profiling this machine: {ranks} gloo ranks, mesh {cfg.mesh_shape()}...\n")
    result = calibrate(cfg, name="this-machine")
    sys.stdout.write("".join(f"{line}\n" for line in summary(result)))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_profile(result, path)
    sys.stderr.write(f"profile written to {path}: cluster=None now prices on it\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(a, "verbose", False) else logging.WARNING, format="%(name)s: %(message)s"
    )
    try:
        if a.command == "models":
            for name in known_models():
                sys.stdout.write(f"{name:<14} {get_model(name).description}\n")
            return 0
        if a.command == "clusters":
            for name in known_clusters():
                c = get_cluster(name)
                sys.stdout.write(
                    f"{name:<10} {c.device.name}, {c.devices_per_node} per node, {c.intra_node.name} "
                    f"{c.intra_node.bandwidth / 1e9:.0f} GB/s, {c.inter_node.name} {c.inter_node.bandwidth / 1e9:.1f} "
                    "GB/s per device\n"
                )
            return 0
        if a.command == "calibrate":
            return _calibrate(a)
        if a.command == "profile":
            return _profile(a)
        if a.command == "explain":
            return _explain(a)
        return _plan(a)
    except (ValueError, SolverTimeout) as e:  # bad input or a time limit: the message says what to change
        sys.stderr.write(f"autoshard: error: {e}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
