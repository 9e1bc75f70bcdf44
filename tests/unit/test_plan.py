"""Plan value type and notation: JSON round trip, report layout, parsing and formatting (no process group)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.notation import (
    dtype_str,
    fold_layers,
    format_bytes,
    format_seconds,
    local_shape,
    mesh_str,
    op_str,
    parse_bytes,
    parse_placement,
    parse_placements,
    placement_str,
    placements_str,
    tensor_str,
)
from autoshard.plans.plan import (
    CollectiveStat,
    MemoryBreakdown,
    MeshSpec,
    OpDecision,
    Plan,
    SolverStats,
    StagePlan,
    TensorLayout,
)
from autoshard.plans.report import report

MESH = MeshSpec((2, 2), ("dp", "tp"))


def _layer(i: int, wq: tuple[str, ...] = ("R", "S(0)")) -> list[TensorLayout]:
    return [
        TensorLayout(f"layers.{i}.attn.wq.weight", "parameter", (256, 256), "float32", wq),
        TensorLayout(f"layers.{i}.attn.wo.weight", "parameter", (256, 256), "float32", ("R", "S(1)")),
        TensorLayout(f"layers.{i}.mlp.fc1.weight", "parameter", (1024, 256), "float32", ("R", "S(0)")),
        TensorLayout(f"layers.{i}.norm.weight", "parameter", (256,), "float32", ("R", "R")),
    ]


def _ops(i: int, fc1_out: tuple[str, ...] = ("S(0)", "S(1)")) -> list[OpDecision]:
    return [
        OpDecision(f"mm_{3 * i}", "aten.mm.default", f"layers.{i}.attn.wq", "forward", (8, 256),
                   ("S(0)", "S(1)"), (("S(0)", "R"), ("R", "S(1)")), 1e-4, 3, "float32"),
        OpDecision(f"mm_{3 * i + 1}", "aten.mm.default", f"layers.{i}.mlp.fc1", "forward", (8, 1024),
                   fc1_out, (("S(0)", "R"), ("R", "S(1)")), 2e-4, 2, "float32"),
        OpDecision(f"mm_{3 * i + 2}", "aten.mm.default", f"layers.{i}.mlp.fc1", "backward", (1024, 256),
                   ("R", "S(0)"), (("R", "S(1)"), ("S(0)", "R")), 2e-4, 2, "float32"),
    ]  # fmt: skip


def _stage(index: int, layers: range, mesh: MeshSpec = MESH, differ: int | None = None) -> StagePlan:
    tensors = [TensorLayout("embed.weight", "parameter", (1024, 256), "float32", ("S(0)", "R"))]
    ops: list[OpDecision] = []
    for i in layers:
        tensors += _layer(i, ("S(0)", "S(1)") if i == differ else ("R", "S(0)"))
        ops += _ops(i, ("S(0)", "R") if i == differ else ("S(0)", "S(1)"))
    tensors.append(TensorLayout("rope.freqs", "buffer", (128, 64), "float32", ("R", "R")))
    tensors.append(TensorLayout("input[1]", "input", (8, 128), "int64", ("S(0)", "R")))
    tensors.append(TensorLayout("input[0]", "input", (8, 128), "float32", ("S(0)", "R")))
    collectives = [
        CollectiveStat("all_reduce", "tp", 8192, 1e-5, "mm_1", "add_2", "forward"),
        CollectiveStat("all_reduce", "tp", 8192, 1e-5, "mm_4", "add_5", "forward"),
        CollectiveStat("reduce_scatter", "dp", 2**20, 1e-3, "mm_2", "sgd", "backward"),
    ]
    ranks = tuple(range(index * mesh.size, (index + 1) * mesh.size))
    return StagePlan(index, mesh, ranks, tuple(f"layers.{i}" for i in layers), tuple(tensors), tuple(ops),
                     tuple(collectives), MemoryBreakdown(400_000, 400_000, 800_000, 10_000 * (index + 1)),
                     9.1e-3, 3.2e-3)  # fmt: skip


def _plan(stages: list[StagePlan], **kw: object) -> Plan:
    solver = SolverStats("OPTIMAL", 12.3e-3, 12.1e-3, 0.42, 41, 812, 3)
    return Plan(MESH, "cpu", tuple(stages), 12.3e-3, solver, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------- plan


def test_json_round_trip_two_stages() -> None:
    sub = MeshSpec((1, 2), ("dp", "tp"))
    p = _plan([_stage(0, range(0, 2), sub), _stage(1, range(2, 4), sub)], schedule="1F1B", microbatches=8)
    s = p.to_json()
    q = Plan.from_json(s)
    assert q == p
    assert q.to_json() == s
    assert isinstance(q.stages, tuple) and isinstance(q.stages[0].ops[0].inputs[0], tuple)
    assert json.loads(s)["format_version"] == 1


def test_from_json_errors_name_the_path() -> None:
    d = json.loads(_plan([_stage(0, range(2))]).to_json())
    d["stages"][0]["tensors"][1]["colour"] = "red"
    with pytest.raises(ValueError, match=r"stages\[0\]\.tensors\[1\].*colour"):
        Plan.from_json(json.dumps(d))
    d = json.loads(_plan([_stage(0, range(2))]).to_json())
    d["format_version"] = 99
    with pytest.raises(ValueError, match="format_version"):
        Plan.from_json(json.dumps(d))


def test_values_are_normalized_and_validated() -> None:
    t = TensorLayout("w", "parameter", [4, 4], torch.float32, [Shard(0), "Replicate()"])  # type: ignore[arg-type]
    assert t == TensorLayout("w", "parameter", (4, 4), "float32", ("S(0)", "R"))
    assert t.local_shape(MESH) == (2, 4)
    with pytest.raises(ValueError, match="role"):
        TensorLayout("w", "weights", (4,), "float32", ("R", "R"))
    with pytest.raises(ValueError, match="'w'.*one placement per mesh axis"):
        StagePlan(0, MESH, (), (), (TensorLayout("w", "parameter", (4,), "float32", ("R",)),), (), (),
                  MemoryBreakdown(0, 0, 0, 0), 0.0, 0.0)  # fmt: skip
    with pytest.raises(ValueError, match="'w'.*not divisible|'w'.*does not divide"):
        TensorLayout("w", "parameter", (3, 4), "float32", ("S(0)", "R")).local_shape(MESH)


def test_accessors_over_all_stages() -> None:
    sub = MeshSpec((1, 2), ("dp", "tp"))
    big = _stage(1, range(2, 4), sub)
    big = StagePlan(1, sub, big.ranks, big.layers, big.tensors, big.ops, big.collectives,
                    MemoryBreakdown(1, 1, 1, 10**9), 1.0, 1.0)  # fmt: skip
    p = _plan([_stage(0, range(0, 2), sub), big])
    params = p.parameter_placements()
    assert params["layers.3.attn.wq.weight"] == ("R", "S(0)")
    assert params["layers.0.norm.weight"] == ("R", "R")
    assert "rope.freqs" not in params and "input[0]" not in params
    assert p.input_placements() == (("S(0)", "R"), ("S(0)", "R"))
    assert p.peak_memory == big.memory
    rows = p.collective_summary()
    assert rows[0] == ("reduce_scatter", "dp", 2, 2 * 2**20, pytest.approx(2e-3))
    assert rows[1][:4] == ("all_reduce", "tp", 4, 4 * 8192)
    assert SolverStats("OPTIMAL", 10.0, 9.0, 1.0, 1, 1, 0).gap == pytest.approx(0.1)
    assert SolverStats("UNKNOWN", 0.0, 0.0, 1.0, 1, 1, 0).gap == 0.0


def test_report_layout() -> None:
    r = report(_plan([_stage(0, range(2))]))
    assert "mesh dp=2 × tp=2" in r
    assert "cluster cpu" in r and "predicted step 12.3 ms" in r and "OPTIMAL" in r
    assert "[S(0), R]" in r and "f32[512, 256]" in r  # embed.weight local shape under [S(0), R]
    lines = r.splitlines()
    # module grouping: one header per module, its parameters indented below by their short name
    assert lines.count("layers.0.attn") == 2  # parameters and forward decisions (wq)
    i = lines.index("layers.0.attn")
    assert lines[i + 1].lstrip().startswith("wq.weight") and lines[i + 2].lstrip().startswith("wo.weight")
    assert any(line.startswith("  embed.weight") for line in lines)
    assert "decisions (backward): 2 anchors" in r
    assert "collectives per step" in r and "reduce_scatter" in r
    assert "\x1b[" not in r


def test_report_collapses_identical_layers() -> None:
    r = report(_plan([_stage(0, range(4))]))
    assert "layers.1–3: same as layers.0" in r
    assert "layers.2.attn" not in r and "layers.0.attn" in r
    full = report(_plan([_stage(0, range(4))]), collapse=False)
    assert "same as" not in full and "layers.3.attn" in full


def test_report_does_not_collapse_a_differing_layer() -> None:
    r = report(_plan([_stage(0, range(4), differ=2)]))
    assert "layers.1–3: same as layers.0" not in r
    lines = r.splitlines()
    # the layers that match still fold; the one that differs prints in full, in parameters and decisions alike
    assert lines.count("layers.1: same as layers.0") == 2 and lines.count("layers.3: same as layers.0") == 2
    assert lines.count("layers.2.attn") == 2 and lines.count("layers.2.mlp") == 2
    i = lines.index("layers.2.attn")
    assert "[S(0), S(1)]" in lines[i + 1]


def test_report_pipeline_stages() -> None:
    sub = MeshSpec((1, 2), ("dp", "tp"))
    r = report(_plan([_stage(0, range(0, 2), sub), _stage(1, range(2, 4), sub)], schedule="1F1B", microbatches=8))
    assert "== stage 0  mesh dp=1 × tp=2  ranks 0–1" in r and "== stage 1" in r and "1F1B × 8" in r


# --------------------------------------------------------------------------------------------- notation


@pytest.mark.parametrize(
    "p, s",
    [(Replicate(), "R"), (Shard(0), "S(0)"), (Shard(1), "S(1)"), (Shard(-1), "S(-1)"), (Partial(), "P"),
     (Partial("sum"), "P"), (Partial("avg"), "P(avg)"), (Partial("max"), "P(max)"), (Partial("min"), "P(min)")],
)  # fmt: skip
def test_placement_round_trip(p: object, s: str) -> None:
    assert placement_str(p) == s  # type: ignore[arg-type]
    assert parse_placement(s) == p
    assert placement_str(parse_placement(s)) == s


def test_parse_placements_forms() -> None:
    want = (Shard(0), Replicate())
    assert parse_placements("[S(0), R]") == want
    assert parse_placements(("S(0)", "R")) == want
    assert parse_placements("[Shard(0), Replicate()]") == want
    assert parse_placements("[P(avg),S(1)]") == (Partial("avg"), Shard(1))
    assert parse_placements("[]") == ()
    assert placements_str([Shard(0), "R", Partial()]) == "[S(0), R, P]"
    assert placements_str(parse_placements("[S(0), P(max)]")) == "[S(0), P(max)]"


@pytest.mark.parametrize("bad", ["X(1)", "S(a)", "S0", "", "Q", "P()x"])
def test_parse_errors_name_the_text(bad: str) -> None:
    with pytest.raises(ValueError, match="cannot parse placement") as e:
        parse_placement(bad)
    assert repr(bad) in str(e.value) and "S(<dim>)" in str(e.value)


def test_parse_placements_error_names_the_list_and_the_entry() -> None:
    with pytest.raises(ValueError) as e:
        parse_placements("[S(0), T(1)]")
    assert "'[S(0), T(1)]'" in str(e.value) and "'T(1)'" in str(e.value)


def test_mesh_dtype_tensor_op() -> None:
    assert mesh_str((2, 4), ("dp", "tp")) == "dp=2 × tp=4"
    assert str(MESH) == "dp=2 × tp=2" and MESH.size == 4
    expected = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int64: "i64",
                torch.int32: "i32", torch.bool: "b8"}  # fmt: skip
    for dt, s in expected.items():
        assert dtype_str(dt) == s and dtype_str(str(dt)) == s and dtype_str(str(dt).removeprefix("torch.")) == s
    assert tensor_str(torch.float32, (8, 256)) == "f32[8, 256]"
    assert tensor_str("bfloat16", ("B", "T", "D")) == "bf16[B, T, D]"
    assert op_str("aten.mm.default") == "mm" and op_str("aten.add.Tensor") == "add.Tensor"


def test_local_shape() -> None:
    assert local_shape((8, 256), ["S(0)", "S(1)"], (2, 4)) == (4, 64)
    assert local_shape((8, 256), [Shard(0), Shard(0)], (2, 4)) == (1, 256)  # two axes divide one dim twice
    assert local_shape((8, 256), ["R", "P"], (2, 4)) == (8, 256)
    assert local_shape((8, 256), ["S(-1)", "R"], (2, 4)) == (8, 128)
    with pytest.raises(ValueError) as e:
        local_shape((6, 256), ["S(0)", "S(0)"], (2, 2))
    msg = str(e.value)
    assert "[6, 256]" in msg and "[S(0), S(0)]" in msg and "[2, 2]" in msg and "divisible" in msg
    with pytest.raises(ValueError, match="dim 2"):
        local_shape((8, 256), ["S(2)", "R"], (2, 2))
    with pytest.raises(ValueError, match="one placement per mesh axis"):
        local_shape((8, 256), ["S(0)"], (2, 2))


def test_fold_layers() -> None:
    rows = [("embed", 1), ("layers.0.a", 1), ("layers.0.b", 2), ("layers.1.a", 1), ("layers.1.b", 2),
            ("layers.2.a", 9), ("layers.2.b", 2), ("layers.3.a", 1), ("layers.3.b", 2), ("norm", 3)]  # fmt: skip
    assert fold_layers(rows) == [0, 1, 2, "layers.1: same as layers.0", 5, 6, "layers.3: same as layers.0", 9]


@pytest.mark.parametrize(
    "n, s",
    [(80, "80 B"), (12 * 1024, "12.0 KiB"), (512 * 2**20, "512.0 MiB"), (3 * 2**29, "1.50 GiB"),
     (2**20 - 1, "1.00 MiB"), (0, "0 B")],
)  # fmt: skip
def test_format_bytes(n: int, s: str) -> None:
    assert format_bytes(n) == s


@pytest.mark.parametrize(
    "s, n",
    [("2GiB", 2 * 2**30), ("2 GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("80GB", 80 * 10**9),
     ("1.5e9", 1_500_000_000), (4096, 4096), ("12 KiB", 12 * 1024), ("80 B", 80), ("0.5 gib", 2**29)],
)  # fmt: skip
def test_parse_bytes(s: str | int, n: int) -> None:
    assert parse_bytes(s) == n


@pytest.mark.parametrize("bad", ["lots", "2 GiBs", "", "-1GB", "1.2.3GB", -5, True])
def test_parse_bytes_errors(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_bytes(bad)  # type: ignore[arg-type]


def test_bytes_round_trip_through_format() -> None:
    for n in (80, 12 * 1024, 512 * 2**20, 3 * 2**29):
        assert parse_bytes(format_bytes(n)) == n


def test_format_seconds() -> None:
    assert format_seconds(12.3e-3) == "12.3 ms"
    assert format_seconds(4.56) == "4.56 s"
    assert format_seconds(17e-6) == "17.0 µs"
    assert format_seconds(0.99996) == "1.00 s"


def test_report_says_when_memory_holds_a_stage_back() -> None:
    from dataclasses import replace

    sub = MeshSpec((1, 2), ("dp", "tp"))
    fast, slow = _stage(0, range(0, 2), sub), _stage(1, range(2, 6), sub)
    fast = replace(fast, memory=MemoryBreakdown(10**9, 10**9, 2 * 10**9, 15 * 10**8), microbatch_time_s=1.0)
    slow = replace(slow, memory=MemoryBreakdown(10**9, 10**9, 2 * 10**9, 10**8), microbatch_time_s=1.5)
    near = _plan([fast, slow], schedule="1F1B", microbatches=8, memory_budget_bytes=5_600_000_000)
    assert "stage 0 is memory-bound: 5.12 GiB of 5.22 GiB" in report(near)
    # with room for another layer (a layer averages 5.5 GB / 2 here) the imbalance is not memory's doing
    roomy = replace(near, memory_budget_bytes=9 * 10**9)
    assert "stage balance: slowest / fastest stage = 1.50" in report(roomy)
    assert "memory-bound" not in report(roomy)
