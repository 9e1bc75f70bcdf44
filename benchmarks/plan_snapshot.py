"""The zoo's plans as JSON, to show that a refactor changes no plan: write them, then compare two snapshots.

    python benchmarks/plan_snapshot.py --out /tmp/before              # on the old commit
    python benchmarks/plan_snapshot.py --out /tmp/after --compare /tmp/before

Every zoo model (``autoshard models``) on the meshes (8,), (8, 8) and (16, 8, 8) of h100-sxm nodes of 8, planned
through the public offline path (``autoshard.plan(name, cluster=..., mesh=...)``, global batch = the mesh's
size, the model's default sequence), the recipes solved alongside; a plan that does not fit (or that the solver
cannot find in its time limit) is its error message. The JSON written is ``Plan.to_json()`` without wall-clock
fields (the solver's ``wall_s``); ``--compare`` reports each plan that differs (the first differing key) and
exits 1 if any does.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

MESHES = ((8,), (8, 8), (16, 8, 8))
WALL_CLOCK = ("wall_s",)


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in WALL_CLOCK}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if type(a) is not type(b):
        return f"{path or '.'}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: only in {'after' if k not in a else 'before'}"
            found = _first_difference(a[k], b[k], f"{path}.{k}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def snapshot(out: Path, models: list[str]) -> None:
    import autoshard
    from autoshard.errors import SolverTimeout

    out.mkdir(parents=True, exist_ok=True)
    for name in models:
        for shape in MESHES:
            world = math.prod(shape)
            t0 = time.perf_counter()
            try:
                plan = autoshard.plan(name, mesh=shape, cluster=f"h100-sxm:{world // 8}x8", global_batch=world)
            except (ValueError, SolverTimeout) as e:  # does not fit, or no plan in the time limit: the message
                data: Any = {"error": f"{type(e).__name__}: {e}"}  # is compared instead
                result = "does not fit" if isinstance(e, ValueError) else "solver timed out"
            else:
                data = _strip(json.loads(plan.to_json()))
                result = f"{plan.step_time_s * 1e3:10.3f} ms"
            (out / f"{name}-{'x'.join(map(str, shape))}.json").write_text(json.dumps(data, indent=1, sort_keys=True))
            print(f"{name:14s} {'x'.join(map(str, shape)):8s} {result}  ({time.perf_counter() - t0:.1f} s)", flush=True)


def _renamed(d: Any) -> Any:
    """A snapshot written before the recipes had one name (``baselines``) read as one written after."""
    if isinstance(d, dict) and "baselines" in d:
        d = {("recipes" if k == "baselines" else k): v for k, v in d.items()}
    return d


def compare(after: Path, before: Path) -> int:
    differ = 0
    for path in sorted(before.glob("*.json")):
        other = after / path.name
        if not other.exists():
            print(f"{path.stem}: missing after")
            differ += 1
            continue
        found = _first_difference(_renamed(json.loads(path.read_text())), _renamed(json.loads(other.read_text())))
        if found:
            print(f"{path.stem}: differs at {found}")
            differ += 1
    print(f"{differ} of {len(list(before.glob('*.json')))} plans differ")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--compare", type=Path, default=None, help="an earlier snapshot to compare with")
    p.add_argument("--models", nargs="*", default=None, help="default: every zoo model")
    a = p.parse_args(argv)
    from autoshard.models.zoo import known_models

    snapshot(a.out, a.models or list(known_models()))
    return compare(a.out, a.compare) if a.compare else 0


if __name__ == "__main__":
    sys.exit(main())
