"""The inter-op stage DP (autoshard.solver.inter_op) on hand-made piece costs, checked by brute force."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from autoshard.solver.inter_op import (
    PieceCost,
    best_split,
    check_schedule,
    in_flight,
    pipeline_time,
    split_layers,
)


def _brute(layers, head, tail, stages, budget, b, schedule="1F1B"):
    """Every contiguous split, 1F1B: the smallest max stage time whose stages all fit."""
    n = len(layers)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = list(zip((0, *cuts), (*cuts, n)))
        worst = 0.0
        ok = True
        for k, (i, j) in enumerate(bounds):
            t = (
                sum(c.time_s for c in layers[i:j])
                + (head.time_s if k == 0 else 0)
                + (tail.time_s if k == stages - 1 else 0)
            )
            st = (
                sum(c.state_bytes for c in layers[i:j])
                + (head.state_bytes if k == 0 else 0)
                + (tail.state_bytes if k == stages - 1 else 0)
            )
            act = (
                sum(c.act_bytes for c in layers[i:j])
                + (head.act_bytes if k == 0 else 0)
                + (tail.act_bytes if k == stages - 1 else 0)
            )
            if budget is not None and st + in_flight(schedule, k, stages, b, 1) * act > budget:
                ok = False
            worst = max(worst, t)
        if ok:
            best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_split_minimizes_the_slowest_stage_like_brute_force(seed):
    import random

    rng = random.Random(seed)
    layers = [
        PieceCost(rng.uniform(1, 3), state_bytes=rng.randint(5, 20), act_bytes=rng.randint(1, 4)) for _ in range(9)
    ]
    head, tail = PieceCost(2.0, state_bytes=30, act_bytes=2), PieceCost(4.0, state_bytes=30, act_bytes=1)
    budget = rng.choice([None, 90, 120])
    got = split_layers(layers, head, tail, stages=3, microbatches=6, memory_budget=budget)
    want = _brute(layers, head, tail, 3, budget, 6)
    if math.isinf(want):
        assert got is None
        return
    assert got is not None and math.isclose(max(got.stage_time_s), want)
    assert got.layers[0][0] == 0 and got.layers[-1][1] == 9
    assert all(a[1] == b[0] for a, b in zip(got.layers, got.layers[1:]))  # contiguous, nothing dropped
    if budget is not None:
        assert max(got.stage_memory_bytes) <= budget


def test_identical_layers_balance_around_head_and_tail():
    layers = [PieceCost(1.0)] * 8
    s = split_layers(layers, PieceCost(0.5), PieceCost(2.5), stages=2, microbatches=4)
    # 11 units of work; the tail's stage takes fewer layers: [0, 5) + head = 5.5, [5, 8) + tail = 5.5
    assert s.layers == ((0, 5), (5, 8)) and s.stage_time_s == (5.5, 5.5)
    # 1F1B: sum + (B - 1) max = 11 + 3 * 5.5
    assert math.isclose(s.step_time_s, 27.5)
    assert math.isclose(s.bubble_fraction, (27.5 - 4 * 5.5) / 27.5)


def test_schedule_formulas_and_in_flight_memory():
    times = [2.0, 2.0, 2.0, 2.0]
    assert pipeline_time("GPipe", times, 8, 1)[0] == pipeline_time("1F1B", times, 8, 1)[0] == 8 + 7 * 2
    assert pipeline_time("Interleaved1F1B", times, 8, 2)[0] == 8 * 2 + 3 * 2 / 2
    assert pipeline_time("InterleavedZeroBubble", times, 8, 2)[0] == pytest.approx(8 * 2 + 3 * 2 / 6)
    assert in_flight("GPipe", 0, 4, 8, 1) == 8
    assert [in_flight("1F1B", r, 4, 8, 1) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("Interleaved1F1B", 0, 4, 8, 2) == 4 + 1.5


def test_schedule_rules_name_the_numbers():
    assert "at least as many micro-batches as stages (2 < 4)" in check_schedule("1F1B", 4, 2, 1)
    assert "multiple of the stages" in check_schedule("Interleaved1F1B", 4, 6, 2)
    assert "2 model chunks" in check_schedule("Interleaved1F1B", 4, 8, 1)
    assert check_schedule("GPipe", 4, 2, 1) is None
    with pytest.raises(ValueError, match="not known"):
        split_layers([PieceCost(1.0)] * 4, PieceCost(0), PieceCost(0), 2, 4, schedule="Looped")


def test_memory_decides_between_gpipe_and_1f1b():
    """GPipe keeps every micro-batch in flight; under a budget only 1F1B fits, without a budget they tie."""
    layers = [PieceCost(1.0, state_bytes=10, act_bytes=10)] * 8
    head = tail = PieceCost(0.0)
    free = best_split(layers, head, tail, stages=2, microbatches=8, schedules=("GPipe", "1F1B"))
    assert free.schedule == "GPipe"  # equal time: the first listed wins the tie
    tight = best_split(
        layers, head, tail, stages=2, microbatches=8, memory_budget=40 + 2 * 40 + 5, schedules=("GPipe", "1F1B")
    )
    assert tight.schedule == "1F1B" and max(tight.stage_memory_bytes) <= 125
    assert best_split(layers, head, tail, stages=2, microbatches=8, memory_budget=50) is None


def test_interleaving_pays_off_with_few_micro_batches():
    layers = [PieceCost(1.0)] * 16
    s = best_split(layers, PieceCost(0), PieceCost(0), stages=4, microbatches=4, schedules=("1F1B", "Interleaved1F1B"))
    one = split_layers(layers, PieceCost(0), PieceCost(0), 4, 4, "1F1B")
    assert s.schedule == "Interleaved1F1B" and s.chunks >= 2 and s.step_time_s < one.step_time_s
    # rank r holds chunks r, r + 4, ...: 8 pieces of 2 layers for chunks=2
    if s.chunks == 2:
        assert len(s.layers) == 8 and all(j - i == 2 for i, j in s.layers)


@pytest.mark.parametrize("sample", [None, 3])
def test_piece_costs_add_up_to_the_plan(sample):
    """Head + every layer + tail of a solved plan (per-micro-batch time plus once-per-step gradient work) is
    the plan's predicted step; sampled layers are extrapolated to the full depth."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.cluster.meshes import fake_world
    from autoshard.cluster.presets import get_cluster
    from autoshard.config import PlanConfig
    from autoshard.models.llama import Llama, LlamaConfig, llama_example_inputs
    from autoshard.pipeline.costs import piece_costs
    from autoshard.search.recompute import plan_graph

    cfg = LlamaConfig(n_layer=6, d_model=64, n_head=4, n_kv_head=2, ffn=128, vocab=256, seq_len=32)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            model = Llama(cfg)
        planned = plan_graph(
            model,
            llama_example_inputs(cfg, 8),
            mesh,
            get_cluster("h100-sxm:1x4"),
            PlanConfig(sample_layers=sample, solve_recipes=False),
        )
        plan, gm, ctx = planned.plan, planned.graph, planned.ctx
        head, layers, tail = piece_costs(gm, ctx)
    assert len(layers) == 6
    total = head.time_s + tail.time_s + sum(c.time_s + c.step_s for c in layers) + head.step_s + tail.step_s
    assert math.isclose(total, plan.step_time_s, rel_tol=1e-6), (total, plan.step_time_s)
    state = head.state_bytes + tail.state_bytes + sum(c.state_bytes for c in layers)
    assert math.isclose(
        state, plan.peak_memory.parameters + plan.peak_memory.gradients + plan.peak_memory.optimizer, rel_tol=1e-6
    )
    assert head.time_s > 0 and tail.time_s > 0 and layers[2].time_s > 0
    assert layers[1] == layers[2]  # identical middle layers cost the same
    # recomputation's numbers: the forward is part of the time, and the layer input [8, 32, 64] fp32 is what a
    # layer keeps (in the layout its producer chose: some share of the 65536 global bytes)
    assert 0 < layers[2].fwd_s < layers[2].time_s
    assert 0 < layers[2].input_bytes <= 8 * 32 * 64 * 4 and (8 * 32 * 64 * 4) % layers[2].input_bytes == 0
    assert layers[2].input_bytes < layers[2].act_bytes


