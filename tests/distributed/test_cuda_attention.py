"""Context parallelism on the CUDA attention kernels (issue 31 part 3): planned on CPU, run on a GPU.

On a GPU ``scaled_dot_product_attention`` dispatches to CUDA flash, efficient or cuDNN attention, each with its
own signature, outputs (rng state, sequence lengths, a padded log-sum-exp) and backward. This machine has no
CUDA, so the test routes the model's ``F.scaled_dot_product_attention`` to the kernel a GPU would run: the
traced program then holds exactly those forward and backward ops, on meta tensors (their meta kernels), as a
CUDA trace does. Each kernel gets the CPU kernel's plan: ring attention over the sequence's axis, the heads on
the other, at the same predicted step; the kernels' extras whole on every rank. (The kernels' pieces are run
against the whole kernel on a GPU in ``test_attention_kernels.py``.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate

from autoshard.cluster.meshes import fake_world
from autoshard.cluster.presets import get_cluster
from autoshard.config import PlanConfig
from autoshard.models.llama import Llama, LlamaConfig, llama_example_inputs
from autoshard.rules.sdpa_kernels import KERNELS
from autoshard.search.recompute import plan_graph

aten = torch.ops.aten
CFG = LlamaConfig(n_layer=1, d_model=1024, n_head=8, n_kv_head=8, ffn=3584, vocab=512, seq_len=32768)


def _as_on_gpu(name: str):
    """``F.scaled_dot_product_attention`` as a GPU runs it: one CUDA kernel, called as SDPA calls it."""

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert attn_mask is None and not enable_gqa
        if name == "flash":
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
        op = (
            aten._scaled_dot_product_efficient_attention
            if name == "efficient"
            else aten._scaled_dot_product_cudnn_attention
        )
        return op(q, k, v, None, True, dropout_p, is_causal, scale=scale)[0]

    return sdpa


def _plan(monkeypatch: pytest.MonkeyPatch, kernel: str):
    if kernel != "cpu":
        monkeypatch.setattr(F, "scaled_dot_product_attention", _as_on_gpu(kernel))
    with torch.device("meta"):
        model = Llama(CFG)
    with fake_world(16):
        mesh = init_device_mesh("cpu", (2, 8), mesh_dim_names=("cp", "tp"))
        return plan_graph(
            model,
            llama_example_inputs(CFG, 1),
            mesh,
            get_cluster("h100-sxm:2x8"),
            PlanConfig(constraints={"inputs": "[S(1), R]"}),
        )


@pytest.fixture(scope="module")
def cpu_plan():
    with pytest.MonkeyPatch.context() as mp:
        return _plan(mp, "cpu")


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
def test_cuda_kernels_are_planned_context_parallel_like_the_cpu_kernel(monkeypatch, cpu_plan, kernel) -> None:
    planned = _plan(monkeypatch, kernel)
    want = next(k for k in KERNELS if k.name == kernel)
    attn = [
        d
        for d in planned.plan.stages[0].ops
        if d.op.startswith(f"aten.{want.forward_op}.") or d.op.startswith(f"aten.{want.forward_op}_backward.")
    ]
    fwd = [d for d in attn if d.phase == "forward"]
    bwd = [d for d in attn if d.phase == "backward"]
    assert len(fwd) == len(bwd) == CFG.n_layer, [d.op for d in planned.plan.stages[0].ops if "attention" in d.op]
    layout = fwd[0].output
    assert sorted(layout) == ["S(1)", "S(2)"], layout  # the heads on one axis, the ring over the other
    assert fwd[0].inputs == (layout,) * 3 and bwd[0].inputs[:4] == (layout,) * 4, (fwd, bwd)
    seq_ops = [d.op for d in cpu_plan.plan.stages[0].ops if "flash_attention_for_cpu" in d.op]
    assert [d.output for d in cpu_plan.plan.stages[0].ops if d.op in seq_ops and d.phase == "forward"] == [layout]
    # the rng state and the other extras are whole on every rank
    node = next(n for n in planned.graph.graph.nodes if str(n.target) == f"aten.{want.forward_op}.default")
    extras = [
        pl for pl, v in zip(node.meta["autoshard"].outputs[2:], node.meta["val"][2:]) if isinstance(v, torch.Tensor)
    ]
    assert extras and all(pl == (Replicate(),) * 2 for pl in extras), extras
    # the same program in other kernels: the same predicted step (their FLOPs and bytes alike, up to the extras)
    assert math.isclose(planned.plan.step_time_s, cpu_plan.plan.step_time_s, rel_tol=2e-3), (
        planned.plan.step_time_s,
        cpu_plan.plan.step_time_s,
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="traces on a GPU")
@pytest.mark.parametrize("backend", ["EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_stock_hf_llama_traced_on_a_gpu_is_planned_context_parallel(backend: str) -> None:
    """A stock Hugging Face ``LlamaForCausalLM`` on the GPU, traced as it runs there (SDPA forced onto each CUDA
    kernel that takes the causal mask transformers passes it), planned for one 32768-token sequence on a fake
    2 x 8 H100 mesh: attention on the sequence."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    import autoshard

    cfg = HFConfig(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=512,
        max_position_embeddings=32768,
    )
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 512, (1, 32768), device="cuda")
    with fake_world(16), sdpa_kernel([getattr(SDPBackend, backend)]):
        mesh = init_device_mesh("cuda", (2, 8), mesh_dim_names=("cp", "tp"))
        plan = autoshard.plan(
            model, mesh, {"input_ids": ids, "labels": ids}, cluster="h100-sxm:2x8", constraints={"inputs": "[S(1), R]"}
        )
    attn = [d for d in plan.stages[0].ops if "_scaled_dot_product_" in d.op and d.phase == "forward"]
    assert attn and all("_for_cpu" not in d.op for d in attn), [d.op for d in attn]
    assert all("S(2)" in d.output for d in attn), [(d.op, d.output) for d in attn]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the CUDA kernels")
