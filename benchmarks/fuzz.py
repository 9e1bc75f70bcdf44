"""The model fuzzer (issue 32): random small models planned, trained on a simulated mesh and compared with one device.

    python benchmarks/fuzz.py --cases 200 --seed 0            # cases 0..199 of seed 0, two at a time
    python benchmarks/fuzz.py --seed 0 --only 17              # one case again (what a failure line prints)
    python benchmarks/fuzz.py --seed 0 --only 17 --detail     # ... with its traceback or every mismatch
    python benchmarks/fuzz.py --cases 50 --seed 3 --all       # a line for every case, not only the failures
    python benchmarks/fuzz.py --cases 40 --seed 0 --autotune 3  # each compiled with autotune=3 (k-best plans run)
    python benchmarks/fuzz.py --cases 40 --seed 0 --experts 3   # each with a mixture of 3 experts before its head
    python benchmarks/fuzz.py --cases 200 --seed 0 --no-random  # the cases as drawn before dropout and routers

Each case (``autoshard/testing/fuzz_cases.py``) is drawn from (seed, index): a mesh of (2,), (4,), (2, 2) or (2, 1, 2),
a stack of blocks drawn from the ops users train, widths that mesh axes often do not divide, a scalar loss, and
compile options (a recipe, an input constraint, a memory budget, a cluster; ``--autotune k`` adds ``autotune=k`` to
every case: the solver's k best plans and the recipes are compiled, run and timed, the fastest kept; ``--experts e``
a mixture of ``e`` experts before the output layer). Since issue 43 a case may also hold a dropout (p 0.1 or 0)
and a sampled router, drawn from a stream of their own (``--no-random`` leaves them out: each case as it was
drawn before). It is trained 3 AdamW steps, ``torch.manual_seed`` set before each, on one device and, compiled
by ``autoshard.compile``, under ``LocalTensorMode`` on its mesh (every rank in this process); loss per step, first-step
gradients and final parameters are compared. Outcomes: ok; refused (planning raised an autoshard error saying what it
refused); failures: crash-planning, crash-running, mismatch. Every failure is printed as one line ending in its
reproducer; then the summary (cases, ok, refused, failures by kind, seconds). The cases run in two forked processes of
one thread each (``--jobs 1``: in this process). Exit status 1 when any case failed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time

from autoshard.testing.fuzz import FuzzResult, run_case
from autoshard.testing.fuzz_cases import FuzzCase, describe, draw_case, reproducer, without_random


def _case(seed: int, index: int, extra: dict) -> FuzzCase:
    plain = extra.get("no_random", False)
    case = dataclasses.replace(draw_case(seed, index), **{k: v for k, v in extra.items() if k != "no_random"})
    return without_random(case) if plain else case


def _line(r: FuzzResult, extra: dict) -> str:
    case = _case(r.seed, r.index, extra)
    return f"{r.kind:<14} case {r.index:<4} {r.seconds:5.1f}s  {describe(case)}  | {r.message}  | {reproducer(case)}"


def _run(rank: int, world: int, arg: tuple[int, list[int], bool, bool, dict]) -> list[FuzzResult]:
    seed, indices, show_all, detail, extra = arg
    if world > 1:
        import torch

        torch.set_num_threads(1)
    out = []
    for i in indices[rank::world]:
        r = run_case(_case(seed, i, extra))
        if r.failed or show_all:
            print(_line(r, extra), flush=True)
        if detail and r.detail:
            print(r.detail, flush=True)
        out.append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100, help="run cases 0 .. N-1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", type=int, nargs="+", help="run these case indices only")
    ap.add_argument("--jobs", type=int, choices=(1, 2), default=2)
    ap.add_argument("--all", action="store_true", help="a line for every case")
    ap.add_argument("--detail", action="store_true", help="print each failure's traceback or mismatches")
    ap.add_argument("--autotune", type=int, default=None, help="compile every case with autotune=K")
    ap.add_argument("--experts", type=int, default=None, help="a mixture of E experts before every case's head")
    ap.add_argument(
        "--no-random",
        action="store_true",
        help="no dropout or sampled-router blocks: each case as drawn before they were (issue 43)",
    )
    args = ap.parse_args()
    indices = list(args.only) if args.only else list(range(args.cases))
    start = time.perf_counter()
    extra = {
        k: v for k, v in (("autotune", args.autotune), ("experts", args.experts), ("no_random", args.no_random)) if v
    }
    arg = (args.seed, indices, args.all or bool(args.only), args.detail, extra)
    if args.jobs == 1 or len(indices) == 1:
        results = _run(0, 1, arg)
    else:
        from autoshard.testing.launch import launch

        results = [r for part in launch(2, _run, arg, gloo=False, timeout=120.0 * len(indices)) for r in part]
    kinds = collections.Counter(r.kind for r in results)
    failed = {k: n for k, n in sorted(kinds.items()) if k not in ("ok", "refused")}
    print(
        f"seed {args.seed}: {len(results)} cases, {kinds['ok']} ok, {kinds['refused']} refused, "
        f"{sum(failed.values())} failed {failed or ''} in {time.perf_counter() - start:.0f} s"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
