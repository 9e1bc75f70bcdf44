"""CP-SAT models written as CpModelProto text and loaded with one parse.

OR-Tools' Python API makes one call per variable and per constraint, and those calls were most of the integer
program's build (0.7 s for Mixtral-8x7B's 86k booleans on (8, 8)); the same model as text, joined and parsed once
in C++, takes 0.1 s. These are the lines ``autoshard/solver/intra_op.py`` writes: booleans, exactly-one rows,
linear rows with a fixed right-hand side, and the objective.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ortools.sat.python import cp_model


def ints(values: Iterable[int]) -> str:
    return ", ".join(map(str, values))


def boolean(name: str = "") -> str:
    return f'variables {{ name: "{name}" domain: [0, 1] }}' if name else "variables { domain: [0, 1] }"


def exactly_one(literals: Sequence[int]) -> str:
    return f"constraints {{ exactly_one {{ literals: [{ints(literals)}] }} }}"


def equal(plus: Sequence[int], minus: Sequence[int]) -> str:
    """sum(plus) - sum(minus) = 0 over booleans (by index)."""
    return (
        f"constraints {{ linear {{ vars: [{ints(plus)}, {ints(minus)}] "
        f"coeffs: [{ints([1] * len(plus) + [-1] * len(minus))}] domain: [0, 0] }} }}"
    )


def zero(v: int) -> str:
    """Boolean ``v`` is 0."""
    return f"constraints {{ linear {{ vars: [{v}] coeffs: [1] domain: [0, 0] }} }}"


def minimize(variables: Sequence[int], coeffs: Iterable[int]) -> str:
    return f"objective {{ vars: [{ints(variables)}] coeffs: [{ints(coeffs)}] }}"


def load(model: cp_model.CpModel, text: str) -> None:
    """Parse CpModelProto text into an empty model (OR-Tools' own protos parse it in C++; older releases hold a
    protobuf message)."""
    proto = model.Proto()
    if hasattr(proto, "parse_text_format"):
        proto.parse_text_format(text)
    else:
        from google.protobuf import text_format

        text_format.Merge(text, proto)


__all__ = ["boolean", "equal", "exactly_one", "ints", "load", "minimize", "zero"]
