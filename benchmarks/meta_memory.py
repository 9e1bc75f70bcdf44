"""Per-rank peak memory of a meta-built model against one built whole on every rank, and against the plan.

    python benchmarks/meta_memory.py                          # Llama ~220 M, fsdp, ranks 1,2,4 (~22 min on 2 cores)
    python benchmarks/meta_memory.py --ranks 2 --modes meta-load,whole
    python benchmarks/meta_memory.py --layers 2 --hidden 512  # a quick look

Model: a stock ``transformers`` LlamaForCausalLM from ``LlamaConfig`` (default hidden 1024, 12 layers, MLP 2816,
16 heads, vocab 32000, untied head: 220 M parameters, 838 MiB in float32), global batch 4 x 64 tokens.

Cases, each one ``autoshard.testing.launch`` of fresh forked processes (gloo ranks, 1 thread each), ``recipe="fsdp"``:

- ``single``: the plain model built with ``from_config`` on the CPU, trained as one process does (no autoshard);
- ``whole``: ``from_config`` on every rank (values from construction), then ``autoshard.compile``;
- ``meta-load``: built under ``torch.device("meta")``, compiled, then ``sharded.load_pretrained(dir)`` from a
  ``save_pretrained`` directory written once beforehand (by a separate forked process);
- ``meta-init``: built on meta, compiled, then ``sharded.init_weights(seed)``.

Every case then trains 2 steps with ``torch.optim.AdamW(foreach=True)`` and ``zero_grad(set_to_none=True)``.

Measured two ways, per rank (the table shows the rank with the larger peak):

- resident memory: ``VmHWM`` from ``/proc/self/status``, reset (``echo 5 > /proc/self/clear_refs``) when the child
  starts and after each phase (build + compile, giving values, step 1, step 2), so every phase has its own peak and
  nothing carries over from the parent. The child is forked from a parent that has only imported torch,
  transformers and autoshard: its resident size when it starts (``runtime``, about 0.27 GiB: libraries, Python,
  the pages inherited from the parent) is reported, and ``RSS - runtime`` is what the case itself added;
- the project's probe (``autoshard.testing.memory_probe.measure_peak``, the profiler's CPU memory timeline: tensor
  bytes, no allocator slack nor non-tensor memory) on a third step, after the two measured ones (the profiler's own
  memory stays out of the RSS numbers).

The plan's prediction is ``sharded.plan.peak_memory`` (per device: parameters, gradients, optimizer state, saved
activations, temporaries). Goals (the meta-device issue): meta-built on 2 ranks at most 0.6 of the single-device
training peak, and within 10% of the plan's prediction.

Note: 4 ranks on a 2-core machine time badly (the ranks share the cores); their memory is still meaningful.

The current table and what it shows: ``docs/benchmarks.md`` ("Models bigger than one device").
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.profiler import record_function

import autoshard
from autoshard.errors import LaunchError
from autoshard.testing.launch import launch
from autoshard.testing.memory_probe import measure_peak

log = logging.getLogger("meta_memory")

MIB = 2**20
MODES = ("whole", "meta-load", "meta-init")
PHASES = ("build", "values", "step1", "step2")
GOAL_RATIO = 0.6
GOAL_PRED = 0.10


@dataclass(frozen=True)
class ModelSpec:
    hidden: int = 1024
    layers: int = 12
    intermediate: int = 2816
    heads: int = 16
    vocab: int = 32000
    batch: int = 4  # a multiple of every world size (fsdp shards the batch)
    seq: int = 64

    def config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            vocab_size=self.vocab,
            max_position_embeddings=self.seq,
            tie_word_embeddings=False,
            attention_dropout=0.0,
        )

    def params(self) -> int:
        h, f, v = self.hidden, self.intermediate, self.vocab
        return 2 * v * h + h + self.layers * (4 * h * h + 3 * h * f + 2 * h)


@dataclass(frozen=True)
class Case:
    mode: str  # "single" | one of MODES
    world: int
    model: ModelSpec
    backend: str
    ckpt: str  # the save_pretrained directory (meta-load)
    probe: bool
    steps: int = 2  # measured AdamW steps (the table's phases step1 and step2; fewer for a quick check)


def _status() -> dict[str, int]:
    """VmHWM / VmRSS / RssAnon / RssFile of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Phases:
    """Peak RSS per phase: the kernel's high-water mark, reset at the start of each phase; and the peak of the
    anonymous part (RssAnon: not the file pages a reader maps), sampled every 5 ms by a thread."""

    def __init__(self) -> None:
        self.runtime = _status()["VmRSS"]
        self.runtime_anon = _status()["RssAnon"]
        self.peaks: dict[str, int] = {}
        self.anon: dict[str, int] = {}
        self.start: dict[str, int] = {}
        self._name: str | None = None
        self._reset("build")
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            name, anon = self._name, _status()["RssAnon"]
            if name is not None:
                self.anon[name] = max(self.anon.get(name, 0), anon)
            time.sleep(0.005)

    def _reset(self, name: str) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
        self.start[name] = _status()["VmRSS"]
        self._name = name

    def end(self, name: str, following: str | None = None) -> None:
        self.peaks[name] = _status()["VmHWM"]
        self.anon[name] = max(self.anon.get(name, 0), _status()["RssAnon"])
        self._name = None
        log.info(
            "  %-6s peak RSS %7.0f MiB, anonymous %7.0f (started at %.0f)",
            name,
            self.peaks[name] / MIB,
            self.anon[name] / MIB,
            self.start[name] / MIB,
        )
        if following is not None:
            self._reset(following)


