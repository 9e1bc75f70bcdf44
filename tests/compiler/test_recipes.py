"""Manual recipes as Plans: each has the placements its name promises, the solved plan is never slower than
any recipe that fits, and a recipe plan trains with the same numerics as one device."""

from __future__ import annotations

import math

import pytest
import torch
from harness import (
    assert_close_to_reference,
    case_result,
    local_ranks,
    run_two_at_a_time,
    selected_cases,
    single_device_reference,
)
from numerics_utils import LR, MODELS, PARAM_ATOL, train_sharded
from torch.distributed.device_mesh import init_device_mesh

import autoshard
from autoshard.cluster.meshes import fake_world
from autoshard.config import normalize
from autoshard.models.gpt import GPT, GPTConfig, gpt_example_inputs
from autoshard.models.llama import Llama, LlamaConfig, llama_example_inputs
from autoshard.models.mlp import MLP, mlp_example_inputs
from autoshard.models.moe import MoEConfig, MoEDecoder, moe_example_inputs
from autoshard.plans.report import report
from autoshard.solver.recipes import applicable, is_expert_weight, tp_role

CFG = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, seq_len=16)
SMALL_LLAMA = LlamaConfig(n_layer=2, d_model=128, n_head=4, n_kv_head=2, ffn=256, vocab=256, seq_len=32)


def _gpt() -> GPT:
    with torch.device("meta"):
        return GPT(CFG)


def _plan(recipe: str | None, shape=(2, 2), names=("dp", "tp"), **kw):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if recipe is None:
        return autoshard.plan(_gpt(), mesh, gpt_example_inputs(CFG, 8), **kw)
    return autoshard.recipe(recipe, _gpt(), mesh, gpt_example_inputs(CFG, 8), **kw)


def test_recipe_names_and_applicability():
    assert normalize("Megatron") == "tp" and normalize("zero3") == "fsdp" and normalize("2d") == "fsdp+tp"
    assert normalize("ZeRO-2") == "zero2" and normalize("hybrid") == "hsdp"
    assert normalize("fsdp+ep") == "ep"
    with pytest.raises(ValueError, match="known recipes: ddp, zero1, zero2, fsdp, hsdp, tp, fsdp\\+tp, ep"):
        normalize("zero-bubble")
    assert applicable((8,)) == ("ddp", "zero1", "zero2", "fsdp", "tp")
    assert applicable((4, 8)) == ("ddp", "zero1", "zero2", "fsdp", "hsdp", "tp", "fsdp+tp")
    assert applicable((4, 1)) == ("ddp", "zero1", "zero2", "fsdp")
    assert applicable((8,), experts=True) == ("ddp", "zero1", "zero2", "fsdp", "ep", "tp")  # models with experts
    assert is_expert_weight("MoEFeedForward", (8, 64, 128)) and is_expert_weight("MixtralExperts", (4, 256, 64))
    assert not is_expert_weight("ViT", (1, 257, 64)) and not is_expert_weight("Conv1d", (64, 32, 3))


def test_tp_roles_follow_megatron():
    assert tp_role("layers.0.attn.wq.weight", "Linear", (64, 64)) == ("column", 0)
    assert tp_role("layers.0.attn.wo.weight", "Linear", (64, 64)) == ("row", 1)
    assert tp_role("layers.0.mlp.fc1.bias", "Linear", (256,)) == ("column-bias", 0)
    assert tp_role("h.0.mlp.c_fc.weight", "Conv1D", (64, 256)) == ("column", 1)  # HF GPT-2 stores [in, out]
    assert tp_role("layers.0.moe.w2", "MoEFeedForward", (8, 256, 64)) == ("row", 1)
    assert tp_role("wte.weight", "Embedding", (128, 64)) == ("vocab", 0)
    assert tp_role("ln_f.weight", "LayerNorm", (64,)) == ("replicated", None)


