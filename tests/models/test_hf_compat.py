"""benchmarks/hf_compat.py end to end for one architecture: its row (plan on a fake 8x8 world, 3 AdamW steps on
4 forked gloo ranks with the eager backend against one device) passes with every column filled, and the
comparison it rests on notices a wrong gradient."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import pytest
import torch

pytest.importorskip("transformers")

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "hf_compat.py")


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hf_compat", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["hf_compat"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_gpt2_row_passes_with_every_column_filled() -> None:
    mod = _load()
    row = mod.check_architecture("gpt2", backend="eager", timeout=300)
    assert row.passed, row.notes
    assert (row.cls, row.captures, row.plans, row.equal, row.notes) == ("GPT2LMHeadModel", True, True, True, [])
    assert row.plan_s > 0 and row.predicted_step_s > 0 and row.compile_s > 0
    assert row.loss_err <= 1e-5 and row.grad_err <= 1e-4 and row.param_err <= 2e-4
    assert row.split.count("/") == 1
    line = [ln for ln in mod.table([row], "eager").splitlines() if ln.startswith("| gpt2 ")][0]
    assert "—" not in line and line.endswith("| ok |")


def test_comparison_names_the_parameter_that_differs() -> None:
    mod = _load()
    w = {"a": torch.ones(3), "b": torch.zeros(2)}
    same = mod.compare([1.0], w, w, [1.0], dict(w), dict(w))
    assert same["problems"] == [] and same["grad_err"] == 0.0
    off = mod.compare([1.0], w, w, [1.0 + 1e-3], {"a": torch.ones(3), "b": torch.tensor([0.0, 1e-3])}, dict(w))
    assert off["loss_err"] == pytest.approx(1e-3) and off["grad_err"] == pytest.approx(1e-3)
    assert any(p.startswith("loss step 1") for p in off["problems"])
    assert any(p.startswith("grad b: max |diff| 1.00e-03") for p in off["problems"])
    missing = mod.compare([1.0], w, w, [1.0], {"a": torch.ones(3), "b": None}, dict(w))
    assert missing["problems"] == []  # a missing gradient counts as zero: equal to b's zero gradient