@pytest.mark.slow
def test_deep_narrow_model_on_a_slow_network_gets_balanced_stages():
    """A 16-layer narrow GPT on 4 A100 nodes (200 Gb/s per GPU between nodes): splitting the layers into
    stages across nodes beats spreading every layer's collectives over the network; stage times are balanced
    within 25%, and the plain intra-op plan (1 stage) is among the options compared."""
    import torch

    from autoshard.cluster.presets import get_cluster
    from autoshard.config import PlanConfig
    from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
    from autoshard.pipeline.search import search_pipeline

    cfg = GPTConfig(n_layer=16, d_model=256, n_head=4, vocab=512, seq_len=128)
    with torch.device("meta"):
        model = GPT(cfg)
    options = search_pipeline(
        model,
        gpt_example_inputs(cfg, 32),
        get_cluster("a100-80gb:4x8"),
        PlanConfig(sample_layers=3),
        microbatch_options=3,
    )
    best = options[0]
    flat = next(o for o in options if o.stages == 1)
    assert best.stages > 1 and best.step_time_s < flat.step_time_s
    times = best.split.stage_time_s
    assert max(times) <= 1.25 * min(times), times
    covered = sorted(best.split.layers)
    assert covered[0][0] == 0 and covered[-1][1] == 16


# --- activation recomputation, Megatron's even split, fixed configurations --------------------------------------


