"""Layers 2 and 3: what the planner decides on a fake process group, and the collectives the lowered
per-rank programs contain for those plans."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import autoshard
from autoshard.cluster.meshes import fake_world
from autoshard.cluster.presets import get_cluster
from autoshard.compiler.lower import collective_counts, lower
from autoshard.config import PlanConfig
from autoshard.errors import InfeasibleBudget
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.models.llama import Llama, LlamaConfig, llama_example_inputs
from autoshard.models.mlp import MLP, mlp_example_inputs
from autoshard.models.moe import MoEConfig, MoEDecoder, moe_example_inputs
from autoshard.plans.report import report
from autoshard.search.recompute import plan_graph

BATCH_ON_DP = {"inputs": {"dp": Shard(0)}}


def _mlp():
    with torch.device("meta"):
        return MLP(1024, 4096, 1024)


def _mlp_inputs():
    return mlp_example_inputs(4096, 1024, 1024)


def _planned(cls, cfg, inputs, shape, names, cluster, constraints):
    """``cls(cfg)`` built on the meta device and planned on a fake mesh (a ``Planned``: plan, graph, context)."""
    with torch.device("meta"):
        model = cls(cfg)
    with fake_world(math.prod(shape)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        return plan_graph(model, inputs, mesh, get_cluster(cluster), PlanConfig(constraints=constraints))


def _pinned_objective(ctx, group, want) -> float:
    """The solver's objective with ``group``'s output pinned to ``want`` (a cost comparison)."""
    cands = ctx.problem.strategies[group.id]
    keep = {i for i, st in enumerate(cands) if st.outputs[0][0] == want}
    return ctx.problem.solve(memory_budget=None, time_limit_s=30, pins={group.id: keep}).objective_s


def test_mlp_no_budget_is_ddp():
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        planned = plan_graph(_mlp(), _mlp_inputs(), mesh, get_cluster("cpu"), PlanConfig(constraints=BATCH_ON_DP))
        plan, gm, ctx = planned.plan, planned.graph, planned.ctx
        assert set(plan.parameter_placements().values()) == {("R",)}
        assert plan.input_placements() == (("S(0)",), ("S(0)",))
        kinds = {(c.kind, c.axis) for c in plan.stages[0].collectives}
        assert kinds == {("all_reduce", "dp")}  # gradient all-reduce only
        counts = collective_counts(lower(gm, ctx))
        # one for the loss, and the 4 gradients in DDP-style buckets, in the order the backward makes them: a
        # first bucket of <= 1 MiB (fc2.bias), then <= 25 MiB (fc2.weight 16 MiB + fc1.bias; fc1.weight 16 MiB)
        assert counts == {"all_reduce": 4}


def test_mlp_budget_shards_optimizer_state_then_parameters():
    """Sharded state where the budget asks for it, and only there: none without a budget; under 80% of DDP's
    memory some weight's optimizer state is sharded (ZeRO's masters, gathered after the step, or the weight itself,
    FSDP's, whichever the program prices faster: a layer's gathers and a bucket's reduce-scatters pay their latency
    once); under 70% every weight's state is sharded and some weight itself (FSDP-like). The budgets count the
    step's whole peak, temporaries included."""
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        ddp = autoshard.plan(_mlp(), mesh, _mlp_inputs(), constraints=BATCH_ON_DP)
        assert not any(t.zero for t in ddp.stages[0].tensors)
        weights = ("fc1.weight", "fc2.weight")
        mid = autoshard.plan(
            _mlp(), mesh, _mlp_inputs(), constraints=BATCH_ON_DP, memory_budget=int(ddp.peak_memory.total * 0.8)
        )
        assert mid.peak_memory.total <= mid.memory_budget_bytes
        layouts = {t.name: t for t in mid.stages[0].tensors}
        assert any(layouts[w].placements != ("R",) or layouts[w].zero for w in weights)
        assert mid.peak_memory.optimizer < ddp.peak_memory.optimizer
        after_step = {(c.kind, c.phase) for c in mid.stages[0].collectives if c.consumer == "optimizer step"}
        assert after_step == ({("all_gather", "optimizer")} if any(layouts[w].zero for w in weights) else set())
        recipes = {r.name: r for r in mid.recipes}
        assert mid.step_time_s <= recipes["fsdp"].step_time_s
        budget = int(ddp.peak_memory.total * 0.7)
        config = PlanConfig(constraints=BATCH_ON_DP, memory_budget=budget)
        planned = plan_graph(_mlp(), _mlp_inputs(), mesh, get_cluster("cpu"), config)
        plan, gm, ctx = planned.plan, planned.graph, planned.ctx
        assert plan.peak_memory.total <= budget
        pl = plan.parameter_placements()
        zero = {t.name: t.zero for t in plan.stages[0].tensors}
        assert all(pl[w] != ("R",) or zero[w] for w in weights) and any(pl[w] != ("R",) for w in weights)
        assert plan.step_time_s >= mid.step_time_s >= ddp.step_time_s  # the budget costs time, never saves it
        counts = collective_counts(lower(gm, ctx))
        # sharded weights are gathered for compute; their gradients are reduce-scattered (or all-reduced + chunked)
        assert counts.get("all_gather_into_tensor", 0) >= 1
        assert counts.get("reduce_scatter_tensor", 0) + counts.get("all_reduce", 0) >= 2


