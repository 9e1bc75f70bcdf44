"""One device, one GPT training step: autoshard (1-device mesh, Inductor -> Triton) against torch.compile.

    python benchmarks/gpu_single.py                      # on a CUDA machine: bf16 GPT sized for an 80 GB GPU
    python benchmarks/gpu_single.py --size small         # a smaller GPT (any GPU)
    python benchmarks/gpu_single.py --device cpu --size tiny --steps 3   # the same code path on CPU (smoke run)

A step is forward, backward and AdamW (foreach, ``zero_grad(set_to_none=True)``), on the same bf16 weights and
the same batch in both variants:

- ``torch.compile``: ``torch.compile(model)`` (Inductor, default mode), eager AdamW;
- ``autoshard``: ``autoshard.compile(model, mesh, ...)`` on a 1-device mesh: the joint forward+backward graph
  traced, planned (nothing to shard), split by the partitioner and compiled by Inductor (Triton kernels on a
  GPU), eager AdamW over its parameters.

Both run in this process, one after the other, ``autoshard.testing.bench.time_steps`` (warm-up untimed, median, p10,
p90, CUDA synchronised at the end of every step). Printed: median step, autoshard / torch.compile, and MFU =
model FLOPs per step / step time / the device's dense bf16 peak, with model FLOPs the usual transformer count
72 B s L h^2 (1 + s / 6h + V / 12hL) (forward + backward, no recomputation, causal attention counted whole).
Goals (issue 5): ratio <= 1.02; MFU >= 45% on an H100-class GPU. No goal is asserted here.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import autoshard
from autoshard.cluster.presets import get_cluster
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.testing.bench import Timing, time_steps

log = logging.getLogger("gpu_single")


@dataclass(frozen=True)
class Size:
    cfg: GPTConfig
    batch: int


SIZES = {
    # ~1.3B parameters, 2k context: bf16 weights, grads and AdamW state ~10 GB, activations ~45 GB at batch 8
    "h100": Size(GPTConfig(n_layer=24, d_model=2048, n_head=16, vocab=32768, seq_len=2048, bias=False), 8),
    "small": Size(GPTConfig(n_layer=12, d_model=1024, n_head=16, vocab=32768, seq_len=1024, bias=False), 8),
    "tiny": Size(GPTConfig(n_layer=2, d_model=128, n_head=4, vocab=512, seq_len=64, bias=False), 4),
}


def model_flops(cfg: GPTConfig, batch: int) -> float:
    """Forward + backward FLOPs of one step (matmuls only)."""
    h, s, n_layer, v = cfg.d_model, cfg.seq_len, cfg.n_layer, cfg.vocab
    return 72.0 * batch * s * n_layer * h * h * (1 + s / (6 * h) + v / (12 * h * n_layer))


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """The device's dense peak for ``dtype`` from autoshard's profiles (H100/H200 by name), else 0."""
    if device.type != "cuda":
        return 0.0, "CPU: no MFU (a smoke run of the code path)"
    name = torch.cuda.get_device_name(device)
    preset = "h200" if "H200" in name else "h100-sxm" if "H100" in name else "a100-80gb" if "A100" in name else ""
    if not preset:
        return 0.0, f"{name} (no profile: MFU not computed)"
    return get_cluster(preset).device.peak_flops[str(dtype).replace("torch.", "")], f"{name} -> {preset}"


def _make(size: Size, device: torch.device, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    return GPT(size.cfg).to(device=device, dtype=dtype)


def _step_fn(forward: Any, params: Any, inputs: tuple[torch.Tensor, ...], device: torch.device) -> Any:
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    def step() -> float:
        loss = forward(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return float(loss.detach())

    return step


def run(size: Size, device: torch.device, dtype: torch.dtype, steps: int, warmup: int) -> dict[str, Any]:
    """Both variants' timings and first-step losses (this process must hold a 1-rank process group)."""
    tokens, targets = gpt_example_inputs(size.cfg, size.batch)
    inputs = (tokens.to(device), targets.to(device))
    out: dict[str, Any] = {}

    model = _make(size, device, dtype)
    compiled = torch.compile(model)
    t0 = time.perf_counter()
    step = _step_fn(compiled, model.parameters(), inputs, device)
    out["torch.compile first loss"] = step()
    out["torch.compile build+first s"] = time.perf_counter() - t0
    out["torch.compile"] = time_steps(step, steps, warmup, barrier=False)
    del model, compiled, step
    if device.type == "cuda":
        torch.cuda.empty_cache()

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
    model = _make(size, device, dtype)
    t0 = time.perf_counter()
    cluster = "h100-sxm" if device.type == "cuda" else "cpu"
    sharded = autoshard.compile(model, mesh, inputs, backend="inductor", cluster=cluster)
    step = _step_fn(sharded, sharded.parameters(), sharded.shard_inputs(*inputs), device)
    out["autoshard first loss"] = step()
    out["autoshard build+first s"] = time.perf_counter() - t0
    out["autoshard"] = time_steps(step, steps, warmup, barrier=False)
    out["triton kernels"] = _triton_kernels(sharded)
    return out


def _triton_kernels(sharded: Any) -> int:
    """How many Triton kernels the compiled forward and backward define (0 on CPU: C++ kernels there)."""
    program = sharded._program
    total = 0
    for fn in (program._fw, program._bw):
        src = getattr(fn, "source_code", "") or ""
        total += src.count("@triton.jit")
    return total


def report(out: dict[str, Any], size: Size, device: torch.device, dtype: torch.dtype) -> str:
    ta: Timing = out["autoshard"]
    tc_: Timing = out["torch.compile"]
    flops = model_flops(size.cfg, size.batch)
    peak, peak_src = peak_flops(device, dtype)
    lines = [
        "| variant | median ms | p10-p90 ms | / torch.compile | MFU | first loss | build + first step s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, t in (("torch.compile", tc_), ("autoshard", ta)):
        mfu = f"{flops / t.median_s / peak:.1%}" if peak else "-"
        lines.append(
            f"| {name} | {t.median_s * 1e3:.2f} | {t.p10_s * 1e3:.2f}-{t.p90_s * 1e3:.2f} | "
            f"{t.median_s / tc_.median_s:.3f} | {mfu} | {out[name + ' first loss']:.5f} | "
            f"{out[name + ' build+first s']:.1f} |"
        )
    lines.append(
        f"\nmodel FLOPs per step {flops / 1e9:.1f} GFLOP; peak {peak / 1e12:.1f} TFLOP/s ({peak_src}); "
        f"Triton kernels in autoshard's program: {out['triton kernels']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="default: h100 on CUDA, tiny on CPU")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "gpu_single: --device cuda asked for, but CUDA is not available here (use --device cpu for a smoke run)"
        )
    size = SIZES[args.size or ("h100" if device.type == "cuda" else "tiny")]
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    from torch.distributed import FileStore

    store = FileStore(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gpu_single_{os.getpid()}"), 1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1, store=store)
    try:
        c = size.cfg
        print(
            f"# one {device.type} device ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
            f"torch {torch.__version__}: GPT {c.n_layer} layers, d_model {c.d_model}, {c.n_head} heads, vocab "
            f"{c.vocab}, seq {c.seq_len}, batch {size.batch}, {args.dtype}; median of {args.steps} steps after "
            f"{args.warmup} warm-up\n"
        )
        out = run(size, device, dtype, args.steps, args.warmup)
        print(report(out, size, device, dtype))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
