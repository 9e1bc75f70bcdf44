"""A model whose training state does not fit the GPU, built on the meta device, trained on one GPU.

    python benchmarks/gpu_meta_offload.py                          # on a CUDA machine: a ~5 B Llama-shaped model
    python benchmarks/gpu_meta_offload.py --device cpu --layers 2 --hidden 256 --ffn 512 --vocab 1024 --seq 64 \
        --offload optimizer --budget 1GB                           # the same code path on CPU (smoke run)

A stock Hugging Face ``LlamaForCausalLM`` is built under ``torch.device("meta")`` (no values anywhere), compiled
by ``autoshard.compile`` on a 1-device mesh with bf16 mixed precision and a ``memory_budget`` below what its
training state needs on the device (fp32 masters, gradients and AdamW moments: 16 bytes per parameter), so the
solver must offload; the rank allocates only what the plan keeps, ``init_weights`` gives the values, and a few
AdamW steps run (the offloaded masters are stepped in host memory). Printed side by side: the plan's predicted
peak and step time against the measured peak (``torch.cuda.max_memory_allocated``) and the median step, tokens/s
and MFU (model FLOPs 6 N per token plus attention, over the device's dense bf16 peak).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard.cluster.presets import get_cluster
from autoshard.notation import format_bytes

log = logging.getLogger("gpu_meta_offload")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget", default="60GB")
    ap.add_argument("--offload", default="auto")
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--foreach-adamw",
        action="store_true",
        help="torch's default AdamW (per-tensor kernels on CPU) instead of fused=True",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(args.device, (1,), mesh_dim_names=("dp",))
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
        # torch 2.11 (the GPU machines) lacks DTensor rules that take HF's masked SDPA on CUDA (cuDNN's
        # drops the mask, the efficient kernel's backward has an output without metadata): eager attention
        attn_implementation="eager" if args.device == "cuda" else "sdpa",
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = dict(input_ids=ids.to(args.device), labels=ids.to(args.device))
    cluster = "cpu"  # a 1-device cluster of the GPU's preset: the mesh has one device
    if args.device == "cuda":
        cluster = "h200:1x1" if "H200" in torch.cuda.get_device_name() else "h100-sxm:1x1"
    log.info(
        "%.2f B parameters on meta; training state %s (16 B/parameter), budget %s",
        n / 1e9,
        format_bytes(16 * n),
        args.budget,
    )
    t0 = time.perf_counter()
    sharded = autoshard.compile(
        model,
        mesh,
        example_inputs=batch,
        cluster=cluster,
        mixed_precision="bf16",
        memory_budget=args.budget,
        offload=args.offload,
        backend=args.backend,
    )
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    sharded.init_weights(seed=0)
    t_init = time.perf_counter() - t0
    # fused=True: one pass over each tensor on the host too (torch's CPU default runs a kernel per operation)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-5, fused=not args.foreach_adamw)
    times, losses, opt_times = [], [], []
    for _ in range(args.steps):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = sharded.step(**batch)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t_opt = time.perf_counter()
        opt.step()
        opt_times.append(time.perf_counter() - t_opt)
        opt.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
        log.info("step %d loss %.4f %.2f s (optimizer.step %.2f s)", len(times), losses[-1], times[-1], opt_times[-1])
    plan = sharded.plan
    step = statistics.median(times[1:] if len(times) > 1 else times)
    tokens = args.batch * args.seq
    flops = 6 * n * tokens + 12 * args.layers * args.hidden * args.seq * tokens
    peak_flops = get_cluster(cluster).device.peak_flops.get("bfloat16", 0.0)
    measured = torch.cuda.max_memory_allocated() if args.device == "cuda" else 0
    predicted = plan.peak_memory.total
    offloaded = sum(1 for t in plan.stages[0].tensors if t.role == "parameter" and t.offload not in ("", "none"))
    print(
        f"\n| {n / 1e9:.2f} B parameters, {args.layers} layers, seq {args.seq} x batch {args.batch}, "
        f"budget {args.budget}, device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'} |  |"
    )
    print("|---|---|")
    print(
        f"| parameters offloaded (masters + AdamW on the host) | {offloaded} of "
        f"{sum(1 for t in plan.stages[0].tensors if t.role == 'parameter')} |"
    )
    print(
        f"| device peak: predicted / measured | {format_bytes(predicted)} / {format_bytes(measured)} "
        f"({measured / max(predicted, 1):.3f}) |"
    )
    print(f"| host memory (offloaded state), predicted | {format_bytes(plan.peak_memory.host)} |")
    print(
        f"| step: predicted / measured (median of {max(len(times) - 1, 1)}) | {plan.step_time_s:.3f} s / "
        f"{step:.3f} s ({step / max(plan.step_time_s, 1e-9):.2f}x) |"
    )
    print(
        f"| of which optimizer.step (host AdamW, fused={not args.foreach_adamw}) | "
        f"{statistics.median(opt_times[1:] if len(opt_times) > 1 else opt_times):.3f} s |"
    )
    print(f"| tokens/s | {tokens / step:.0f} |")
    print(
        f"| MFU (bf16 peak {peak_flops / 1e12:.0f} TFLOP/s) | "
        f"{flops / step / peak_flops * 100 if peak_flops else float('nan'):.1f}% |"
    )
    print(f"| compile / init_weights | {t_compile:.1f} s / {t_init:.1f} s |")
    print(f"| losses | {', '.join(f'{x:.4f}' for x in losses)} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