def test_infeasible_budget_states_minimum():
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        with pytest.raises(InfeasibleBudget, match=r"needs 32.0 MiB per device before any activation"):
            autoshard.plan(_mlp(), mesh, _mlp_inputs(), constraints=BATCH_ON_DP, memory_budget="1MiB")
        with pytest.raises(InfeasibleBudget, match=r"smallest is [0-9.]+ MiB"):  # (above its state: the solver's)
            autoshard.plan(_mlp(), mesh, _mlp_inputs(), constraints=BATCH_ON_DP, memory_budget="33MiB")


def test_transformer_block_is_megatron_on_tp():
    cfg = GPTConfig(n_layer=1, d_model=2048, n_head=16, vocab=512, seq_len=128, bias=False)
    with torch.device("meta"):
        model = GPT(cfg)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        planned = plan_graph(
            model,
            gpt_example_inputs(cfg, 2),
            mesh,
            get_cluster("h100-sxm"),
            PlanConfig(constraints={"inputs": "[S(0), R]"}),
        )
        plan, gm, ctx = planned.plan, planned.graph, planned.ctx
        pl = plan.parameter_placements()
        # column-parallel first MLP matmul (weight rows = output features split), row-parallel second
        assert pl["layers.0.mlp.fc1.weight"][1] == "S(0)"
        assert pl["layers.0.mlp.fc2.weight"][1] == "S(1)"
        # attention heads are split too: the q projection is column-parallel
        assert pl["layers.0.attn.wq.weight"][1] == "S(0)"
        counts = collective_counts(lower(gm, ctx))
        assert sum(counts.values()) > 0
        assert plan.solver.status == "OPTIMAL"


def test_plan_report_and_json_round_trip():
    from autoshard.plans.plan import Plan

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = autoshard.plan(_mlp(), mesh, _mlp_inputs(), constraints=BATCH_ON_DP)
    text = report(plan)
    assert "dp=2 × tp=2" in text and "fc1.weight" in text
    assert Plan.from_json(plan.to_json()) == plan


def test_loss_backward_keeps_the_batch_sharded():
    """nll_loss_backward's first input is the scalar incoming gradient; its candidates must follow the batch
    (the log-probabilities), or the whole log-softmax is gathered over dp on every step."""
    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=512, seq_len=64, bias=False)
    with torch.device("meta"):
        model = GPT(cfg)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        plan = autoshard.plan(model, mesh, gpt_example_inputs(cfg, 16), constraints=BATCH_ON_DP)
    [nll_bw] = [d for d in plan.stages[0].ops if "nll_loss_backward" in d.op]
    assert nll_bw.output != ("R",), f"nll_loss_backward planned {nll_bw.output}: the batch was gathered"
    assert not any(c.kind == "all_gather" and "softmax" in c.consumer for c in plan.stages[0].collectives)