@pytest.mark.parametrize(
    "dtype,backend,tol", [("float32", None, 1e-5), ("bfloat16", None, 3e-2), ("bfloat16", "FLASH_ATTENTION", 3e-2)]
)
def test_context_parallelism_runs_on_the_cuda_kernels(dtype: str, backend: str | None, tol: float) -> None:
    """Ring attention executed on the GPU's kernels: one 8192-token sequence over 4 simulated ranks on one GPU
    (``LocalTensorMode``), the zoo Llama traced and run on CUDA (fp32 runs the efficient kernel, bf16 cuDNN on
    an H100 with torch 2.11, or flash when forced); loss and every gradient against the single-device step.
    Measured on an H100 (2026-11-26): fp32 worst gradient 9.7e-7 relative; bf16 1.1e-2 (cuDNN) and 1.4e-2
    (flash), where one device in bf16 is itself 1.3e-2 from one device in fp32."""
    import contextlib
    import copy

    from harness import local_ranks
    from numerics_utils import _full, _scalar
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import autoshard

    cfg = LlamaConfig(n_layer=2, d_model=256, n_head=4, n_kv_head=4, ffn=512, vocab=256, seq_len=8192)
    forced = sdpa_kernel([getattr(SDPBackend, backend)]) if backend else contextlib.nullcontext()
    with forced:
        torch.manual_seed(0)
        base = Llama(cfg).to("cuda", getattr(torch, dtype))
        ids, tgt = (t.cuda() for t in llama_example_inputs(cfg, 1))
        ref = copy.deepcopy(base)
        ref_loss = ref(ids, tgt)
        ref_loss.backward()
        with local_ranks(4):
            mesh = init_device_mesh("cuda", (4,), mesh_dim_names=("cp",))
            sharded = autoshard.compile(
                copy.deepcopy(base),
                mesh,
                (ids, tgt),
                cluster="h100-sxm",
                constraints={"inputs": "[S(1)]"},
                backend="eager",
            )
            loss = _scalar(sharded.step(ids, tgt))
            grads = {n: _full(p.grad).float() for n, p in sharded.named_parameters()}
    attn = [d for d in sharded.plan.stages[0].ops if "_scaled_dot_product_" in d.op]
    assert attn and all("_for_cpu" not in d.op and d.inputs[:3] == (("S(2)",),) * 3 for d in attn), attn  # the ring
    assert abs(loss - float(ref_loss)) <= tol * abs(float(ref_loss))
    for name, p in ref.named_parameters():
        want = p.grad.float()
        assert float((grads[name] - want).abs().max() / want.abs().max()) < tol, name


@pytest.mark.parametrize(
    "device,dtype,tol", [("cpu", "float32", 1e-5), ("cuda", "float32", 1e-5), ("cuda", "bfloat16", 3e-2)]
)
def test_stock_hf_llama_trains_context_parallel(device: str, dtype: str, tol: float) -> None:
    """A stock Hugging Face ``LlamaForCausalLM`` (it passes SDPA a causal mask, so the ring is not offered)
    trained with its sequence split over 4 simulated ranks: queries on their chunk against gathered keys and
    values, the mask's rows on the chunk; loss and every gradient against one device. On CPU the CPU kernel
    (2048 tokens); on a GPU (8192 tokens) the efficient kernel in fp32 and cuDNN in bf16 (torch 2.11, H100:
    8.3e-7 and 9.4e-3 relative, 2026-11-26). Until 2026-11-26 the backward failed on a view of a gradient whose
    local layout differed from the traced one (``compiler/lower.py: _contiguous``)."""
    import copy

    from harness import local_ranks
    from numerics_utils import _full, _scalar
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    import autoshard

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("runs the CUDA kernels")
    seq = 2048 if device == "cpu" else 8192
    cfg = HFConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=seq,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).to(device, getattr(torch, dtype))
    ids = torch.randint(0, 256, (1, seq), device=device)
    batch = {"input_ids": ids, "labels": ids}
    ref = copy.deepcopy(base)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    with local_ranks(4):
        mesh = init_device_mesh(device, (4,), mesh_dim_names=("cp",))
        sharded = autoshard.compile(
            copy.deepcopy(base), mesh, batch, cluster="h100-sxm", constraints={"inputs": "[S(1)]"}, backend="eager"
        )
        loss = _scalar(sharded.step(**batch))
        grads = {n: _full(p.grad).float() for n, p in sharded.named_parameters()}
    attn = [d for d in sharded.plan.stages[0].ops if "_scaled_dot_product_" in d.op and d.phase == "forward"]
    assert attn and all(d.inputs[0] == ("S(2)",) and d.inputs[1] == ("R",) for d in attn), attn  # gathered K/V
    assert abs(loss - float(ref_loss)) <= tol * abs(float(ref_loss))
    for name, p in ref.named_parameters():
        want = p.grad.float()
        assert float((grads[name] - want).abs().max() / want.abs().max()) < tol, name
