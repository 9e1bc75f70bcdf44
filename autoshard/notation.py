"""One short notation for placements, meshes, tensors, sizes and times.

Why a module of its own: reports, logs, error messages, the plan's JSON and the docs must all spell a layout
the same way, so that a user can paste ``[S(0), R]`` from a report into a config and get the same layout back.
Every formatter here has an inverse where one is needed (``parse_placement``, ``parse_placements``,
``parse_bytes``), and every parse error names the bad text and the accepted forms.

The notation (docs/design.md, "Code rules"):

- placements per mesh axis: ``[S(0), R]``; ``R`` = Replicate, ``S(d)`` = Shard(d), ``P`` = Partial(sum),
  ``P(avg)`` / ``P(max)`` ... = Partial with another reduce op;
- meshes: ``dp=2 × tp=4``;
- tensors: ``f32[B, T, D]``;
- sizes ``1.50 GiB`` (binary units), times ``12.3 ms``;
- ops ``mm`` for ``aten.mm.default``; repeated layers ``layers.1–31: same as layers.0``;
- recomputation specs ``layers.3`` (full) or ``layers.3:selective``, folded as
  ``layers.0-3 full, layers.4-31 selective``.
"""

from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard.errors import InputError
from autoshard.ir import layer_parts

logger = logging.getLogger(__name__)

__all__ = [
    "FULL",
    "MODES",
    "SELECTIVE",
    "describe",
    "parse_spec",
    "spec",
    "placement_str",
    "placements_str",
    "parse_placement",
    "parse_placements",
    "mesh_str",
    "dtype_str",
    "dtype_name",
    "dtype_bytes",
    "tensor_str",
    "local_shape",
    "op_str",
    "fold_layers",
    "format_bytes",
    "parse_bytes",
    "format_seconds",
]

_ACCEPTED_PLACEMENTS = "R, S(<dim>), P, P(<reduce_op>) (also Replicate(), Shard(<dim>), Partial(<reduce_op>))"

_PLACEMENT_RE = re.compile(
    r"""^\s*(?:
        (?P<r>R|Replicate\(\s*\))
      | (?:S|Shard)\(\s*(?:dim\s*=\s*)?(?P<s>[+-]?\d+)\s*\)
      | (?P<p>P|Partial\(\s*\))
      | (?:P|Partial)\(\s*(?:reduce_op\s*=\s*)?["']?(?P<op>[A-Za-z_]+)["']?\s*\)
    )\s*$""",
    re.VERBOSE,
)


# ---------------------------------------------------------------------------------------------------------------
# placements


def placement_str(p: Placement | str) -> str:
    """``Replicate()`` -> ``R``, ``Shard(1)`` -> ``S(1)``, ``Partial()`` -> ``P``, ``Partial("avg")`` -> ``P(avg)``.

    A string is parsed and re-formatted, so already-formatted text passes through in canonical form.
    Partial subclasses (e.g. the embedding's masked partial) print as their reduce op: the notation describes
    what a consumer must do (reduce), not how the producer got there.
    """
    if isinstance(p, str):
        return placement_str(parse_placement(p))
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        op = str(p.reduce_op)
        return "P" if op == "sum" else f"P({op})"
    raise InputError(
        f"placement {p!r} (type {type(p).__name__}) has no autoshard notation; "
        f"supported kinds are Shard, Replicate and Partial"
    )


def placements_str(ps: Sequence[Placement | str]) -> str:
    """``[S(0), R]``: one entry per mesh axis, outer axis first."""
    return "[" + ", ".join(placement_str(p) for p in ps) + "]"


def placements_tuple(ps: Sequence[Placement | str] | None) -> tuple[str, ...]:
    """``(Shard(0), Replicate())`` -> ``("S(0)", "R")`` (``None`` -> ``()``): the canonical form plans store and
    compare, so "Shard(0)" and "S(0)" make equal plans."""
    return tuple(placement_str(p) for p in ps) if ps is not None else ()


def parse_placement(s: str) -> Placement:
    """Inverse of :func:`placement_str`; also accepts the long forms ``Shard(0)``, ``Replicate()``, ``Partial(avg)``."""
    if not isinstance(s, str):
        raise InputError(f"expected placement text like 'S(0)', got {s!r} of type {type(s).__name__}")
    m = _PLACEMENT_RE.match(s)
    if m is None:
        raise InputError(f"cannot parse placement {s!r}; accepted forms: {_ACCEPTED_PLACEMENTS}")
    if m.group("r") is not None:
        return Replicate()
    if m.group("s") is not None:
        return Shard(int(m.group("s")))
    if m.group("p") is not None:
        return Partial()
    return Partial(m.group("op").lower())