def test_fsdp_gathers_each_layers_parameters_with_one_collective_per_phase():
    """FSDP2's per-block all-gather: the lowered program gathers a layer's parameters together, once in the
    forward and once in the backward, instead of one all-gather per parameter and use."""
    from autoshard.compiler.lower import _gather_groups, trace_rank_program

    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, seq_len=16, bias=True)
    torch.manual_seed(0)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        planned = plan_graph(GPT(cfg), gpt_example_inputs(cfg, 8), mesh, get_cluster("cpu"), PlanConfig(recipe="fsdp"))
        gm, ctx = planned.graph, planned.ctx
        groups, uses = _gather_groups(list(gm.graph.nodes), (4,))
        grouped = collective_counts(trace_rank_program(gm, ctx))
        apart = collective_counts(trace_rank_program(gm, ctx, group_gathers=False))
    # one group per phase and layer (the 2 blocks, and the root: embeddings and final norm)
    assert sorted((g[0], g[1]) for g in groups) == sorted(
        (ph, layer) for ph in ("forward", "backward") for layer in (("layers", 0), ("layers", 1), ("", -1))
    )
    assert sum(len(m) for m in groups.values()) >= 20
    # every gathered use but one per group is now served by its group's single all-gather
    assert apart["all_gather_into_tensor"] - grouped["all_gather_into_tensor"] == len(uses) - len(groups)
    assert {k: v for k, v in grouped.items() if k != "all_gather_into_tensor"} == {
        k: v for k, v in apart.items() if k != "all_gather_into_tensor"
    }


def test_long_sequence_block_is_tensor_parallel_with_sequence_sharded_residuals():
    """Pure tensor parallelism on 4 H100s, 4096 tokens, d 4096: q, k, v and fc1 column-parallel, fc2 row-parallel
    with its output reduce-scattered onto the sequence (Megatron-SP); the attention output leaves the heads for
    the sequence by an all-to-all (DeepSpeed-Ulysses' move) and ``wo`` runs sequence-sharded on a whole weight.
    The residual stream is sequence-sharded and gathered before each norm: no all-reduce of activations. The
    cost comparisons: Megatron's row-parallel ``wo`` and a sequence-sharded norm each cost more."""
    cfg = GPTConfig(n_layer=2, d_model=4096, n_head=32, vocab=512, seq_len=4096, bias=False)
    planned = _planned(GPT, cfg, gpt_example_inputs(cfg, 1), (4,), ("tp",), "h100-sxm", {"inputs": "[R]"})
    plan, ctx = planned.plan, planned.ctx
    pl = plan.parameter_placements()
    for i in range(cfg.n_layer):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.fc1"):
            assert pl[f"layers.{i}.{name}.weight"] == ("S(0)",), name  # column-parallel
        assert pl[f"layers.{i}.mlp.fc2.weight"] == ("S(1)",)  # row-parallel
        assert pl[f"layers.{i}.attn.wo.weight"] == ("R",)
    fwd = [c for c in plan.stages[0].collectives if c.phase == "forward" and c.nbytes >= 1 << 20]
    kinds = [c.kind for c in fwd]
    assert sum(c.kind == "all_to_all" and c.consumer.startswith("mm") for c in fwd) == cfg.n_layer, fwd
    assert kinds.count("reduce_scatter") == cfg.n_layer, fwd
    assert "all_reduce" not in kinds, fwd
    assert sum(c.kind == "all_gather" and "layer_norm" in c.consumer for c in fwd) == 2 * cfg.n_layer, fwd
    sol = ctx.solution
    # Megatron's row-parallel wo: a reduce-scatter of its output (0.12 ms) where the all-to-all of the
    # attention output takes 0.04 ms, in the forward and again in the backward; the whole weight's gradient
    # costs one gather of 0.12 ms
    [wo] = [g for g in ctx.groups if g.kind == "parameter" and g.module == "layers.0.attn.wo"]
    assert _pinned_objective(ctx, wo, (Shard(1),)) > sol.objective_s
    # the norms run on the gathered sequence: sharding one saves 0.04 ms of norm work, but the backward's
    # fc1 weight gradient then needs the norm's output gathered once more (0.12 ms)
    [ln2] = [g for g in ctx.groups if g.module == "layers.0.ln2" and "layer_norm" in g.anchor and g.phase == "forward"]
    assert ctx.problem.strategies[ln2.id][sol.choice[ln2.id]].outputs[0][0] == (Replicate(),)
    assert _pinned_objective(ctx, ln2, (Shard(1),)) > sol.objective_s


