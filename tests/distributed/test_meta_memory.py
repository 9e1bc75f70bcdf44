"""benchmarks/meta_memory.py on a small Llama, 2 gloo ranks, no steps: building on the meta device keeps a rank's
peak resident memory through build + compile + init_weights below building the whole model on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: E402, F401 - imported before the fork

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import meta_memory as mm  # noqa: E402

from autoshard.testing.launch import launch  # noqa: E402

# one layer (a quick compile) with a wide MLP: 59 M parameters, 236 MB float32; its three MLP weights (64 MiB each)
# are above glibc's largest mmap threshold, so they are returned to the kernel when freed (a repeatable RSS)
SPEC = mm.ModelSpec(hidden=512, layers=1, intermediate=32768, heads=8, vocab=8000, batch=2, seq=32)


def peaks_here(mode: str) -> dict[str, int]:
    """Per phase, the larger rank's peak RSS above what the forked rank started with (bytes), ranks forked from
    this process."""
    ranks = launch(2, mm._worker, mm.Case(mode, 2, SPEC, "eager", "", probe=False, steps=0), timeout=240)
    return {p: max(r["peaks"][p] - r["runtime"] for r in ranks) for p in ("build", "values")}


def _peaks(mode: str) -> dict[str, int]:
    """``peaks_here`` run from a fresh interpreter at one ATen thread: a rank forked from the test process inherits
    its heap and reuses its free pages without growing its RSS, so its numbers would depend on what the process
    ran before (in the suite's worker, the whole build measured 199 MiB above its start; from a fresh one, 420)."""
    code = (
        "import json, sys, torch; torch.set_num_threads(1); "
        f"sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r}); "
        f"sys.path.insert(0, {os.path.dirname(__file__)!r}); "
        f"import test_meta_memory as t; print(json.dumps(t.peaks_here({mode!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return {k: int(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def test_meta_build_peak_rss_is_below_whole_build():
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc (VmHWM, clear_refs)")
    model_bytes = SPEC.params() * 4
    whole, meta = _peaks("whole"), _peaks("meta-init")
    shown = {"whole": {k: v // mm.MIB for k, v in whole.items()}, "meta": {k: v // mm.MIB for k, v in meta.items()}}
    # build + compile: built whole, a rank holds the model and then its shards; built on meta, neither
    assert meta["build"] + model_bytes / 2 < whole["build"], shown
    # through init_weights too (its shards plus one whole tensor and its piece at a time)
    assert max(meta.values()) + model_bytes / 4 < max(whole.values()), shown
