"""Memory truth: the plan's predicted peak memory per device against the peak measured on 2 gloo ranks.

    python benchmarks/memory_truth.py                       # GPT and HF GPT-2, every row, Inductor backend
    python benchmarks/memory_truth.py --model gpt --backend eager
    python benchmarks/memory_truth.py --rows solved,ddp     # a subset of the rows
    python benchmarks/memory_truth.py --model lora          # PEFT LoRA on a stock Llama: frozen base weights
    python benchmarks/memory_truth.py --model hf --layers 4 --vocab 2000 --dropout stock --rows budget --budgets 0.8
                                                            # issue 45's stock GPT-2 (GPT2Config's own dropout)

Each row is one ``autoshard.testing.launch`` of 2 forked gloo ranks (1 thread each; mesh (2,) "dp"): the model is built
with fixed weights, ``autoshard.compile``d (the solved plan, a forced ``recipe=``, or the solved plan under a
``memory_budget`` of 0.9 / 0.85 of the no-budget plan's predicted peak), and trained with
``torch.optim.AdamW(foreach=True)`` (rows ``bf16``: ``mixed_precision="bf16"``, autocast with fp32 master weights) (the
multi-tensor path GPU users get by default) and ``zero_grad(set_to_none=True)``: 2 warm-up steps, then one step measured
on every rank.

Measuring method: ``autoshard.testing.memory_probe.measure_peak``, the PyTorch profiler's CPU memory timeline
(``profile_memory=True`` + ``export_memory_timeline(..raw.json, device="cpu")``): the peak is the largest sum
over categories at one time stamp, over every tensor allocated through c10's CPU allocator (eager ops, Inductor's
compiled code, DTensor local shards, gloo collectives' output tensors) plus the pre-existing tensors the step
touches (parameters, optimizer state, inputs). It was validated on plain eager and ``torch.compile``d code
whose memory is known by arithmetic (``tests/unit/test_memory_probe.py``: an MLP + AdamW, the forward's peak, the
optimizer's peak with its foreach temporaries, to the byte; ``MemTracker`` agrees on eager code). It does not
see memory outside the torch allocator (gloo's own transport buffers) nor tensors the step never touches.
The profiler's categories are exact on eager code; inside compiled graphs it files tensors by guesswork (saved
activations have been seen as "parameter"), so the table also gives direct counts of what the step holds
across steps: this rank's local parameter, gradient and optimizer-state bytes (``to_local()`` nbytes).

Columns (MiB per device; measured = max over the 2 ranks):

- ``pred``: ``plan.peak_memory.total`` and its params / grads / opt / acts;
- ``meas``: the step's measured peak; ``ratio`` = pred / meas; ``in``: the block the peak falls in (``for``ward,
  ``bac``kward, ``opt`` = ``optimizer.step`` + ``zero_grad``); ``fwdpk bwdpk optpk``: each block's own peak;
- measured ``P G O``: direct counts of local parameters, gradients (after backward) and optimizer state;
  measured ``A``: the bytes the forward block allocated and still holds when it ends (saved activations + loss);
- ``at peak``: ``base`` = the pre-existing tensors the step touches (parameters, optimizer state, inputs),
  ``fwd`` = forward allocations still alive, ``grads`` = gradient storages (by address), ``bwd`` = the backward's
  other allocations (temporaries, gathered weights, communication buffers), ``opt`` = the optimizer's;
- the second line: the profiler's own categories at the peak, each rank's peak, compile and step time;
- budget rows: the budget and whether the measured peak is within it; each budget row is run under every backend of
  ``--budget-backends`` (default: Inductor and eager), the plan being the same (the budget is a fraction of the
  no-budget plan's predicted peak, made once under ``--backend``).

``--dropout``: the HF GPT-2's dropout probabilities (``resid_pdrop``, ``embd_pdrop``, ``attn_pdrop``; default 0),
``stock`` for ``GPT2Config``'s own (0.1).

LoRA (``--model lora``): a stock ``transformers`` LlamaForCausalLM (``LORA_CFG``: 2 layers, d 512, ffn 2048, vocab
2048, seq 128, batch ``LORA_BATCH``) wrapped by ``peft.get_peft_model`` with rank-8 adapters on every linear layer
of the blocks; the base weights frozen (``requires_grad=False``), the adapters fp32. Rows: ``full`` (the same
model with every weight trained, for comparison), ``lora`` (solved), ``lora fsdp`` (the base weights sharded over
the 2 ranks), ``bf16 base`` (frozen bf16 base weights, fp32 adapters: the usual fine-tuning setup) and ``budget
1.5`` (solved under a budget of ``LORA_BUDGET`` times the base weights' bytes, which full training's state alone,
16 bytes per parameter, exceeds on one rank and, sharded as far as it goes, on each of the 2). The optimizer is given
every parameter, as a fine-tuning script gives it; it keeps state only for those with a gradient.

Recipes: ``RECIPES`` below (add ``zero1``, ``zero2``, ``hsdp`` there once ``autoshard.config.RECIPES`` knows
them; a recipe the installed autoshard does not know is skipped with a note, not run). A row that fails
prints its error and the table goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from typing import Any

import torch
from torch import nn

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "autoshard-inductor"))

import autoshard  # noqa: E402
from autoshard.errors import LaunchError
from autoshard.ir import repeated_layers  # noqa: E402
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs  # noqa: E402
from autoshard.testing.launch import launch
from autoshard.testing.memory_probe import measure_peak  # noqa: E402

log = logging.getLogger("memory_truth")

MIB = 2**20
WORLD = 2
GPT_CFG = GPTConfig(n_layer=2, d_model=256, n_head=4, vocab=2048, seq_len=128, bias=False)
BATCH = 8
LR = 1e-3
WARMUP = 2

# ---- the recipes measured: extend this list as autoshard gains recipes (zero1, zero2, hsdp: issue 13) ----
RECIPES: tuple[str, ...] = ("ddp", "fsdp", "zero1", "zero2", "hsdp")
BUDGET_FRACTIONS: tuple[float, ...] = (
    0.9,
    0.85,
)  # of the no-budget solved plan's predicted peak (below ~0.82 nothing fits these models on 2 ranks)
LORA_CFG = GPTConfig(
    n_layer=2, d_model=512, n_head=8, vocab=2048, seq_len=128, bias=False
)  # sizes of make_lora's Llama
LORA_BATCH = 4
LORA_BUDGET = 1.5  # the lora budget row's, in base weights' bytes (fp32): 60 MiB
HF_DROPOUT: float | None = 0.0  # the HF GPT-2's dropout (--dropout; None: GPT2Config's own), read by the forked ranks


@dataclasses.dataclass(frozen=True)
class RowSpec:
    model: str  # "gpt" | "hf"
    label: str  # "solved", a recipe name, or "budget 0.8"
    recipe: str | None
    budget: int | None  # bytes
    backend: str
    recompute: bool = False  # every repeated layer's forward run again in the backward (PlanConfig.recompute)
    mixed_precision: bool = False  # autocast to bf16 (PlanConfig.mixed_precision), fp32 master weights and state
    train_all: bool = False  # lora: every weight trained (the base weights are frozen otherwise)
    base_bf16: bool = False  # lora: the frozen base weights in bf16 (the adapters stay fp32)


def make_lora(spec: RowSpec) -> nn.Module:
    """A stock ``LlamaForCausalLM`` of ``LORA_CFG`` under PEFT LoRA (rank 8 on every linear layer of the blocks):
    base weights frozen (bf16 with ``spec.base_bf16``), adapters fp32 (PEFT's ``autocast_adapter_dtype``); with
    ``spec.train_all`` every weight trained."""
    import peft
    import transformers

    c = LORA_CFG
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab,
        hidden_size=c.d_model,
        intermediate_size=4 * c.d_model,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.n_head,
        max_position_embeddings=c.seq_len,
    )
    base = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16 if spec.base_bf16 else torch.float32)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    )
    return model.requires_grad_(True) if spec.train_all else model


def make_model(kind: str, spec: RowSpec | None = None) -> nn.Module:
    """The zoo GPT, or a stock ``transformers`` GPT2LMHeadModel of the same sizes (dropout 0), or (``lora``)
    ``make_lora(spec)``; fixed weights."""
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPT_CFG)
    if kind == "lora":
        return make_lora(spec)
    import transformers

    c = GPT_CFG
    drop = {} if HF_DROPOUT is None else {"resid_pdrop": HF_DROPOUT, "embd_pdrop": HF_DROPOUT, "attn_pdrop": HF_DROPOUT}
    cfg = transformers.GPT2Config(
        n_layer=c.n_layer,
        n_embd=c.d_model,
        n_head=c.n_head,
        vocab_size=c.vocab,
        n_positions=c.seq_len,
        bos_token_id=0,
        eos_token_id=0,
        **drop,
    )
    return transformers.GPT2LMHeadModel(cfg).train()


def global_inputs(kind: str) -> Any:
    tokens, targets = gpt_example_inputs(LORA_CFG, LORA_BATCH) if kind == "lora" else gpt_example_inputs(GPT_CFG, BATCH)
    return (tokens, targets) if kind == "gpt" else {"input_ids": tokens, "labels": tokens.clone()}


def _local_nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def _held(module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's local bytes of parameters, gradients and optimizer state, counted directly."""
    params = list(module.parameters())
    state = sum(_local_nbytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {
        "params": sum(_local_nbytes(p) for p in params),
        "grads": sum(_local_nbytes(p.grad) for p in params),
        "opt": state,
    }


def _row_worker(rank: int, world: int, spec: RowSpec) -> dict[str, Any]:
    """One row on this rank: compile, warm up, measure one step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import record_function

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    inputs = global_inputs(spec.model)
    t0 = time.perf_counter()
    model = make_model(spec.model, spec)
    weights = {
        k: sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad == k) for k in (False, True)
    }  # (global bytes: frozen, trained)
    redo = {"recompute": (repeated_layers(model)[0],)} if spec.recompute else {}
    if spec.mixed_precision:
        redo["mixed_precision"] = "bf16"
    sharded = autoshard.compile(
        model, mesh, inputs, backend=spec.backend, recipe=spec.recipe, memory_budget=spec.budget, **redo
    )
    compile_s = time.perf_counter() - t0
    pieces = sharded.shard_inputs(**inputs) if isinstance(inputs, dict) else sharded.shard_inputs(*inputs)
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR, foreach=True)
    held: dict[str, int] = {}
    grad_ptrs: list[int] = []  # storage addresses, not the tensors: holding them would keep them alive

    def step() -> None:
        if sharded.plan.microbatches > 1:  # gradient accumulation (chosen under a budget): step takes the batch
            with record_function("backward"):
                sharded.step(**inputs) if isinstance(inputs, dict) else sharded.step(*inputs)
        else:
            with record_function("forward"):
                loss = sharded(**pieces) if isinstance(pieces, dict) else sharded(*pieces)
            with record_function("backward"):
                loss.backward()
        held.update(_held(sharded, opt))  # gradients present, optimizer state from the last step
        grad_ptrs[:] = [
            getattr(p.grad, "_local_tensor", p.grad).untyped_storage().data_ptr()
            for p in sharded.parameters()
            if p.grad is not None
        ]
        with record_function("opt"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    t1 = time.perf_counter()
    step()
    step_s = time.perf_counter() - t1
    start = _held(sharded, opt)  # what the step starts from: no gradients (set_to_none), state from the warm-up
    flat = pieces.values() if isinstance(pieces, dict) else pieces
    base = start["params"] + start["opt"] + sum(_local_nbytes(t) for t in flat)
    peak = measure_peak(
        step,
        regions=("forward", "backward", "opt"),
        owners=lambda: {"grads": list(grad_ptrs)},
        baseline=lambda: base,
        attempts=1,
    )  # no re-run: the step is collective on 2 ranks
    pm = sharded.plan.peak_memory
    return {
        "pred": {
            "params": pm.parameters,
            "grads": pm.gradients,
            "opt": pm.optimizer,
            "acts": pm.activations,
            "total": pm.total,
        },
        "recipe": sharded.plan.recipe,
        "peak": peak.peak_bytes,
        "at_peak": dict(peak.by_category),
        "baseline": peak.baseline_bytes,
        "regions": {k: (v.peak_bytes, dict(v.by_category)) for k, v in peak.regions.items()},
        "held": held,
        "owned": dict(peak.owned_at_peak),
        "retained": dict(peak.retained),
        "made_in": dict(peak.made_in_at_peak),
        "method": peak.method,
        "compile_s": compile_s,
        "step_s": step_s,
        "params_placements": sorted(set(map(str, sharded.plan.parameter_placements().values()))),
        "frozen_bytes": weights[False],
        "trained_bytes": weights[True],
    }


def _known_recipes() -> tuple[str, ...]:
    from autoshard.config import RECIPES as known

    return tuple(known)


def run_row(spec: RowSpec, timeout: float) -> dict[str, Any]:
    """The row measured on 2 ranks (the rank with the larger peak reported); a failed launch is tried once more
    (a launch that fails for a reason a re-run may not meet), and an error
    that repeats (an infeasible budget) is returned as the row."""
    t0 = time.perf_counter()
    for attempt in (1, 2):
        try:
            ranks = launch(WORLD, _row_worker, spec, timeout=timeout)
            break
        except LaunchError as e:
            if attempt == 2 or "InfeasibleBudget" in str(e) or "could not plan" in str(e):
                return {"spec": spec, "error": str(e), "wall_s": time.perf_counter() - t0}
            log.warning("%s %s failed (%s); trying once more", spec.model, spec.label, e)
    worst = max(range(WORLD), key=lambda r: ranks[r]["peak"])
    out = dict(ranks[worst])
    out.update(spec=spec, worst_rank=worst, peaks=[r["peak"] for r in ranks], wall_s=time.perf_counter() - t0)
    return out


CAT_SHORT = {
    "parameter": "par",
    "optimizer state": "opt",
    "gradient": "grad",
    "activation": "act",
    "temporary": "tmp",
    "autograd detail": "agd",
    "input": "in",
    "unknown": "unk",
}
HEADER = (
    f"{'model':5} {'row':10} {'be':3} {'plan':6} | {'pred':>6} {'meas':>6} {'ratio':>5} {'in':>3} | "
    f"{'P':>5} {'G':>5} {'O':>5} {'A':>5} pred | {'P':>5} {'G':>5} {'O':>5} {'A':>5} meas | "
    f"{'base':>5} {'fwd':>5} {'grads':>5} {'bwd':>5} {'opt':>5} at peak | {'fwdpk':>5} {'bwdpk':>5} {'optpk':>5} "
    f"| budget"
)


def _m(b: float) -> str:
    return f"{b / MIB:5.1f}"


def format_row(r: dict[str, Any]) -> str:
    """One table row: prediction, measurement, the measured categories side by side, where the peak is made.

    Measured P/G/O are direct counts of this rank's local state; measured A is what the forward block leaves
    allocated when it ends (saved activations + loss). At the peak: ``base`` = pre-existing tensors the step
    touched (parameters, optimizer state, inputs), ``fwd`` / ``bwd`` / ``opt`` = bytes allocated in that block
    still alive (``bwd`` without the gradients, shown as ``grads``)."""
    s: RowSpec = r["spec"]
    name = f"{s.model:5} {s.label:10} {s.backend[:3]:3}"
    if "error" in r:
        return f"{name} ERROR: {r['error'][:400]}"
    p, h, made, reg = r["pred"], r["held"], r["made_in"], r["regions"]
    grads = r["owned"].get("grads", 0)
    phase = max(("forward", "backward", "opt"), key=lambda k: reg.get(k, (0,))[0])
    budget = ""
    if s.budget is not None:
        budget = (
            f"{_m(s.budget).strip()} "
            f"{'within' if r['peak'] <= s.budget else 'OVER by ' + _m(r['peak'] - s.budget).strip()}"
        )
    return (
        f"{name} {r['recipe'] or 'solved':6} | {_m(p['total']):>6} {_m(r['peak']):>6} {p['total'] / r['peak']:5.2f} "
        f"{phase[:3]:>3} | {_m(p['params'])} {_m(p['grads'])} {_m(p['opt'])} {_m(p['acts'])}      | "
        f"{_m(h['params'])} {_m(h['grads'])} {_m(h['opt'])} {_m(r['retained'].get('forward', 0))}      | "
        f"{_m(r['baseline'])} {_m(made.get('forward', 0))} {_m(grads)} {_m(made.get('backward', 0) - grads)} "
        f"{_m(made.get('opt', 0))}         | {_m(reg.get('forward', (0,))[0])} {_m(reg.get('backward', (0,))[0])} "
        f"{_m(reg.get('opt', (0,))[0])} | {budget}"
    )


def format_categories(r: dict[str, Any]) -> str:
    """The profiler's own categories at the peak (reliable on eager code only, see the module docstring)."""
    if "error" in r:
        return ""
    cats = " ".join(f"{CAT_SHORT.get(k, k)} {_m(v).strip()}" for k, v in r["at_peak"].items() if v >= MIB / 20)
    return (
        f"      [{r['method']}] categories at the peak: {cats}; "
        f"ranks' peaks {[round(x / MIB, 1) for x in r['peaks']]}; "
        f"compile {r['compile_s']:.1f} s, step {r['step_s'] * 1e3:.0f} ms; parameter placements "
        f"{' '.join(r['params_placements'])}"
    )


def _print_row(r: dict[str, Any]) -> None:
    print(format_row(r), f"[{r['wall_s']:.0f} s]\n" + format_categories(r), flush=True)


def lora_rows(backend: str, wanted: set[str], timeout: float) -> None:
    """The LoRA rows (module docstring), then what they show: the base weights, the adapters, full training's
    state, and each row's predicted and measured peak against the base weights over the ranks."""
    specs = [
        RowSpec("lora", "full", None, None, backend, train_all=True),
        RowSpec("lora", "lora", None, None, backend),
        RowSpec("lora", "lora fsdp", "fsdp", None, backend),
        RowSpec("lora", "bf16 base", None, None, backend, base_bf16=True),
    ]
    results = []
    for spec in specs:
        if not wanted or spec.label in wanted:
            results.append(run_row(spec, timeout))
            _print_row(results[-1])
    lora = next((r for r in results if r["spec"].label == "lora" and "error" not in r), None)
    if lora is not None and (not wanted or "budget" in wanted):
        budget = int(LORA_BUDGET * lora["frozen_bytes"])
        results.append(run_row(RowSpec("lora", f"budget {LORA_BUDGET}", None, budget, backend), timeout))
        _print_row(results[-1])
    if lora is None:
        return
    frozen, trained = lora["frozen_bytes"], lora["trained_bytes"]
    state = 16 * (frozen + trained) // 4  # fp32 weights, gradients, AdamW's two moments: 16 bytes per parameter
    print(
        f"lora: base weights {_m(frozen).strip()} MiB frozen, adapters {_m(trained).strip()} MiB; full training's "
        f"state {_m(state).strip()} MiB on one rank, {_m(state / WORLD).strip()} MiB per rank sharded over {WORLD}"
    )
    for r in (r for r in results if "error" not in r):
        base = f" (base / {WORLD} = {_m(r['frozen_bytes'] / WORLD)})" if r["frozen_bytes"] else ""
        print(
            f"  {r['spec'].label:10} predicted {_m(r['pred']['total'])} measured {_m(r['peak'])} ratio "
            f"{r['pred']['total'] / r['peak']:.2f}; predicted params {_m(r['pred']['params'])}{base} acts "
            f"{_m(r['pred']['acts'])}"
        )


def main(argv: list[str] | None = None) -> int:
    global GPT_CFG, HF_DROPOUT  # --layers, --vocab, --dropout: read by the forked ranks (make_model, global_inputs)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("gpt", "hf", "both", "lora"), default="both")
    ap.add_argument("--backend", choices=("inductor", "eager"), default="inductor")
    ap.add_argument(
        "--budget-backends",
        default="inductor,eager",
        help="comma-separated backends each budget row is run under (the same plan under each)",
    )
    ap.add_argument("--vocab", type=int, default=GPT_CFG.vocab, help="vocabulary of both models")
    ap.add_argument("--dropout", default="0", help="the HF GPT-2's dropout: a probability, or 'stock' (GPT2Config's)")
    ap.add_argument(
        "--rows",
        default="",
        help="comma-separated subset of: solved, recompute, bf16, 'bf16 fsdp', "
        "<recipes>, budget; with --model lora: full, lora, 'lora fsdp', 'bf16 base', budget",
    )
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--layers", type=int, default=GPT_CFG.n_layer, help="transformer layers of both models")
    ap.add_argument(
        "--budgets",
        default=",".join(map(str, BUDGET_FRACTIONS)),
        help="budget rows: fractions of the no-budget plan's predicted peak",
    )
    args = ap.parse_args(argv)
    GPT_CFG = dataclasses.replace(GPT_CFG, n_layer=args.layers, vocab=args.vocab)
    HF_DROPOUT = None if args.dropout == "stock" else float(args.dropout)
    budget_backends = [b for b in args.budget_backends.split(",") if b]
    fractions = [float(x) for x in args.budgets.split(",") if x]
    logging.basicConfig(level=logging.WARNING)
    wanted = set(filter(None, args.rows.split(",")))
    known = _known_recipes()
    kinds = ("gpt", "hf") if args.model == "both" else (args.model,)
    what = (
        f"LoRA on a stock Llama of {LORA_CFG}, batch {LORA_BATCH}"
        if args.model == "lora"
        else f"GPT {GPT_CFG}, batch {BATCH}, HF dropout {'stock' if HF_DROPOUT is None else HF_DROPOUT}"
    )
    print(
        f"memory truth: {WORLD} gloo ranks, mesh (2,) dp, backend {args.backend}, AdamW foreach, {what}; MiB per device"
    )
    print(HEADER)
    t_all = time.perf_counter()
    if args.model == "lora":
        lora_rows(args.backend, wanted, args.timeout)
        kinds = ()
    for kind in kinds:
        results = []
        specs = [
            RowSpec(kind, "solved", None, None, args.backend),
            RowSpec(kind, "recompute", None, None, args.backend, recompute=True),
            RowSpec(kind, "bf16", None, None, args.backend, mixed_precision=True),
            RowSpec(kind, "bf16 fsdp", "fsdp", None, args.backend, mixed_precision=True),
        ]
        for rec in RECIPES:
            if rec in known:
                specs.append(RowSpec(kind, rec, rec, None, args.backend))
            else:
                print(f"{kind:3s} {rec:11s} skipped: recipe {rec!r} not in autoshard.config.RECIPES {known}")
        for spec in specs:
            if wanted and spec.label not in wanted:
                continue
            r = run_row(spec, args.timeout)
            results.append(r)
            print(format_row(r), f"[{r['wall_s']:.0f} s]\n" + format_categories(r), flush=True)
        base = next((r for r in results if r["spec"].label == "solved" and "error" not in r), None)
        if base is None or (wanted and "budget" not in wanted):
            continue
        for frac in fractions:
            for backend in budget_backends:
                spec = RowSpec(kind, f"budget {frac}", None, int(frac * base["pred"]["total"]), backend)
                r = run_row(spec, args.timeout)
                print(format_row(r), f"[{r['wall_s']:.0f} s]\n" + format_categories(r), flush=True)
    print(f"total {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
