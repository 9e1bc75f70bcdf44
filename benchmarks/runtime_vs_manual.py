"""Measured training-step time: autoshard (solved plan, forced recipes) against hand-written PyTorch parallelism.

    python benchmarks/runtime_vs_manual.py                  # GPT and HF GPT-2, 2 and 4 ranks, eager + compiled
    python benchmarks/runtime_vs_manual.py --quick          # fewer steps, no torch.compile rows
    python benchmarks/runtime_vs_manual.py --model gpt --ranks 2

CPU gloo, one thread per rank (``autoshard.testing.launch``). Meshes: 2 ranks (2,) "dp"; 4 ranks (2, 2) "dp", "tp".
A step is forward, backward and AdamW (``zero_grad(set_to_none=True)`` included), on the same global batch and
the same initial weights in every variant (seeded builders). All variants of one mesh run in ONE launch
(``autoshard.testing.bench.side_by_side``): every variant is built and warmed up, then the timed steps go round-robin
over the variants (``--sequential``: one variant's steps after another's), so that a change in the machine's load
falls on every row alike; each row is the median of rank 0's step times, with a barrier before every timed step.

Variants (those that apply to the mesh, as ``autoshard.solver.recipes.applicable`` says):

- ``autoshard``: the solved plan, Inductor backend;
- ``autoshard <recipe>``: ``recipe=`` ddp / fsdp / tp / fsdp+tp forced, Inductor backend;
- hand-written twins: ``DDP`` (``DistributedDataParallel`` over every rank), ``FSDP2`` (``fully_shard`` per
  block and at the root, over every rank), ``TP`` (``parallelize_module`` with ColwiseParallel on q/k/v/fc1
  and RowwiseParallel on o/fc2 on the last axis, attention using the local heads; on the 2-D mesh plus a
  hand-written gradient all-reduce over "dp"), ``FSDP2+TP`` (TP on "tp", then ``fully_shard`` on "dp");
  each eager and, unless ``--quick``, under ``torch.compile`` (Inductor, CPU C++ kernels).

Ratios: every row against the fastest hand-written row of its mesh, and each forced recipe against the faster
of its hand-written twin's eager / compiled rows. "first loss" is the global batch's loss of the first step
(hand-written rows average their shards' losses over the data-parallel group on that call only): equal on
every row, it shows every variant trains the same model on the same batch.

Hand-written TP (``benchmarks/manual_tp.py``): on HF GPT-2 its ``Conv1D`` projections are first replaced by the
``nn.Linear`` each equals and the fused ``c_attn``'s rows reordered rank-major (what a user must write, since
ColwiseParallel/RowwiseParallel take ``nn.Linear``), so HF has every twin too. On the 2-D mesh the "TP" twin has no DDP
wrapper: DDP does not take DTensor parameters, so its gradients are averaged over "dp" by a plain per-parameter
all-reduce (unbucketed).

Predicted: the plan's step time (calibrated profile, ``--profile``) plus the AdamW update over the device's state;
a hand-written row gets its recipe's prediction. Below each table: rows within ±20% and Spearman's rank
correlation of predicted vs measured.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "autoshard-inductor"))

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/manual_tp.py, when loaded by path
from manual_tp import apply_tp  # noqa: E402

import autoshard  # noqa: E402
from autoshard.errors import LaunchError
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs  # noqa: E402
from autoshard.solver.recipes import applicable  # noqa: E402
from autoshard.testing.bench import Row, Variant, call_loss, side_by_side, spearman  # noqa: E402

log = logging.getLogger("runtime_vs_manual")

GPT_CFG = GPTConfig(n_layer=2, d_model=128, n_head=4, vocab=512, seq_len=64, bias=False)
BATCH = 8
LR = 1e-3
TWINS = {"ddp": "DDP", "fsdp": "FSDP2", "tp": "TP", "fsdp+tp": "FSDP2+TP"}


@dataclass(frozen=True)
class Setup:
    model: str  # "gpt" | "hf"
    mesh_shape: tuple[int, ...]
    compiled: bool  # also the torch.compile'd hand-written rows
    cluster: str  # the cluster profile autoshard plans and predicts with (a calibrated JSON, or a preset)


def make_model(kind: str) -> nn.Module:
    """The benchmark's model with fixed initial weights (same on every rank and in every variant): the GPT
    here, or a stock ``transformers`` GPT2LMHeadModel of the same sizes (dropout 0: every variant draws the
    same numbers, so the first-step losses agree)."""
    if kind == "gpt":
        torch.manual_seed(0)
        return GPT(GPT_CFG)
    import transformers

    c = GPT_CFG
    cfg = transformers.GPT2Config(
        n_layer=c.n_layer,
        n_embd=c.d_model,
        n_head=c.n_head,
        vocab_size=c.vocab,
        n_positions=c.seq_len,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).train()


def global_inputs(kind: str) -> Any:
    """Positional (tokens, targets) for the GPT; keyword arguments for the HF model, called as its users call it
    (it shifts the labels itself)."""
    tokens, targets = gpt_example_inputs(GPT_CFG, BATCH)
    return (tokens, targets) if kind == "gpt" else {"input_ids": tokens, "labels": tokens.clone()}


def blocks(model: nn.Module, kind: str) -> list[nn.Module]:
    return list(model.layers) if kind == "gpt" else list(model.transformer.h)


def _global_loss(loss: Tensor, group: Any, size: int) -> float:
    """The global batch's loss from this rank's (mean over equal shards); a collective, so first call only."""
    value = loss.detach().clone()
    if size > 1:
        dist.all_reduce(value, group=group)
        value /= size
    return float(value)


def _train_step(
    module: nn.Module,
    opt: torch.optim.Optimizer,
    inputs: Any,
    dp_group: Any,
    dp_size: int,
    grad_group: Any = None,
) -> Any:
    """One AdamW step; the first call returns the global loss (averaged over ``dp_group``), later calls 0.0.
    ``grad_group``: average the gradients over it by hand (TP x DP without DDP)."""
    calls = [0]

    def step() -> float:
        loss = call_loss(module, inputs)
        loss.backward()
        if grad_group is not None:
            _allreduce_grads(module, grad_group, dp_size)
        opt.step()
        opt.zero_grad(set_to_none=True)
        calls[0] += 1
        return _global_loss(loss, dp_group, dp_size) if calls[0] == 1 else 0.0

    return step


def _local_batch(inputs: Any, index: int, parts: int) -> Any:
    if isinstance(inputs, dict):
        return {k: t.chunk(parts, dim=0)[index].contiguous() for k, t in inputs.items()}
    return tuple(t.chunk(parts, dim=0)[index].contiguous() for t in inputs)


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """DTensor and plain parameters in separate groups: foreach AdamW cannot mix them in one group (TP shards
    only the projections; layer norms and embeddings stay plain tensors)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": g} for g in groups if g]


