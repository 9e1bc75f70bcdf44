"""The path of a call, measured: every autoshard function the mesh is handed to, from ``autoshard.compile`` to the
first training step, in call order.

    python benchmarks/call_path.py            # the walk's stops, modules and climbs; --list prints every stop

Two gloo ranks (``autoshard.testing.launch``) compile the zoo GPT (2 layers) on a ("dp",) mesh with the eager
backend and train one step; rank 0 records, with ``sys.setprofile``, each call of an ``autoshard`` function that
receives the mesh as an argument, whether the mesh itself or a value holding it (``PlanRequest.mesh``), at its
first such call (a pass called once per node is one stop). Counted:

- **stops**: the functions, in the order of their first call;
- **modules**: the distinct modules among them;
- **climbs**: calls into a module that is still on the call stack, from a module it called (a callback, or a
  helper that calls back up: ``X -> Y -> X``). Returning from a helper and going on is not a climb;
- **later calls**: calls into a module the walk had already left, other than the one it just came from, counted
  in call order whether or not the module is still on the stack (the coarser count the first walks used: a
  module that calls a helper and then calls its own next function counts here);
- **api entries**: calls into ``autoshard/api.py`` (the front door: once).

The counts describe the code's structure, not its speed; they are the same on any machine.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

import autoshard
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.testing.launch import launch

CFG = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, seq_len=16, bias=False)


def _holds(value: Any, mesh: Any) -> bool:
    return value is mesh or getattr(value, "mesh", None) is mesh


def _climbs_back(frame: Any, module: str) -> bool:
    """Whether ``module`` is being called from another module while one of its own functions is still running."""
    chain = []
    f = frame.f_back
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name.startswith("autoshard"):
            chain.append(name)
        f = f.f_back
    return bool(chain) and chain[0] != module and module in chain[1:]


def _walk(rank: int, world: int, arg: Any) -> list[tuple[str, str, bool]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = GPT(CFG)
    inputs = gpt_example_inputs(CFG, 4)
    stops: list[tuple[str, str, bool]] = []
    seen: set[tuple[str, str]] = set()

    def profile(frame: Any, event: str, _: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("autoshard"):
            return
        code = frame.f_code
        params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(p != "self" and _holds(frame.f_locals.get(p), mesh) for p in params):
            stop = (module, code.co_qualname if hasattr(code, "co_qualname") else code.co_name)
            if stop not in seen:
                seen.add(stop)
                stops.append((*stop, _climbs_back(frame, module)))

    if rank == 0:
        sys.setprofile(profile)
    try:
        sharded = autoshard.compile(model, mesh, inputs, backend="eager")
        sharded.step(*inputs)
    finally:
        sys.setprofile(None)
    return stops


def measure(stops: list[tuple[str, str, bool]]) -> dict[str, int]:
    """The walk's counts (see the module docstring)."""
    modules = [m for m, _, _ in stops]
    seen: set[str] = set()
    later = 0
    for i, m in enumerate(modules):
        if m in seen and i and modules[i - 1] != m:
            later += 1
        seen.add(m)
    return {
        "stops": len(stops),
        "modules": len(set(modules)),
        "climbs": sum(1 for _, _, back in stops if back),
        "later calls": later,
        "api entries": sum(1 for i, m in enumerate(modules) if m == "autoshard.api" and (not i or modules[i - 1] != m)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print every stop")
    args = parser.parse_args()
    stops = launch(2, _walk, timeout=600)[0]
    if args.list:
        for module, fn, back in stops:
            print(f"{module}: {fn}" + ("   <- climbs back" if back else ""))
    for k, v in measure(stops).items():
        print(f"{k:12s} {v}")


if __name__ == "__main__":
    main()
