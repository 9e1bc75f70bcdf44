"""The training loops people use, each against its own data-parallel run on the same ranks: the table of
``docs/benchmarks.md`` ("Training loops").

    python benchmarks/integrations.py                # every row (about 5 minutes on 2 quiet cores)
    python benchmarks/integrations.py --rows trainer sft

Each row launches the loop's example twice under torchrun (or ``accelerate launch``) on CPU over gloo: once with
``autoshard.compile`` (the plan named in the row) and once as the loop's own DDP (``--reference``), and reports the
largest relative difference of the per-step loss (and gradient norm, evaluation loss where the loop logs them)
and the wall time of each launch (planning and compiling included, which the reference does not do).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

STEP_LINE = re.compile(r"^step (\d+) loss ([-0-9.e]+) ", re.M)
ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "trainer_hf.py"
ACCELERATE = ROOT / "examples" / "accelerate_train.py"
LIGHTNING = ROOT / "examples" / "lightning_train.py"

# row -> (script, launcher, processes, autoshard args, reference args, keys compared)
ROWS = {
    "trainer": (
        TRAINER,
        "torchrun",
        2,
        ["--steps", "12", "--grad-accum", "2", "--eval-steps", "6"],
        ["--reference", "--steps", "12", "--grad-accum", "2", "--eval-steps", "6"],
    ),
    "trainer fsdp+tp 2x2": (
        TRAINER,
        "torchrun",
        4,
        ["--steps", "12", "--grad-accum", "2", "--eval-steps", "6", "--mesh", "2x2", "--recipe", "fsdp+tp"],
        ["--reference", "--steps", "12", "--grad-accum", "2", "--eval-steps", "6"],
    ),
    "sft": (
        TRAINER,
        "torchrun",
        2,
        ["--sft", "--steps", "8", "--recipe", "fsdp"],
        ["--sft", "--reference", "--steps", "8"],
    ),
    "lora": (
        TRAINER,
        "torchrun",
        2,
        ["--lora", "--steps", "8", "--recipe", "fsdp"],
        ["--lora", "--reference", "--steps", "8"],
    ),
    "accelerate": (ACCELERATE, "accelerate", 2, [], ["--reference"]),
    "lightning": (LIGHTNING, "torchrun", 2, [], ["--ddp"]),
}


def launch(script: Path, launcher: str, nproc: int, args: list[str]) -> tuple[str, float]:
    if launcher == "accelerate":
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(nproc),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(script),
            *args,
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(script),
            *args,
        ]
    t0 = time.perf_counter()
    out = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return out.stdout, time.perf_counter() - t0


def series(stdout: str) -> dict[str, dict[int, float]]:
    """Per key (loss, grad_norm, eval_loss), step -> value, from the example's last JSON line."""
    for line in reversed(stdout.splitlines()):
        head, _, body = line.partition(" ")
        if head == "history":
            out: dict[str, dict[int, float]] = {}
            for h in json.loads(body):
                for k in ("loss", "grad_norm", "eval_loss"):
                    if k in h:
                        out.setdefault(k, {})[h["step"]] = h[k]
            return out
        if head == "losses":
            return {"loss": dict(enumerate(json.loads(body)))}
    steps = {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(stdout)}  # examples/lightning_train.py
    if steps:
        return {"loss": steps}
    raise SystemExit(f"no history/losses line in:\n{stdout[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    args = ap.parse_args()
    print("| loop | processes | plan | steps | largest relative difference | keys | autoshard s | reference s |")
    print("|---|---:|---|---:|---:|---|---:|---:|")
    for row in args.rows:
        script, launcher, nproc, mine, ref = ROWS[row]
        got, t_got = launch(script, launcher, nproc, mine)
        want, t_want = launch(script, launcher, nproc, ref)
        a, b = series(got), series(want)
        worst = 0.0
        for key in b:
            assert a.get(key, {}).keys() == b[key].keys(), (row, key, a.get(key), b[key])
            worst = max([worst] + [abs(a[key][s] - v) / abs(v) for s, v in b[key].items()])
        plan = mine[mine.index("--recipe") + 1] if "--recipe" in mine else "solved"
        steps = len(b["loss"])
        print(
            f"| {row} | {nproc} | {plan} | {steps} | {worst:.1e} | {', '.join(b)} | {t_got:.0f} | {t_want:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