def test_each_recipe_has_the_placements_its_name_promises():
    with fake_world(4):
        ddp = _plan("ddp").parameter_placements()
        fsdp = _plan("fsdp").parameter_placements()
        tp = _plan("tp")
        fsdp_tp = _plan("fsdp+tp").parameter_placements()
        hsdp = _plan("hsdp").parameter_placements()
        zero1, zero2 = _plan("zero1"), _plan("zero2")
        full = _plan("ddp").peak_memory
    assert set(ddp.values()) == {("R", "R")}
    assert set(hsdp.values()) == {("R", "S(0)")}  # sharded within the last axis, replicated over the first
    for z in (zero1, zero2):  # replicated for compute; gradients (ZeRO-2) and optimizer state sharded on both axes
        params = [t for t in z.stages[0].tensors if t.role == "parameter"]
        assert {(t.placements, t.state_placements, t.zero) for t in params} == {
            (("R", "R"), ("S(0)", "S(0)"), z.recipe)
        }
        assert {t.grad_placements for t in params} == {("R", "R") if z.recipe == "zero1" else ("S(0)", "S(0)")}
    # the state's share: ZeRO-1 and ZeRO-2 hold a quarter of DDP's optimizer state, ZeRO-2 a quarter of its gradients
    assert zero1.peak_memory.optimizer * 4 == full.optimizer and zero1.peak_memory.gradients == full.gradients
    assert zero2.peak_memory.gradients * 4 == full.gradients
    # FSDP: every parameter Shard(0) over the whole mesh (all dims here divide by 4)
    assert set(fsdp.values()) == {("S(0)", "S(0)")}
    pp = tp.parameter_placements()
    assert tp.recipe == "tp" and tp.input_placements()[0] == ("S(0)", "R")
    for i in range(CFG.n_layer):
        a, m = f"layers.{i}.attn", f"layers.{i}.mlp"
        for name in ("wq", "wk", "wv"):
            assert pp[f"{a}.{name}.weight"] == ("R", "S(0)") and pp[f"{a}.{name}.bias"] == ("R", "S(0)")
        assert pp[f"{a}.wo.weight"] == ("R", "S(1)") and pp[f"{a}.wo.bias"] == ("R", "R")
        assert pp[f"{m}.fc1.weight"] == ("R", "S(0)") and pp[f"{m}.fc2.weight"] == ("R", "S(1)")
        # FSDP on the dim tp leaves whole (un-sharding dp then keeps tp's shard with one all-gather)
        assert fsdp_tp[f"{m}.fc1.weight"] == ("S(1)", "S(0)") and fsdp_tp[f"{m}.fc2.weight"] == ("S(0)", "S(1)")
        # a column-parallel bias has no dim tp leaves whole: replicated on dp rather than nested [S(0), S(0)]
        assert fsdp_tp[f"{a}.wq.bias"] == ("R", "S(0)") and fsdp_tp[f"{a}.wo.bias"] == ("S(0)", "R")
    assert pp["wte.weight"] == ("R", "S(0)")  # vocab-parallel embedding (tied head)
    assert pp["ln_f.weight"] == ("R", "R")


def test_ep_recipe_shards_experts_and_needs_them():
    """ep: each stacked expert weight on its expert dim over the last axis and its own FSDP over the others, the
    dense part replicated; a model without experts is refused by name."""
    cfg = MoEConfig(n_layer=1, d_model=32, n_head=4, n_kv_head=2, ffn=64, n_experts=4, top_k=2, vocab=64, seq_len=16)
    with fake_world(4):
        with torch.device("meta"):
            model = MoEDecoder(cfg)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        ep = autoshard.recipe("ep", model, mesh, moe_example_inputs(cfg, 8)).parameter_placements()
        with pytest.raises(ValueError, match="recipe 'ep' shards stacked expert weights .* this model has none"):
            autoshard.recipe("ep", MLP(16, 32, 16), mesh, mlp_example_inputs(8, 16, 16))
    assert {k: v for k, v in ep.items() if ".moe.w" in k} == {
        f"layers.0.moe.{w}": ("S(1)", "S(0)") for w in ("w1", "w2", "w3")
    }
    assert {v for k, v in ep.items() if ".moe.w" not in k} == {("R", "R")}