def _local_nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def _held(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's local bytes of parameters and optimizer state, counted directly."""
    state = sum(_local_nbytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"params": sum(_local_nbytes(p) for p in params), "opt": state}


def _worker(rank: int, world: int, case: Case) -> dict[str, Any]:
    """One case on this rank: build, compile, give values, 2 steps (RSS per phase), a third step under the probe."""
    from transformers import AutoModelForCausalLM

    phases = Phases()
    torch.manual_seed(0)
    cfg = case.model.config()
    ids = torch.randint(0, case.model.vocab, (case.model.batch, case.model.seq))
    batch = {"input_ids": ids, "labels": ids}
    t0 = time.perf_counter()
    pred: dict[str, int] = {}
    if case.mode == "single":
        model = AutoModelForCausalLM.from_config(cfg).train()
        phases.end("build", "values")

        def fwd_bwd() -> None:
            model(**batch).loss.backward()

        trained: torch.nn.Module = model
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        if case.mode == "whole":
            model = AutoModelForCausalLM.from_config(cfg).train()
        else:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg).train()
        sharded = autoshard.compile(model, mesh, example_inputs=batch, recipe="fsdp", backend=case.backend)
        phases.end("build", "values")
        if case.mode == "meta-load":
            sharded.load_pretrained(case.ckpt)
        elif case.mode == "meta-init":
            sharded.init_weights(0)
        pm = sharded.plan.peak_memory
        pred = {
            "params": pm.parameters,
            "grads": pm.gradients,
            "opt": pm.optimizer,
            "acts": pm.activations,
            "temps": pm.temporaries,
            "total": pm.total,
        }

        def fwd_bwd() -> None:
            sharded.step(**batch)

        trained = sharded
    phases.end("values", "step1" if case.steps else None)
    build_s = time.perf_counter() - t0
    params = list(trained.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def step() -> None:
        with record_function("fwd_bwd"):
            fwd_bwd()
        with record_function("opt"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    step_s = []
    for k in range(1, case.steps + 1):
        t1 = time.perf_counter()
        step()
        step_s.append(time.perf_counter() - t1)
        phases.end(f"step{k}", f"step{k + 1}" if k < case.steps else None)
    held = _held(params, opt)
    probe: dict[str, Any] = {}
    if case.probe and case.steps:
        base = held["params"] + held["opt"] + 2 * ids.numel() * ids.element_size()
        r = measure_peak(step, regions=("fwd_bwd", "opt"), baseline=lambda: base, attempts=1 if world > 1 else 2)
        probe = {
            "peak": r.peak_bytes,
            "baseline": r.baseline_bytes,
            "method": r.method,
            "regions": {k: v.peak_bytes for k, v in r.regions.items()},
        }
    return {
        "rank": rank,
        "runtime": phases.runtime,
        "peaks": phases.peaks,
        "starts": phases.start,
        "pred": pred,
        "anon": phases.anon,
        "runtime_anon": phases.runtime_anon,
        "held": held,
        "probe": probe,
        "build_s": build_s,
        "step_s": step_s,
        "end": _status(),
    }


def _save_worker(rank: int, world: int, arg: tuple[ModelSpec, str]) -> int:
    """Write the checkpoint meta-load reads (a forked process, so the parent stays small)."""
    from transformers import AutoModelForCausalLM

    spec, path = arg
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(spec.config()).save_pretrained(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def run_case(case: Case, timeout: float) -> dict[str, Any] | None:
    """The case on fresh forked processes; the rank with the larger peak, or None (logged) when it failed."""
    t0 = time.perf_counter()
    log.info("case %s on %d rank(s)", case.mode, case.world)
    try:
        ranks = launch(case.world, _worker, case, timeout=timeout, gloo=case.mode != "single")
    except LaunchError as e:
        log.error("case %s x%d failed: %s\n%s", case.mode, case.world, e, e.detail)
        return None
    worst = max(ranks, key=lambda r: max(r["peaks"].values()))
    out = dict(
        worst,
        mode=case.mode,
        world=case.world,
        wall_s=time.perf_counter() - t0,
        rank_peaks=[max(r["peaks"].values()) for r in ranks],
    )
    out["peak"] = max(worst["peaks"].values())
    log.info(
        "case %s x%d: peak RSS %.0f MiB (ranks %s), %.0f s",
        case.mode,
        case.world,
        out["peak"] / MIB,
        [round(p / MIB) for p in out["rank_peaks"]],
        out["wall_s"],
    )
    return out


def _m(b: float) -> str:
    return f"{b / MIB:.0f}"


def _label(r: dict[str, Any]) -> str:
    return {
        "single": "single device (plain)",
        "whole": "built whole",
        "meta-load": "meta + load_pretrained",
        "meta-init": "meta + init_weights",
    }[r["mode"]]


def format_tables(rows: list[dict[str, Any]], spec: ModelSpec) -> str:
    single = next((r for r in rows if r["mode"] == "single"), None)
    lines = [
        f"LlamaForCausalLM {spec.params() / 1e6:.0f} M parameters ({spec.params() * 4 / MIB:.0f} MiB fp32; hidden "
        f"{spec.hidden}, {spec.layers} layers, MLP {spec.intermediate}, vocab {spec.vocab}), batch {spec.batch} x "
        f"{spec.seq}, recipe fsdp, AdamW(foreach); per-rank peaks in MiB (the rank with the larger peak); "
        "through build + compile + values + 2 steps",
        "",
        "| ranks | build | peak RSS | / single | RSS - runtime | / single | probe step | predicted "
        "| (RSS - runtime) / pred | probe / pred |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        above = r["peak"] - r["runtime"]
        ratio = f"{r['peak'] / single['peak']:.2f}" if single else "-"
        ratio_above = f"{above / (single['peak'] - single['runtime']):.2f}" if single else "-"
        probe = r["probe"].get("peak")
        total = r["pred"].get("total")
        note = " (4 ranks on 2 cores: slow, memory valid)" if r["world"] >= 4 else ""
        lines.append(
            f"| {r['world']} | {_label(r)}{note} | {_m(r['peak'])} | {ratio} | {_m(above)} | {ratio_above} | "
            f"{_m(probe) if probe else '-'} | {_m(total) if total else '-'} | "
            f"{f'{above / total:.2f}' if total else '-'} | {f'{probe / total:.2f}' if total and probe else '-'} |"
        )
    lines += [
        "",
        "Where the peak is: per phase, peak RSS / peak anonymous RSS (sampled) above the runtime's, MiB; what the step "
        "holds (local parameters + AdamW state, counted); the probe's step: pre-existing tensors / peak in "
        "forward+backward / in the optimizer; the prediction's parameters / gradients / optimizer / activations / "
        "temporaries:",
        "",
        "| ranks | build | runtime | build+compile | values | step 1 | step 2 | held P+O | probe base / fwd_bwd / opt "
        "| pred P / G / O / A / T | build s | step s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rt, pk, pr, pb = r["runtime"], r["peaks"], r["pred"], r["probe"]
        probe = (
            f"{_m(pb['baseline'])} / {_m(pb['regions'].get('fwd_bwd', 0))} / {_m(pb['regions'].get('opt', 0))}"
            f" ({pb['method']})"
            if pb
            else "-"
        )
        ra = r["runtime_anon"]
        phase = [
            f"{_m(pk[p] - rt)} / {_m(r['anon'][p] - ra)}" if not (p == "values" and r["mode"] == "single") else "-"
            for p in PHASES
        ]
        pred = " / ".join(_m(pr[k]) for k in ("params", "grads", "opt", "acts", "temps")) if pr else "-"
        lines.append(
            f"| {r['world']} | {_label(r)} | {_m(rt)} | "
            + " | ".join(phase)
            + f" | {_m(r['held']['params'] + r['held']['opt'])} | {probe} | {pred} | {r['build_s']:.0f} | "
            + " / ".join(f"{s:.1f}" for s in r["step_s"])
            + " |"
        )
    meta2 = next((r for r in rows if r["world"] == 2 and r["mode"].startswith("meta")), None)
    if meta2 is not None and single is not None and meta2["pred"]:
        ratio = meta2["peak"] / single["peak"]
        off = (meta2["peak"] - meta2["runtime"]) / meta2["pred"]["total"] - 1
        probe_off = meta2["probe"]["peak"] / meta2["pred"]["total"] - 1 if meta2["probe"] else float("nan")
        lines += [
            "",
            f"goal: meta-built on 2 ranks <= {GOAL_RATIO} of the single-device peak: {ratio:.2f} "
            f"({'met' if ratio <= GOAL_RATIO else 'NOT met'}); within {GOAL_PRED:.0%} of the prediction: "
            f"RSS - runtime {off:+.0%}, probe {probe_off:+.0%} "
            f"({'met' if abs(off) <= GOAL_PRED else 'NOT met'} by RSS)",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated world sizes")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--no-single", action="store_true", help="skip the single-device baseline")
    ap.add_argument("--hidden", type=int, default=ModelSpec.hidden)
    ap.add_argument("--layers", type=int, default=ModelSpec.layers)
    ap.add_argument("--intermediate", type=int, default=ModelSpec.intermediate)
    ap.add_argument("--heads", type=int, default=ModelSpec.heads)
    ap.add_argument("--vocab", type=int, default=ModelSpec.vocab)
    ap.add_argument("--batch", type=int, default=ModelSpec.batch)
    ap.add_argument("--seq", type=int, default=ModelSpec.seq)
    ap.add_argument(
        "--backend",
        choices=("eager", "inductor"),
        default="eager",
        help="autoshard backend (inductor compiles for minutes per rank on CPU)",
    )
    ap.add_argument("--no-probe", action="store_true", help="skip the memory probe's profiled third step")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    ap.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temp dir)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for name in ("autoshard", "torch", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    spec = ModelSpec(args.hidden, args.layers, args.intermediate, args.heads, args.vocab, args.batch, args.seq)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    worlds = [int(w) for w in args.ranks.split(",") if w]
    if any(spec.batch % w for w in worlds):
        ap.error(f"--batch {spec.batch} must be a multiple of every world size {worlds} (fsdp shards the batch)")
    t_all = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="meta_memory_", dir=args.workdir)
    try:
        ckpt = os.path.join(tmp, "ckpt")
        if "meta-load" in modes:
            size = launch(1, _save_worker, (spec, ckpt), timeout=args.timeout, gloo=False)[0]
            log.info("checkpoint written: %s (%.0f MiB)", ckpt, size / MIB)
        rows = []
        cases = [] if args.no_single else [Case("single", 1, spec, args.backend, ckpt, not args.no_probe)]
        cases += [Case(m, w, spec, args.backend, ckpt, not args.no_probe) for w in worlds for m in modes]
        for case in cases:
            row = run_case(case, args.timeout)
            if row is not None:
                rows.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(format_tables(rows, spec))
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s; case settings: {asdict(spec)}, backend {args.backend}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