def _allreduce_grads(model: nn.Module, group: Any, size: int) -> None:
    """Average every gradient over ``group`` (DTensor grads through their local shard)."""
    for p in model.parameters():
        if p.grad is not None:
            g = getattr(p.grad, "_local_tensor", p.grad)
            dist.all_reduce(g, group=group)
            g.div_(size)


def make_variants(rank: int, world: int, setup: Setup) -> list[Variant]:
    """Every variant of this mesh, in the same order on every rank (meshes are made here, by every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    kind, shape = setup.model, setup.mesh_shape
    names = ("dp",) if len(shape) == 1 else ("dp", "tp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    flat = mesh if len(shape) == 1 else init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    inputs = global_inputs(kind)
    recipes = applicable(shape)
    variants: list[Variant] = []
    predicted: dict[str, float] = {}  # recipe ("" = solved) -> predicted step seconds, filled as variants build

    def autoshard_variant(recipe: str | None) -> Variant:
        def build() -> Any:
            sharded = autoshard.compile(
                make_model(kind), mesh, inputs, backend="inductor", recipe=recipe, cluster=setup.cluster
            )
            opt = torch.optim.AdamW(sharded.parameters(), lr=LR, foreach=True)

            def step() -> float:
                loss = sharded.step(**inputs) if isinstance(inputs, dict) else sharded.step(*inputs)
                opt.step()
                opt.zero_grad(set_to_none=True)
                return float(loss)

            predicted[recipe or ""] = predicted_step_s(sharded.plan, setup.cluster)
            step.notes = {"predicted_s": predicted[recipe or ""]}  # type: ignore[attr-defined]
            return step

        return ("autoshard" if recipe is None else f"autoshard {recipe}"), build

    def hand(name: str, compiled: bool) -> Variant:
        def build() -> Any:
            model = make_model(kind)
            if name == "DDP":
                module: nn.Module = DistributedDataParallel(model)
                local = _local_batch(inputs, rank, world)
            elif name == "FSDP2":
                for b in blocks(model, kind):
                    fully_shard(b, mesh=flat)
                module = fully_shard(model, mesh=flat)
                local = _local_batch(inputs, rank, world)
            elif name == "TP":
                apply_tp(model, mesh if len(shape) == 1 else mesh["tp"], kind)
                module = model
            else:  # FSDP2+TP
                apply_tp(model, mesh["tp"], kind)
                for b in blocks(model, kind):
                    fully_shard(b, mesh=mesh["dp"])
                module = fully_shard(model, mesh=mesh["dp"])
            opt = torch.optim.AdamW(_param_groups(model), lr=LR, foreach=True)
            fwd = torch.compile(module) if compiled else module
            if name in ("DDP", "FSDP2"):
                step = _train_step(fwd, opt, local, None, world)
            elif len(shape) == 1:  # TP over every rank: the whole batch everywhere
                step = _train_step(fwd, opt, inputs, None, 1)
            else:
                dp_group, dp = mesh.get_group("dp"), shape[0]
                local = _local_batch(inputs, mesh.get_coordinate()[0], dp)
                step = _train_step(fwd, opt, local, dp_group, dp, dp_group if name == "TP" else None)
            twin_of = {v: k for k, v in TWINS.items()}[name]
            if twin_of in predicted:  # the same recipe as autoshard costs it (its forced row built first)
                step.notes = {"predicted_s": predicted[twin_of]}
            return step

        return (name + (" (compiled)" if compiled else "")), build

    variants.append(autoshard_variant(None))
    variants += [autoshard_variant(r) for r in recipes]
    twins = [TWINS[r] for r in recipes if r in TWINS]  # zero1, zero2, hsdp: no hand-written twin here
    variants += [hand(t, False) for t in twins]
    if setup.compiled:
        variants += [hand(t, True) for t in twins]
    return variants


def predicted_step_s(plan: Any, cluster: str) -> float:
    """The cost model's training step: the plan's forward + backward + communication, plus the AdamW update
    over this device's parameters, gradients and optimizer state (memory-bound; ``pipeline_search``)."""
    from autoshard.cluster.presets import get_cluster
    from autoshard.pipeline.costs import optimizer_step_s

    m = plan.stages[0].memory
    return plan.step_time_s + optimizer_step_s(m.parameters + m.gradients + m.optimizer, get_cluster(cluster).device, 2)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if math.isfinite(a) and math.isfinite(b) and b > 0 else "-"