def test_recompute_trades_the_forward_time_for_memory():
    """With recomputation a layer keeps only its input per in-flight micro-batch (plus one layer's whole set
    while it runs backward), and its time grows by its forward."""
    layer = PieceCost(3.0, state_bytes=10, act_bytes=20, fwd_s=1.0, input_bytes=2)
    layers, nothing = [layer] * 8, PieceCost(0.0)
    plain = split_layers(layers, nothing, nothing, stages=2, microbatches=8, schedule="1F1B")
    again = split_layers(layers, nothing, nothing, stages=2, microbatches=8, schedule="1F1B", recompute=True)
    assert plain.layers == again.layers == ((0, 4), (4, 8))
    assert not plain.recompute and again.recompute
    assert again.stage_time_s == tuple(t + 4 * 1.0 for t in plain.stage_time_s)  # 4 layers' forwards per stage
    # stage 0 keeps min(8, 2 - 0) = 2 micro-batches: 40 state + 2 x 4 x 20 vs 40 + 2 x 4 x 2 + 20 (one layer)
    assert plain.stage_memory_bytes == (40 + 2 * 80, 40 + 1 * 80)
    assert again.stage_memory_bytes == (40 + 2 * 8 + 20, 40 + 1 * 8 + 20)
    # 1F1B: sum of the stage times + (B - 1) x the slowest
    assert again.step_time_s == pytest.approx(2 * 16 + 7 * 16) and plain.step_time_s == pytest.approx(2 * 12 + 7 * 12)


def test_recompute_is_chosen_only_where_only_it_fits():
    layers, nothing = [PieceCost(3.0, state_bytes=10, act_bytes=20, fwd_s=1.0, input_bytes=2)] * 8, PieceCost(0.0)
    free = best_split(layers, nothing, nothing, 2, 8, schedules=("1F1B",), recompute=None)
    assert not free.recompute  # without a budget it only costs time
    tight = best_split(layers, nothing, nothing, 2, 8, memory_budget=100, schedules=("1F1B",), recompute=None)
    assert tight.recompute and max(tight.stage_memory_bytes) <= 100
    assert tight.step_time_s > free.step_time_s
    assert best_split(layers, nothing, nothing, 2, 8, memory_budget=60, schedules=("1F1B",), recompute=None) is None