def test_mixture_of_experts_is_expert_parallel_with_all_to_all_tokens():
    """Mixtral-shaped blocks (8 experts of 2048 -> 8192, top-2) on 8 H100s, the batch on dp: each device holds
    one expert (expert parallelism found, not asked for), the experts' matmuls run on their own expert's
    tokens, and the tokens come back to their sequences by an all-to-all; no collective ever moves an expert
    weight or its gradient. The cost comparisons: DDP (every expert replicated, 4x the memory) and the ep
    recipe."""
    cfg = MoEConfig(
        n_layer=2, d_model=2048, n_head=16, n_kv_head=8, ffn=8192, n_experts=8, top_k=2, vocab=1024, seq_len=2048
    )
    planned = _planned(MoEDecoder, cfg, moe_example_inputs(cfg, 8), (8,), ("dp",), "h100-sxm", BATCH_ON_DP)
    plan, gm, ctx = planned.plan, planned.graph, planned.ctx
    experts = {k: v for k, v in plan.parameter_placements().items() if ".moe.w" in k}
    assert len(experts) == 3 * cfg.n_layer and set(experts.values()) == {("S(0)",)}
    stage = plan.stages[0]
    bmms = [
        d
        for d in stage.ops
        if ".moe" in d.module and d.op.startswith("aten.bmm") and d.phase == "forward" and d.shape[0] == cfg.n_experts
    ]
    assert len(bmms) == 3 * cfg.n_layer and all(d.inputs == (("S(0)",), ("S(0)",)) for d in bmms), bmms
    fwd = [c for c in stage.collectives if c.phase == "forward"]
    assert sum(c.kind == "all_to_all" for c in fwd) >= 2 * cfg.n_layer, fwd
    weights = {
        n.name
        for n in gm.graph.nodes
        if n.op == "placeholder" and ".moe.w" in getattr(n.meta.get("autoshard_role"), "name", "")
    }
    moved = [c for c in stage.collectives if c.tensor in weights or ".moe.w" in c.consumer]
    assert not moved, moved
    recipes = {r.name: r for r in ctx.recipes}
    assert ctx.solution.objective_s <= recipes["ep"].objective_s < recipes["ddp"].objective_s
    assert plan.peak_memory.total < {r.name: r for r in plan.recipes}["ddp"].peak_memory_bytes / 3


def test_long_sequence_attention_is_context_parallel():
    """One 32768-token sequence on 2 x 8 H100s, its tokens split: attention splits the 8 heads over one axis and
    runs context-parallel over the other, as ring attention (queries, keys and values all on their sequence
    chunk, the chunks passed around the ring behind the compute, causal work balanced). The cost comparisons:
    the keys and values gathered instead (Llama 3's all-gathered K/V), and attention whole on the sequence's
    axis, each cost more. (On one axis of 8 the ring also beats splitting the heads, Ulysses-style: 61.4 ms
    against 62.0 ms on this model with 2 K/V heads.)"""
    cfg = LlamaConfig(n_layer=2, d_model=1024, n_head=8, n_kv_head=8, ffn=3584, vocab=512, seq_len=32768)
    planned = _planned(
        Llama, cfg, llama_example_inputs(cfg, 1), (2, 8), ("cp", "tp"), "h100-sxm:2x8", {"inputs": "[S(1), R]"}
    )
    plan, ctx = planned.plan, planned.ctx
    attn = [d for d in plan.stages[0].ops if d.op.startswith("aten._scaled_dot_product_flash_attention_for_cpu")]
    fwd = [d for d in attn if d.phase == "forward"]
    bwd = [d for d in attn if d.phase == "backward"]
    assert len(fwd) == len(bwd) == cfg.n_layer
    layout = fwd[0].output
    assert sorted(layout) == ["S(1)", "S(2)"], layout  # heads on one axis, the sequence on the other
    assert all(d.output == layout and d.inputs == (layout,) * 3 for d in fwd), fwd
    assert all(d.inputs[1:4] == (layout,) * 3 for d in bwd), bwd
    seq = layout.index("S(2)")
    [g] = [
        g
        for g in ctx.groups
        if g.module == "layers.0.attention" and g.phase == "forward" and "flash_attention" in g.anchor
    ]
    cands = ctx.problem.strategies[g.id]
    heads = tuple(Shard(1) if a != seq else Replicate() for a in range(2))
    gathered = {
        i for i, st in enumerate(cands) if st.outputs[0][0][seq] == Shard(2) and st.inputs[0][1][seq] == Replicate()
    }
    assert gathered
    gathered_s = ctx.problem.solve(memory_budget=None, time_limit_s=30, pins={g.id: gathered}).objective_s
    assert gathered_s > ctx.solution.objective_s
    assert _pinned_objective(ctx, g, heads) > gathered_s  # whole on the sequence's axis