def _loss(r: Row) -> str:
    first = r.extra.get("first")
    return f"{first:.5f}" if isinstance(first, float) else "-"


def table(title: str, rows: list[Row]) -> str:
    """Markdown table: median ms, p10-p90, ratio to the best hand-written row, forced recipe / its twin."""
    hand = [r for r in rows if not r.name.startswith("autoshard") and r.timing is not None]
    best = min(hand, key=lambda r: r.median_s) if hand else None
    by_name = {r.name: r for r in rows}
    out = [
        f"**{title}** (best hand-written: {best.name if best else '-'})",
        "",
        "| variant | median ms | p10-p90 ms | / best hand-written | / its twin | predicted ms | predicted / "
        "measured | first loss (rank 0) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.timing is None:
            out.append(f"| {r.name} | failed: {(r.error or '')[:80]} | | | | | | |")
            continue
        pred = r.extra.get("predicted_s")
        pred_cells = f"{pred * 1e3:.1f} | {_ratio(pred, r.median_s)}" if isinstance(pred, float) else "- | -"
        twin = "-"
        recipe = r.name.removeprefix("autoshard ")
        if r.name.startswith("autoshard ") and TWINS.get(recipe):
            cands = [by_name[n] for n in (TWINS[recipe], TWINS[recipe] + " (compiled)") if n in by_name]
            cands = [c for c in cands if c.timing is not None]
            if cands:
                t = min(cands, key=lambda c: c.median_s)
                twin = f"{_ratio(r.median_s, t.median_s)} ({t.name})"
        t_ = r.timing
        out.append(
            f"| {r.name} | {t_.median_s * 1e3:.1f} | {t_.p10_s * 1e3:.1f}-{t_.p90_s * 1e3:.1f} | "
            f"{_ratio(r.median_s, best.median_s) if best else '-'} | {twin} | {pred_cells} | {_loss(r)} |"
        )
    pairs = [
        (r.extra["predicted_s"], r.median_s)
        for r in rows
        if r.timing is not None and isinstance(r.extra.get("predicted_s"), float)
    ]
    if pairs:
        within = sum(1 for p, m in pairs if abs(p / m - 1) <= 0.2)
        rho = spearman([p for p, _ in pairs], [m for _, m in pairs])
        out += [
            "",
            f"Predicted vs measured, {len(pairs)} rows with a prediction: {within} within ±20%; Spearman "
            f"rank correlation {rho:.2f}"
            if math.isfinite(rho)
            else f"{within} within ±20%",
        ]
    return "\n".join(out)


def _profile(spec: str, world: int, tmp: str) -> str:
    """The profile to plan with: ``spec`` itself, or for "calibrate" a quick calibration of this machine with
    ``world`` gloo ranks written under ``tmp`` (its summary is printed)."""
    if spec != "calibrate":
        return spec
    from autoshard.cluster.calibrate import calibrate, summary, write_profile
    from autoshard.cluster.calibration_config import CalibrationConfig

    t0 = time.perf_counter()
    cal = calibrate(CalibrationConfig.quick(ranks=world), name=f"calibrated-cpu-{world}")
    path = str(write_profile(cal, os.path.join(tmp, f"calibrated-{world}.json")))
    print(f"calibrated with {world} ranks in {time.perf_counter() - t0:.0f} s (autoshard calibrate --quick):")
    print("\n".join(f"    {line}" for line in summary(cal)) + "\n")
    return path


def _run_table(world: int, steps: int, warmup: int, setup: Setup, sequential: bool, tries: int = 3) -> list[Row]:
    """One table's launch. A rank that dies without a Python exception (the rare native crash of issue 14's
    part 5: SIGSEGV or glibc's heap-corruption abort in a 4-rank launch, seen about once in ten) is reported and
    the whole table launched again, up to ``tries`` times, so that every table runs to the end; any other error
    is raised."""
    for attempt in range(1, tries + 1):
        try:
            return side_by_side(world, make_variants, steps, warmup, arg=setup, interleave=not sequential)
        except LaunchError as e:
            if "without a Python exception" not in str(e) or attempt == tries:
                raise
            print(f"(launch {attempt} of this table died natively: {e}; launched again)", flush=True)
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, no torch.compile rows")
    ap.add_argument("--model", choices=("gpt", "hf", "both"), default="both")
    ap.add_argument("--ranks", type=int, nargs="+", choices=(2, 4), default=[2, 4])
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument(
        "--profile",
        default="calibrate",
        help="cluster profile autoshard plans and predicts with: 'calibrate' (measure this machine first, "
        "`autoshard calibrate --quick`, per rank count), a profile JSON path, or a preset such as 'cpu'",
    )
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="time each variant's steps in a block (default: round-robin over the variants)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("autoshard.testing.bench").setLevel(logging.INFO)  # which variant runs (to stderr)
    steps = args.steps or (5 if args.quick else 20)
    warmup = args.warmup or (2 if args.quick else 3)
    models = ("gpt", "hf") if args.model == "both" else (args.model,)
    c = GPT_CFG
    print(
        f"# runtime vs hand-written: {c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, vocab {c.vocab}, "
        f"seq {c.seq_len}, global batch {BATCH}; AdamW; median of {steps} steps after {warmup} warm-up; "
        f"CPU gloo, 1 thread per rank; torch {torch.__version__}\n"
    )
    profiles: dict[int, str] = {}
    tmp = tempfile.mkdtemp(prefix="autoshard-bench-")
    for kind in models:
        for world in args.ranks:
            shape = (2,) if world == 2 else (2, 2)
            t0 = time.perf_counter()
            if world not in profiles:
                profiles[world] = _profile(args.profile, world, tmp)
            cluster = profiles[world]
            rows = _run_table(world, steps, warmup, Setup(kind, shape, not args.quick, cluster), args.sequential)
            title = f"{'GPT' if kind == 'gpt' else 'HF GPT-2'}, {world} ranks, mesh {shape}, profile {cluster}"
            print(table(title, rows))
            print(f"\n({time.perf_counter() - t0:.0f} s including builds and compilation)\n", flush=True)


if __name__ == "__main__":
    main()