def test_head_and_tail_keep_their_activations_under_recompute():
    layers = [PieceCost(1.0, act_bytes=20, fwd_s=0.5, input_bytes=2)] * 4
    head, tail = PieceCost(1.0, act_bytes=100, fwd_s=0.5, input_bytes=1), PieceCost(1.0, act_bytes=50, fwd_s=0.5)
    s = split_layers(layers, head, tail, stages=1, microbatches=1, schedule="GPipe", recompute=True)
    assert s.stage_time_s == (1.0 + 4 * 1.5 + 1.0,)  # head and tail are not run again
    assert s.stage_memory_bytes == (100 + 4 * 2 + 50 + 20,)


def test_even_split_is_megatrons_layout_and_the_dp_is_never_worse():
    from autoshard.solver.inter_op import even_bounds, even_split

    assert even_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(ValueError, match="cannot cut 3 layers"):
        even_bounds(3, 4)
    layers = [PieceCost(1.0)] * 16
    head, tail = PieceCost(0.2), PieceCost(3.0)  # a heavy output head on the last stage
    even = even_split(layers, head, tail, stages=4, microbatches=8, schedule="1F1B")
    assert even.layers == ((0, 4), (4, 8), (8, 12), (12, 16)) and even.stage_time_s == (4.2, 4.0, 4.0, 7.0)
    dp = split_layers(layers, head, tail, stages=4, microbatches=8, schedule="1F1B")
    assert max(dp.stage_time_s) < max(even.stage_time_s) and dp.step_time_s < even.step_time_s
    inter = even_split(layers, head, tail, stages=4, microbatches=8, schedule="Interleaved1F1B", chunks=2)
    assert len(inter.layers) == 8 and all(j - i == 2 for i, j in inter.layers)
    # best_split(even=True) interleaves only with chunks that divide the layers: 16 / (4 x 3) does not
    picked = best_split(layers, head, tail, 4, 8, schedules=("Interleaved1F1B",), max_chunks=3, even=True)
    assert picked.chunks == 2


def test_interleaved_ranks_send_at_every_chunk_boundary():
    s = split_layers([PieceCost(1.0)] * 16, PieceCost(0), PieceCost(0), 4, 8, "Interleaved1F1B", chunks=2, p2p_s=0.1)
    assert s.stage_time_s == pytest.approx((4.4,) * 4)  # 4 layers + 2 chunks x (activation + gradient) sends
    one = split_layers([PieceCost(1.0)] * 16, PieceCost(0), PieceCost(0), 4, 8, "1F1B", p2p_s=0.1)
    assert one.stage_time_s == pytest.approx((4.2,) * 4)


def test_microbatch_counts_and_stage_start():
    from autoshard.cluster.presets import get_cluster
    from autoshard.config import PlanConfig
    from autoshard.pipeline.search import microbatch_counts, stage_start

    # 4 stages of 8 devices, batch 32: micro-batches of 1, 2, 4, 8 sequences (B >= S)
    assert microbatch_counts(32, 4, 8, 8) == [4, 8, 16, 32]
    # one stage of 32 devices: from 4 sequences (one per node) up to the whole batch (B = 1)
    assert microbatch_counts(512, 1, 32, 8) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert microbatch_counts(6, 4, 8, 8) == [6] and microbatch_counts(6, 8, 8, 8) == []  # 6 sequences, 8 stages

    class Big(torch.nn.Module):  # 10 G parameters on meta, bf16: 160 GB with adamw-mixed
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(10**10, dtype=torch.bfloat16, device="meta"))

    cluster = get_cluster("a100-80gb:16x8")  # 8 x 80 GiB per node
    assert stage_start(Big(), cluster, PlanConfig(optimizer="adamw-mixed"), [1, 2, 4, 8, 16]) == 1
    assert (
        stage_start(Big(), cluster, PlanConfig(optimizer="adamw-mixed", memory_budget="10GiB"), [1, 2, 4, 8, 16]) == 2
    )