def test_large_vocabulary_is_megatron_with_vocabulary_parallel_loss():
    """Megatron tensor parallelism whole on tp (2 x 2 H100s, tokens whole on tp, a 65536-word vocabulary): q, k, v
    and fc1 column-parallel, wo and fc2 row-parallel and reduce-scattered onto the sequence (Megatron-SP), the
    tied output layer column-parallel over the vocabulary, and the cross-entropy on the vocabulary slices
    (``autoshard/rules/vocab_loss.py``), forward and backward: two activation reductions per layer on tp. The cost
    comparison: the logits gathered over the vocabulary, or split over the tokens instead, each cost more. (The
    embedding lookup reads a hidden-split copy of the tied weight: DTensor's vocabulary-split lookup leaves a
    masked partial the planner does not take.)"""
    cfg = GPTConfig(n_layer=1, d_model=2048, n_head=16, vocab=65536, seq_len=512, bias=False)
    planned = _planned(GPT, cfg, gpt_example_inputs(cfg, 8), (2, 2), ("dp", "tp"), "h100-sxm", {"inputs": "[S(0), R]"})
    plan, ctx = planned.plan, planned.ctx
    tp = {k: v[1] for k, v in plan.parameter_placements().items()}
    for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.fc1"):
        assert tp[f"layers.0.{name}.weight"] == "S(0)", name  # column-parallel
    for name in ("attn.wo", "mlp.fc2"):
        assert tp[f"layers.0.{name}.weight"] == "S(1)", name  # row-parallel
    assert tp["wte.weight"] == "S(0)"  # the output layer split over the vocabulary
    loss = [
        d
        for d in plan.stages[0].ops
        if d.op
        in (
            "aten._log_softmax.default",
            "aten.nll_loss_forward.default",
            "aten.nll_loss_backward.default",
            "aten._log_softmax_backward_data.default",
        )
    ]
    assert len(loss) == 4 and all(("S(0)", "S(1)") in d.inputs for d in loss), loss
    fwd = [c for c in plan.stages[0].collectives if c.axis == "tp" and c.phase == "forward"]
    # one reduction of the layer's activations after wo and one after fc2: both reduce-scattered onto the
    # sequence (Megatron-SP) on torch 2.13; on torch 2.11, whose view rules differ, the first is an all-reduce
    reductions = [c for c in fwd if c.kind in ("all_reduce", "reduce_scatter") and c.nbytes > 1 << 20]
    assert len(reductions) == 2, fwd
    if not torch.__version__.startswith("2.11"):
        assert {c.kind for c in reductions} == {"reduce_scatter"}, fwd
    [g] = [g for g in ctx.groups if g.anchor == "_log_softmax"]
    for other in ((Shard(0), Replicate()), (Shard(0), Shard(0))):
        assert _pinned_objective(ctx, g, other) > ctx.solution.objective_s * 1.02, other