def _check_never_worse(plan):
    feasible = [b for b in plan.recipes if b.applies and b.fits]
    assert feasible, "no recipe to compare with"
    for b in feasible:
        assert plan.step_time_s <= b.step_time_s * (1 + 1e-6), (b.name, plan.step_time_s, b.step_time_s)
    best = plan.best_recipe()
    assert best is not None and plan.step_time_s <= best.step_time_s * (1 + 1e-6)
    assert "vs manual recipes" in report(plan)


@pytest.mark.parametrize("shape,names", [((2, 2), ("dp", "tp")), ((4,), ("dp",))])
def test_solved_plan_never_slower_than_a_recipe_gpt(shape, names):
    with fake_world(4):
        plan = _plan(None, shape, names)
    assert {b.name for b in plan.recipes} == set(applicable(shape))  # (16 tokens: no cp)
    _check_never_worse(plan)


def test_solved_plan_never_slower_than_a_recipe_llama_and_mlp_under_budget():
    cfg = SMALL_LLAMA
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            llama = Llama(cfg)
        _check_never_worse(autoshard.plan(llama, mesh, llama_example_inputs(cfg, 8)))
        mesh1 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        with torch.device("meta"):
            mlp = MLP(512, 2048, 512)
        free = autoshard.plan(mlp, mesh1, mlp_example_inputs(256, 512, 512))
        ddp = next(b for b in free.recipes if b.name == "ddp")
        budget = int(ddp.peak_memory_bytes * 0.7)
        with torch.device("meta"):
            mlp = MLP(512, 2048, 512)
        tight = autoshard.plan(mlp, mesh1, mlp_example_inputs(256, 512, 512), memory_budget=budget)
    assert not next(b for b in tight.recipes if b.name == "ddp").fits  # DDP is over the budget: marked OOM
    assert tight.peak_memory.total <= budget
    _check_never_worse(tight)
    assert "OOM" in report(tight)


TRAINED = [
    ("fsdp", (4,), ("dp",)),
    ("ddp", (4,), ("dp",)),
    ("fsdp", (2, 2), ("dp", "tp")),
    ("fsdp+tp", (2, 2), ("dp", "tp")),
]


def _train_recipe(case: tuple) -> tuple:
    recipe, shape, names = case
    make, inputs_fn = MODELS["gpt"]
    inputs = inputs_fn()  # outside LocalTensorMode: inside, each simulated rank would draw different tokens
    ref = single_device_reference(make, inputs, steps=3, lr=LR)
    with local_ranks(4):
        got = train_sharded(make, inputs, shape, names, steps=3, lr=LR, recipe=recipe)
    return ref, got


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest) -> dict:
    """The selected cases' LocalTensorMode runs, two at a time in forked processes (single-threaded work)."""
    cases = [
        (r, s, n)
        for r, s, n in TRAINED
        if (r, s, n) in selected_cases(request, "test_recipe_plan_trains_like_one_device", "case")
    ]
    return run_two_at_a_time(_train_recipe, cases)


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAINED, ids=[f"{r}-{'x'.join(map(str, s))}" for r, s, _ in TRAINED])
def test_recipe_plan_trains_like_one_device(case, trained):
    """A recipe is a Plan that runs: the recipe on LocalTensorMode (2, 2) equals single-device training."""
    recipe = case[0]
    ref, got = case_result(trained, case)
    assert f'"recipe": "{recipe}"' in got["plan"]
    assert_close_to_reference(ref, got["losses"], got["grads"], got["params"], param_atol=PARAM_ATOL)


def test_sampled_layers_stand_for_the_whole_model():
    """Capturing 3 of 6 identical layers gives the same predicted time and memory as capturing all 6."""
    cfg = GPTConfig(n_layer=6, d_model=64, n_head=4, vocab=128, seq_len=16)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plans = []
        for sample in (None, 3):
            with torch.device("meta"):
                model = GPT(cfg)
            plans.append(
                autoshard.plan(model, mesh, gpt_example_inputs(cfg, 8), sample_layers=sample, solve_recipes=False)
            )
    full, sampled = plans
    assert "3 of 6" in sampled.sampled_layers and not full.sampled_layers
    assert math.isclose(sampled.step_time_s, full.step_time_s, rel_tol=1e-6)
    assert math.isclose(sampled.peak_memory.total, full.peak_memory.total, rel_tol=1e-6)
    names = sampled.parameter_placements()
    assert "layers.2.mlp.fc1.weight" in names and "layers.3.mlp.fc1.weight" not in names