def _split_top_level(body: str) -> list[str]:
    """Split ``S(0), P(avg), R`` at commas that are not inside parentheses."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(body):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return parts


def parse_placements(s: str | Sequence[str]) -> tuple[Placement, ...]:
    """``"[S(0), R]"`` or ``("S(0)", "R")`` -> ``(Shard(0), Replicate())``. ``"[]"`` is the empty tuple."""
    if isinstance(s, str):
        text = s.strip()
        if (text[:1], text[-1:]) in (("[", "]"), ("(", ")")):
            text = text[1:-1].strip()
        if not text:
            return ()
        items: Sequence[str] = [item.strip() for item in _split_top_level(text)]
    else:
        items = s
    out: list[Placement] = []
    for item in items:
        try:
            out.append(parse_placement(item) if isinstance(item, str) else _as_placement(item))
        except ValueError as e:
            raise InputError(f"in placements {s!r}: {e}") from None
    return tuple(out)


def _as_placement(p: Placement | str) -> Placement:
    if isinstance(p, str):
        return parse_placement(p)
    if isinstance(p, (Shard, Replicate, Partial)):
        return p
    raise InputError(f"expected a placement or placement text, got {p!r}")


# ---------------------------------------------------------------------------------------------------------------
# meshes, dtypes, tensors


def mesh_str(shape: Sequence[int], names: Sequence[str]) -> str:
    """``dp=2 × tp=4``. Unnamed meshes (no names) print as ``2 × 4``."""
    shape = tuple(shape)
    names = tuple(names)
    if names and len(names) != len(shape):
        raise InputError(f"mesh shape {shape} has {len(shape)} axes but names {names} has {len(names)}")
    if not shape:
        return "(single device)"
    if not names:
        return " × ".join(str(n) for n in shape)
    return " × ".join(f"{name}={n}" for name, n in zip(names, shape))


_DTYPE_SHORT: Mapping[torch.dtype, str] = MappingProxyType(
    {
        torch.float64: "f64",
        torch.float32: "f32",
        torch.float16: "f16",
        torch.bfloat16: "bf16",
        torch.int64: "i64",
        torch.int32: "i32",
        torch.int16: "i16",
        torch.int8: "i8",
        torch.uint8: "u8",
        torch.bool: "b8",
        torch.complex64: "c64",
        torch.complex128: "c128",
    }
)


def _to_dtype(dtype: torch.dtype | str) -> torch.dtype | None:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).strip().removeprefix("torch.")
    for dt, short in _DTYPE_SHORT.items():
        if short == name:
            return dt
    found = getattr(torch, name, None)
    return found if isinstance(found, torch.dtype) else None


def dtype_str(dtype: torch.dtype | str) -> str:
    """``torch.float32`` / ``"float32"`` / ``"f32"`` -> ``f32``; unknown dtypes keep their torch name."""
    dt = _to_dtype(dtype)
    if dt is None:
        return str(dtype).removeprefix("torch.")
    return _DTYPE_SHORT.get(dt, str(dt).removeprefix("torch."))


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.float32`` / ``"f32"`` -> ``float32``: the long form the plan's JSON stores, stable across torch."""
    dt = _to_dtype(dtype)
    if dt is None:
        raise InputError(f"unknown dtype {dtype!r}; use a torch dtype such as torch.float32 or text like 'float32'")
    return str(dt).removeprefix("torch.")


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element: ``"bfloat16"`` / ``torch.bfloat16`` -> 2."""
    dt = _to_dtype(dtype)
    if dt is None:
        raise InputError(f"unknown dtype {dtype!r}; use a torch dtype such as torch.float32 or text like 'float32'")
    return dt.itemsize


def tensor_str(dtype: torch.dtype | str, shape: Sequence[int | str]) -> str:
    """``f32[8, 256]``; symbolic sizes print as given (``f32[B, T, D]``), scalars as ``f32[]``."""
    return f"{dtype_str(dtype)}[{', '.join(str(d) for d in shape)}]"


def local_shape(
    shape: Sequence[int], placements: Sequence[Placement | str], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """The per-device shape of a tensor of global ``shape`` laid out by ``placements`` on a mesh.

    Only even sharding: autoshard prunes uneven strategies (docs/design.md, "Candidates") because padded shards make the
    cost model and the lowered shapes disagree. Two mesh axes sharding the same dim divide it twice, outer axis first,
    as DTensor does.
    """
    shape_t = tuple(int(d) for d in shape)
    mesh_t = tuple(int(n) for n in mesh_shape)
    ps = tuple(_as_placement(p) for p in placements)
    if len(ps) != len(mesh_t):
        raise InputError(
            f"placements {placements_str(ps)} have {len(ps)} entries but the mesh {mesh_t} has {len(mesh_t)} axes; "
            f"give one placement per mesh axis"
        )
    out = list(shape_t)
    for axis, (p, n) in enumerate(zip(ps, mesh_t)):
        if not isinstance(p, Shard):
            continue
        dim = p.dim + len(shape_t) if p.dim < 0 else p.dim
        if not 0 <= dim < len(shape_t):
            raise InputError(
                f"placement {placement_str(p)} on mesh axis {axis} names dim {p.dim}, but the tensor of shape "
                f"{list(shape_t)} has {len(shape_t)} dims; shard a dim in range or use R"
            )
        if out[dim] % n:
            raise InputError(
                f"cannot shard shape {list(shape_t)} with placements {placements_str(ps)} on mesh {list(mesh_t)}: "
                f"dim {dim} is {out[dim]} when it reaches mesh axis {axis} ({n} devices) and does not divide "
                f"evenly; make dim {dim} divisible by the product of the axes sharding it, use another mesh shape, "
                f"or put R on mesh axis {axis}"
            )
        out[dim] //= n
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------------
# ops and repeated layers


def op_str(op: str) -> str:
    """``aten.mm.default`` -> ``mm``; ``aten.add.Tensor`` -> ``add.Tensor``."""
    return re.sub(r"\.default$", "", re.sub(r"^(aten|prims|_c10d_functional)\.", "", op))


def fold_layers(rows: Sequence[tuple[str, Hashable]]) -> list[int | str]:
    """Row indices to print, with ``"layers.1–31: same as layers.0"`` lines in place of repeated layers.

    ``rows`` are (name, signature). A layer folds when the ordered signatures of all its rows equal those of an
    earlier layer under the same prefix, so a 32-layer model prints one layer and one line, while a layer that
    differs (say the last) still prints in full.
    """
    keys = [layer_parts(name) for name, _ in rows]
    content: dict[tuple[str, int], list[Hashable]] = defaultdict(list)
    for k, (_, sig) in zip(keys, rows):
        if k is not None:
            content[(k[0], k[1])].append((k[2], sig))
    first: dict[tuple[str, tuple[Hashable, ...]], int] = {}
    same_as: dict[tuple[str, int], int] = {}
    for (prefix, idx), sigs in content.items():
        if (ref := first.setdefault((prefix, tuple(sigs)), idx)) != idx:
            same_as[(prefix, idx)] = ref
    out: list[int | tuple[str, int, int, int]] = []  # a row index, or (prefix, ref, lo, hi)
    for i, k in enumerate(keys):
        if k is None or (k[0], k[1]) not in same_as:
            out.append(i)
            continue
        prefix, idx, ref = k[0], k[1], same_as[(k[0], k[1])]
        last = out[-1] if out else None
        if isinstance(last, tuple) and last[:2] == (prefix, ref) and last[3] in (idx - 1, idx):
            out[-1] = (prefix, ref, last[2], idx)
        else:
            out.append((prefix, ref, idx, idx))
    return [
        e if isinstance(e, int) else f"{e[0]}.{e[2]}{'' if e[2] == e[3] else f'–{e[3]}'}: same as {e[0]}.{e[1]}"
        for e in out
    ]


# ---------------------------------------------------------------------------------------------------------------
# bytes and seconds

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_BYTE_SUFFIX: Mapping[str, int] = MappingProxyType(
    {
        "": 1,
        "b": 1,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
        "pib": 2**50,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "pb": 10**15,
        "k": 2**10,
        "m": 2**20,
        "g": 2**30,
        "t": 2**40,
    }
)
_BYTES_RE = re.compile(r"^\s*(?P<num>[+]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(?P<unit>[A-Za-z]*)\s*$")


def _three_digits(v: float) -> str:
    """2 decimals below 10, else 1: ``1.50``, ``12.3``, ``512.0``; decided after rounding so 9.999 -> ``10.0``."""
    return f"{v:.2f}" if abs(round(v, 2)) < 10 else f"{v:.1f}"


def format_bytes(n: int, unit: str | None = None) -> str:
    """``1.50 GiB``, ``512.0 MiB``, ``12.0 KiB``, ``80 B``; binary units because device memory is sized in them.

    ``unit`` forces one unit (e.g. ``"MiB"``) so that the terms of a sum print comparably.
    """
    n = int(n)
    if unit is not None:
        if unit not in _BINARY_UNITS:
            raise InputError(f"unknown unit {unit!r}; use one of {', '.join(_BINARY_UNITS)}")
        if unit == "B":
            return f"{n} B"
        return f"{_three_digits(n / 1024 ** _BINARY_UNITS.index(unit))} {unit}"
    if abs(n) < 1024:
        return f"{n} B"
    k = min(int(math.log(abs(n), 1024)), len(_BINARY_UNITS) - 1)
    v = n / 1024**k
    if abs(round(v, 1)) >= 1024 and k < len(_BINARY_UNITS) - 1:
        k, v = k + 1, v / 1024
    return f"{_three_digits(v)} {_BINARY_UNITS[k]}"


def parse_bytes(s: str | int) -> int:
    """``"2GiB"``, ``"2 GiB"``, ``"512MiB"``, ``"80GB"`` (= 80e9), ``"1.5e9"``, ``"4K"`` (KiB); ints pass through.

    Decimal units (GB) follow vendors' spec sheets, binary ones (GiB) follow allocators; both are accepted so a
    number can be copied from either without conversion.
    """
    if isinstance(s, bool):
        raise InputError(f"expected a byte count, got {s!r}")
    if isinstance(s, int):
        if s < 0:
            raise InputError(f"byte count must be non-negative, got {s}")
        return s
    if isinstance(s, float):
        s = repr(s)
    m = _BYTES_RE.match(str(s))
    unit = m.group("unit").lower() if m else ""
    if m is None or unit not in _BYTE_SUFFIX:
        raise InputError(
            f"cannot parse byte size {s!r}; write a number with an optional unit, e.g. '80GB' (1e9), "
            f"'2 GiB' (2**30), '512MiB', '1.5e9' or 1024"
        )
    return int(round(float(m.group("num")) * _BYTE_SUFFIX[unit]))


_TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))


def format_seconds(t: float) -> str:
    """``4.56 s``, ``12.3 ms``, ``17.0 µs``: three significant digits in the largest unit that keeps v ≥ 1."""
    t = float(t)
    if t == 0:
        return "0 s"
    if not math.isfinite(t):
        return f"{t} s"
    # largest unit in which the value is >= 1; step up once more if rounding reaches 1000 (999.96 ms -> 1.00 s)
    i = next((i for i, (scale, _) in enumerate(_TIME_UNITS) if abs(t) >= scale), len(_TIME_UNITS) - 1)
    if i > 0 and abs(round(t / _TIME_UNITS[i][0], 1)) >= 1000:
        i -= 1
    scale, name = _TIME_UNITS[i]
    return f"{_three_digits(t / scale)} {name}"


# recomputation specs (``PlanConfig.recompute``; ``autoshard/compiler/capture_recompute.py`` tags them)
FULL, SELECTIVE = "full", "selective"
MODES = (FULL, SELECTIVE)


def parse_spec(spec: str) -> tuple[str, str]:
    """``"layers.3:selective"`` -> ``("layers.3", "selective")``; no mode is ``full``."""
    path, _, mode = str(spec).partition(":")
    mode = mode or FULL
    if mode not in MODES:
        raise InputError(
            f"recompute={spec!r}: mode {mode!r} is not one of {', '.join(MODES)} (write 'PATH' or 'PATH:selective')"
        )
    return path, mode


def spec(path: str, mode: str) -> str:
    return path if mode == FULL else f"{path}:{mode}"


def describe(specs: Sequence[str]) -> str:
    """``layers.0-3 full, layers.4-31 selective``: specs with runs of consecutive layers folded."""
    runs: list[list] = []  # [container, first, last, mode] or [path, None, None, mode]
    for s in specs:
        path, mode = parse_spec(s)
        parts = layer_parts(path + ".x")
        if (
            parts
            and parts[2] == "x"
            and runs
            and runs[-1][0] == parts[0]
            and runs[-1][3] == mode
            and runs[-1][2] == parts[1] - 1
        ):
            runs[-1][2] = parts[1]
        elif parts and parts[2] == "x":
            runs.append([parts[0], parts[1], parts[1], mode])
        else:
            runs.append([path, None, None, mode])
    return ", ".join(
        f"{c}.{a}" + (f"-{b}" if b != a else "") + f" {m}" if a is not None else f"{c} {m}" for c, a, b, m in runs
    )
