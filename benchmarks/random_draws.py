"""What one device's random numbers cost a sharded step: stock GPT-2 with its default dropout against dropout 0.

    python benchmarks/random_draws.py                       # 2 gloo ranks, dp=2, Inductor, batch 8 x 128
    python benchmarks/random_draws.py --backend eager --layers 4 --hidden 512

Each rank draws every dropout mask whole and keeps its piece (docs/guide/api.md, "Random numbers"). Printed, from
one launch of 2 forked gloo ranks (mesh (2,) "dp", the batch split on it): the median step (10 timed steps after
2 warm-up steps) with dropout 0.1 (GPT-2's default) drawn ``random="exact"`` (the default) and ``"local"`` (each
rank draws only its piece), and with dropout 0, and, for the masks of one
step, the time to draw them whole (what each rank does) against drawing only this rank's pieces (what drawing
without one device's numbers would cost), each the median of 10 repetitions. The share of the step the exactness
costs is (whole - pieces) / step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import autoshard
from autoshard.rules.random_draws import DRAW
from autoshard.testing.bench import time_steps
from autoshard.testing.launch import launch


def _model(layers: int, hidden: int, dropout: float) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers,
        n_embd=hidden,
        n_head=8,
        vocab_size=1024,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return GPT2LMHeadModel(config).train()


def _draw_times(sharded: Any, world: int) -> tuple[float, float]:
    """(whole, pieces): seconds to draw one step's masks whole, and only a 1/world piece of each."""
    draws = [n for n in sharded._program.fw_gm.graph.nodes if n.op == "call_function" and n.target is DRAW]

    def run(piece: bool) -> float:
        samples = []
        for _ in range(10):
            started = time.perf_counter()
            for n in draws:
                kind, shape, params, dtype, device = n.args[:5]
                shape = [shape[0] // world, *shape[1:]] if piece else shape
                DRAW(kind, shape, params, dtype, device)
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)

    return run(False), run(True)


def _worker(rank: int, world: int, arg: tuple) -> dict[str, Any]:
    layers, hidden, seq, backend = arg
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ids = torch.randint(0, 1024, (8, seq), generator=torch.Generator().manual_seed(0))
    out: dict[str, Any] = {}
    for name, dropout, mode in (("exact", 0.1, "exact"), ("local", 0.1, "local"), ("none", 0.0, "exact")):
        sharded = autoshard.compile(
            _model(layers, hidden, dropout),
            mesh,
            dict(input_ids=ids, labels=ids),
            backend=backend,
            constraints={"inputs": {"dp": Shard(0)}},
            random=mode,
        )
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-4)

        def step(sharded: Any = sharded, opt: torch.optim.Optimizer = opt) -> float:
            loss = sharded.step(input_ids=ids, labels=ids)
            loss = getattr(loss, "loss", loss)
            opt.step()
            opt.zero_grad()
            return float(loss)

        timing = time_steps(step, steps=10, warmup=2, group=mesh.get_group())
        out[name] = timing.median_s
        if name == "exact":
            out["draws"] = _draw_times(sharded, world)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--backend", default="inductor", choices=("inductor", "eager"))
    args = ap.parse_args()
    r = launch(2, _worker, (args.layers, args.hidden, args.seq, args.backend), timeout=1800)[0]
    whole, pieces = r["draws"]
    print(f"GPT-2 {args.layers} layers x {args.hidden}, batch 8 x {args.seq}, 2 gloo ranks (dp), {args.backend}")
    print(
        f"step, dropout 0.1 random='exact': {r['exact'] * 1e3:.2f} ms, random='local': {r['local'] * 1e3:.2f} ms "
        f"(exact / local {r['exact'] / r['local']:.3f}); dropout 0: {r['none'] * 1e3:.2f} ms"
    )
    print(
        f"one step's masks drawn whole: {whole * 1e3:.2f} ms, as pieces: {pieces * 1e3:.2f} ms; exactness costs "
        f"{(whole - pieces) * 1e3:.2f} ms = {(whole - pieces) / r['exact'] * 100:.1f}% of the step"
    )


if __name__ == "__main__":
    main()