@pytest.fixture(scope="module")
def llama_on_2x4():
    """A small Llama planned on a fake (2, 4) mesh, no recipes: its graph and pass context (the integer program)."""
    from autoshard.cluster.presets import get_cluster
    from autoshard.config import PlanConfig
    from autoshard.search.recompute import plan_graph

    cfg = SMALL_LLAMA
    with fake_world(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        with torch.device("meta"):
            llama = Llama(cfg)
        planned = plan_graph(
            llama, llama_example_inputs(cfg, 8), mesh, get_cluster("h100-sxm:1x8"), PlanConfig(solve_recipes=False)
        )
    return planned.graph, planned.ctx


def test_the_integer_program_prices_any_choice_as_evaluate_does(llama_on_2x4):
    """The model (written as CpModelProto text, ``IntraOpProblem._build``) with every decision group's candidate
    forced prices that choice exactly as ``evaluate`` does: each edge's booleans, marginals and costs, the unary
    terms and the constant of the groups with one candidate."""
    import random

    _, ctx = llama_on_2x4
    problem = ctx.problem
    every = {c: frozenset(range(len(problem.strategies[c]))) for c in problem.canon_ids}
    rng = random.Random(0)
    base = {c: ctx.solution.choice[c] for c in problem.canon_ids}
    for _ in range(5):  # the optimum with a dozen groups moved to another candidate (most random choices are
        choice = dict(base)  # moves no collective makes, priced infinite)
        for c in rng.sample(problem.canon_ids, 12):
            trial = {**choice, c: rng.randrange(len(problem.strategies[c]))}
            if math.isfinite(problem.evaluate(trial)):
                choice = trial
        assert choice != base
        sol = problem.solve(
            memory_budget=None, time_limit_s=10, pins={c: {i} for c, i in choice.items()}, within=every, what="forced"
        )
        assert math.isclose(sol.objective_s, problem.evaluate(choice), rel_tol=1e-9, abs_tol=1e-6)
        assert sol.objective_s > problem.evaluate(base)


def test_recipes_that_pin_the_ops_alike_share_one_smaller_model_and_solve_to_the_same_optimum(llama_on_2x4):
    """ddp, zero1/2, fsdp and hsdp keep the same ops on the batch shard and differ in their parameters: they solve
    copies of one model over the union of their candidates (``shared_models``), smaller than the model of every
    candidate, and each reaches the optimum it reaches on that whole model."""
    from autoshard.compiler.solve_recipes import recipe_pins, shared_models, solve_recipe

    gm, ctx = llama_on_2x4
    names = applicable(ctx.mesh_shape)
    pinned = {r: recipe_pins(r, gm, ctx) for r in names}
    within = shared_models(pinned, ctx)
    dp_kind = {"ddp", "zero1", "zero2", "fsdp", "hsdp"} & set(names)
    assert dp_kind <= set(within) and len({id(within[r]) for r in dp_kind}) == 1  # one model for them all
    every = sum(len(s) for s in ctx.strategies.values())
    shared = every - sum(len(ctx.strategies[c]) - len(k) for c, k in within["ddp"].items())
    assert shared < 0.8 * every
    for r in within:
        alone = solve_recipe(r, gm, ctx, pinned=recipe_pins(r, gm, ctx))
        together = solve_recipe(r, gm, ctx, pinned=recipe_pins(r, gm, ctx), within=within[r])
        assert math.isclose(together.objective_s, alone.objective_s, rel_tol=1e-6), r
        for g, i in together.solution.choice.items():  # the recipe's own pins still hold
            keep = pinned[r][0].get(ctx.layer_of_group.get(g, g))
            assert keep is None or i in keep, (r, g, i)