def _small_gpt(batch: int = 16):
    from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs

    cfg = GPTConfig(n_layer=8, d_model=512, n_head=8, vocab=512, seq_len=128, bias=False)
    with torch.device("meta"):
        model = GPT(cfg)
    return model, gpt_example_inputs(cfg, batch)


def test_a_fixed_tp_pp_dp_config_prices_megatrons_layout():
    """TP 8 in a node, 2 stages of 2 nodes each (DP 2), 8 micro-batches: the tp recipe on a
    (dp, tp) sub-mesh, layers split evenly; recomputation lowers memory and costs time."""
    from autoshard.cluster.presets import get_cluster
    from autoshard.config import PlanConfig
    from autoshard.pipeline.megatron import evaluate_config

    model, inputs = _small_gpt()
    cluster, config = get_cluster("a100-80gb:4x8"), PlanConfig(sample_layers=2)
    again = evaluate_config(model, inputs, cluster, config, tp=8, pp=2, dp=2, microbatches=8, recompute=True)
    plain = evaluate_config(
        model, inputs, cluster, config, tp=8, pp=2, dp=2, microbatches=8, schedule=again.split.schedule, recompute=False
    )
    assert again.recipe == "tp" and again.submesh == (2, 8) and again.stages == again.split.stages == 2
    assert "dp=2 x tp=8" in again.layout and "attn.wq [R, S(0)]" in again.layout  # column-parallel on tp
    sizes = {j - i for i, j in again.split.layers}
    assert len(sizes) == 1 and sum(j - i for i, j in again.split.layers) == 8  # even split, every layer once
    assert again.split.recompute and not plain.split.recompute and again.split.chunks == plain.split.chunks
    assert max(again.split.stage_memory_bytes) < max(plain.split.stage_memory_bytes)
    extra = [a - b for a, b in zip(again.split.stage_time_s, plain.split.stage_time_s)]
    # the forward share: more than nothing, less than half of a stage's forward + backward
    assert all(0 < e < 0.5 * t for e, t in zip(extra, plain.split.stage_time_s)), extra
    with pytest.raises(ValueError, match="tp=8 x pp=3 x dp=2 = 48 devices"):
        evaluate_config(model, inputs, cluster, config, tp=8, pp=3, dp=2, microbatches=8)


@pytest.mark.slow
def test_megatron_recipe_takes_the_smallest_pp_that_fits_and_the_search_is_not_slower():
    """On 4 nodes with a budget that one stage (TP 8 x DP 4) exceeds, Megatron's recipe takes PP 2 (TP 8 x DP 2
    per stage); the free search, which lists it among its options, finds something at least as fast."""
    from autoshard.cluster.presets import get_cluster
    from autoshard.config import PlanConfig
    from autoshard.pipeline.megatron import megatron_recipe
    from autoshard.pipeline.search import MEGATRON, search_pipeline

    model, inputs = _small_gpt()
    budget = 50 * 2**20  # TP 8 x DP 4 with recomputation needs ~73 MB per device, TP 8 x DP 2 x PP 2 ~38 MB
    cluster, config = get_cluster("a100-80gb:4x8"), PlanConfig(sample_layers=2, memory_budget=budget)
    options = search_pipeline(model, inputs, cluster, config, microbatch_options=2)
    options.append(megatron_recipe(model, inputs, cluster, config))
    base = next(o for o in options if o.recipe == MEGATRON)
    assert base.split is not None and base.stages == 2 and base.submesh == (2, 8) and base.note == "tp=8 pp=2 dp=2"
    assert base.split.recompute and max(base.split.stage_memory_bytes) <= budget
    best = next(o for o in options if o.recipe != MEGATRON and o.split is not None)
    assert best.step_time_s <= base.step_time_s and max(best.split.stage_memory_bytes) <= budget
