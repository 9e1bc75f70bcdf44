"""The model zoo: published shapes on meta, tiny real MoE/BERT/ViT models, MoE routing, planning, HF configs."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import autoshard
from autoshard.cluster.meshes import fake_world
from autoshard.cluster.presets import get_cluster
from autoshard.config import PlanConfig
from autoshard.models.bert import BertConfig
from autoshard.models.gpt import GPTConfig
from autoshard.models.llama import LlamaConfig
from autoshard.models.moe import MoEConfig, MoEFeedForward, route
from autoshard.models.vit import ViTConfig, patchify
from autoshard.models.zoo import ZooModel, get_model, known_models
from autoshard.search.recompute import plan_graph

# Published sizes: GPT-2 (Radford et al. 2019), Llama 3 Herd of Models (2024), Mixtral (Jiang et al. 2024),
# BERT (Devlin et al. 2019; 335M with the MLM head and no pooler), ViT (Dosovitskiy et al. 2021).
PUBLISHED = {
    "gpt2-124m": 124e6,
    "gpt2-1.5b": 1.56e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.8e9,
    "mixtral-8x7b": 46.7e9,
    "bert-large": 335e6,
    "vit-h14": 632e6,
}

TINY = {
    "gpt": GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, seq_len=32, bias=True),
    "llama": LlamaConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, ffn=96, vocab=128, seq_len=32),
    "mixtral": MoEConfig(
        n_layer=2, d_model=64, n_head=4, n_kv_head=2, ffn=64, n_experts=4, vocab=128, seq_len=32, group_size=16
    ),
    "bert": BertConfig(n_layer=2, d_model=64, n_head=4, ffn=128, vocab=128, seq_len=32),
    "vit": ViTConfig(n_layer=2, d_model=64, n_head=4, mlp=128, image_size=32, patch=8, n_classes=10),
}


def _tiny(family: str, **changes) -> ZooModel:
    cfg = dataclasses.replace(TINY[family], **changes)
    return ZooModel(f"tiny-{family}", family, "tiny test shape", cfg, cfg.n_layer, cfg.seq_len, "layers")


def _classes(m: ZooModel) -> int:
    return m.config.n_classes if m.family == "vit" else m.config.vocab


# ---------------------------------------------------------------------------------------------- the zoo


def test_known_models_are_the_published_set() -> None:
    assert set(known_models()) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_zoo_model_builds_on_meta_at_published_size(name: str) -> None:
    m = get_model(name)
    model = m.build()
    params = list(model.parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params)
    count = sum(p.numel() for p in params)
    assert count == m.num_params()
    assert abs(count / PUBLISHED[name] - 1) < 0.03, f"{name}: {count:,} parameters"
    assert len(getattr(model, m.layers_path)) == m.num_layers == m.config.n_layer
    assert m.description and m.default_seq == m.tokens_per_sample()
    inputs = m.example_inputs(batch=4)
    assert all(t.device.type == "meta" and t.shape[0] == 4 for t in inputs)


def test_llama3_8b_is_exact_and_depth_scales() -> None:
    m = get_model("llama3-8b")
    assert m.num_params() == 8_030_261_248
    assert m.default_seq == 8192
    small = m.build(num_layers=2)
    assert len(small.layers) == 2
    assert sum(p.numel() for p in small.parameters()) == m.num_params(num_layers=2)


def test_sequence_overrides() -> None:
    gpt = get_model("gpt2-124m")
    assert gpt.build(seq=2048).wpe.weight.shape == (2048, 768)  # positions grow past the published table
    assert gpt.build(seq=256).wpe.weight.shape == (1024, 768)  # shorter inputs keep it
    assert [tuple(t.shape) for t in gpt.example_inputs(2, seq=256)] == [(2, 256), (2, 256)]
    vit = get_model("vit-h14")
    assert vit.default_seq == 257 and vit.tokens_per_sample() == 257
    assert vit.tokens_per_sample(seq=577) == 577  # 24 x 24 patches of 14 px: 336 px images
    assert vit.example_inputs(2, seq=577)[0].shape == (2, 3, 336, 336)
    with pytest.raises(ValueError, match="square plus one"):
        vit.build(seq=300)


def test_example_inputs_on_cpu() -> None:
    tokens, types, labels = _tiny("bert").example_inputs(2, seq=16, device="cpu")
    assert tokens.dtype == types.dtype == labels.dtype == torch.long and tokens.shape == (2, 16)
    assert ((labels != -100).sum(dim=1) == 2).all()  # round(0.15 * 16) masked per row
    assert (tokens[labels != -100] == 103).all() and set(types.unique().tolist()) == {0, 1}
    images, classes = _tiny("vit").example_inputs(3, device="cpu", dtype=torch.float32)
    assert images.shape == (3, 3, 32, 32) and images.dtype == torch.float32 and classes.shape == (3,)


@pytest.mark.parametrize("family", ["gpt", "llama", "bert", "vit"])
def test_forward_flops_match_flop_counter(family: str) -> None:
    """The analytic model FLOPs equal what FlopCounterMode counts in one forward (math attention: full s^2)."""
    m = _tiny(family)
    torch.manual_seed(0)
    model = m.build(dtype=torch.float32, device="cpu")
    inputs = m.example_inputs(2, device="cpu", dtype=torch.float32)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*inputs)
    assert counter.get_total_flops() == pytest.approx(2 * m.train_flops_per_sample() / 3, rel=1e-9)


def test_mixtral_flops_count_active_experts_only() -> None:
    m = get_model("mixtral-8x7b")
    c, s = m.config, m.default_seq
    attention = 3 * 4 * c.n_layer * s * s * c.d_model
    active = (m.train_flops_per_sample() - attention) / (6 * s)  # matmul parameters one token uses
    assert abs(active / 12.9e9 - 1) < 0.03  # Mixtral: ~13B active of 46.7B (embedding lookup excluded here)


# ---------------------------------------------------------------------------------- tiny real models


@pytest.mark.parametrize("family", ["mixtral", "bert", "vit"])
def test_tiny_model_trains(family: str) -> None:
    m = _tiny(family)
    torch.manual_seed(0)
    model = m.build(dtype=torch.float32, device="cpu")
    loss = model(*m.example_inputs(4, device="cpu", dtype=torch.float32))
    assert loss.shape == () and torch.isfinite(loss)
    assert abs(loss.item() - math.log(_classes(m))) < 0.5  # small init: near-uniform predictions
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name  # includes every expert's w1/w2/w3 and the router


def _experts_reference(ff: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over all experts, top-k, gates renormalised to sum 1 (Mixtral), sum of experts."""
    out = torch.zeros_like(x)
    flat, res = x.reshape(-1, x.shape[-1]), out.view(-1, x.shape[-1])
    for t in range(flat.shape[0]):
        probs = F.softmax(ff.router(flat[t]), dim=-1)
        gates, idx = probs.topk(ff.cfg.top_k)
        for gate, e in zip(gates / gates.sum(), idx.tolist()):
            h = F.silu(flat[t] @ ff.w1[e]) * (flat[t] @ ff.w3[e])
            res[t] += gate * (h @ ff.w2[e])
    return out


def test_moe_layer_without_drops_equals_per_token_reference() -> None:
    # capacity_factor = n_experts / top_k makes the capacity the whole group: no token is dropped
    cfg = MoEConfig(d_model=32, n_head=4, n_kv_head=2, ffn=48, n_experts=4, top_k=2, group_size=8, capacity_factor=2.0)
    torch.manual_seed(0)
    ff = MoEFeedForward(cfg)
    for w in (ff.w1, ff.w3, ff.w2):
        torch.nn.init.normal_(w, std=0.1)
    x = torch.randn(2, 16, 32)
    got, aux = ff(x)
    torch.testing.assert_close(got, _experts_reference(ff, x), rtol=1e-5, atol=1e-5)
    assert 1.0 <= aux.item() < cfg.n_experts  # 1 exactly when perfectly balanced


def test_capacity_drops_later_choices_first() -> None:
    """GShard priority: every token's first choice gets a slot before any token's second choice."""
    probs = torch.tensor([[[0.3, 0.6, 0.1], [0.6, 0.3, 0.1]]])  # token 0 prefers expert 1, token 1 expert 0
    combine, dispatch, load = route(probs, top_k=2, capacity=1)
    assert dispatch.shape == combine.shape == (1, 2, 3, 1)
    want = torch.zeros(1, 2, 3, 1)
    want[0, 0, 1, 0] = want[0, 1, 0, 0] = 1.0  # first choices kept; both second choices find their expert full
    torch.testing.assert_close(dispatch, want)
    torch.testing.assert_close(combine, want * (0.6 / 0.9))
    torch.testing.assert_close(load, torch.tensor([0.5, 0.5, 0.0]))


def test_group_len_and_capacity() -> None:
    cfg = MoEConfig.mixtral_8x7b()
    assert cfg.group_len(4096) == 512 and cfg.capacity(512) == 160  # ceil(1.25 * 512 * 2 / 8)
    assert cfg.group_len(1000) == 500  # largest divisor of the sequence at most group_size


# ---------------------------------------------------------------------------------------------- planning


@pytest.mark.parametrize("family", ["mixtral", "bert", "vit"])
def test_new_family_captures_and_plans(family: str, caplog: pytest.LogCaptureFixture) -> None:
    m = _tiny(family, n_layer=1)
    model = m.build()  # meta, bf16: what the CLI plans
    with caplog.at_level(logging.WARNING, logger="autoshard"), fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = autoshard.plan(model, mesh, m.example_inputs(4), constraints={"inputs": {"dp": Shard(0)}})
    assert plan.stages and plan.step_time_s > 0
    fallbacks = [r.getMessage() for r in caplog.records if "no sharding strategy" in r.getMessage()]
    assert not fallbacks  # every op of these models has a DTensor rule (nothing silently replicated)


# ---------------------------------------------------------------------------------------------- HF configs

LLAMA3_8B_JSON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
}  # fmt: skip
MIXTRAL_JSON = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768, "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02, "sliding_window": None,
}  # fmt: skip
BERT_LARGE_JSON = {
    "architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 1024, "intermediate_size": 4096,
    "num_hidden_layers": 24, "num_attention_heads": 16, "vocab_size": 30522, "max_position_embeddings": 512,
    "type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_act": "gelu",
}  # fmt: skip


def test_get_model_from_hf_config_json(tmp_path) -> None:
    (tmp_path / "Meta-Llama-3-8B").mkdir()
    (tmp_path / "Meta-Llama-3-8B" / "config.json").write_text(json.dumps(LLAMA3_8B_JSON))
    (tmp_path / "mixtral.json").write_text(json.dumps(MIXTRAL_JSON))
    (tmp_path / "bert.json").write_text(json.dumps(BERT_LARGE_JSON))

    llama = get_model(str(tmp_path / "Meta-Llama-3-8B" / "config.json"))
    assert (llama.name, llama.family, llama.config.n_kv_head) == ("hf:llama:Meta-Llama-3-8B", "llama", 8)
    assert llama.num_params() == 8_030_261_248
    mixtral = get_model(str(tmp_path / "mixtral.json"))
    assert (mixtral.name, mixtral.family, mixtral.default_seq) == ("hf:mixtral:mixtral", "mixtral", 8192)
    assert mixtral.num_params() == get_model("mixtral-8x7b").num_params()
    assert mixtral.config.aux_loss_coef == 0.02
    bert = get_model(str(tmp_path / "bert.json"))
    assert bert.family == "bert" and bert.num_params() == get_model("bert-large").num_params()
    assert len(bert.build(num_layers=1).layers) == 1


def test_hf_field_mapping_matches_transformers_parameter_counts(tmp_path) -> None:
    """Tiny configs saved by transformers itself: our model has exactly the HF model's parameter count."""
    tf = pytest.importorskip("transformers")
    cases = {
        "llama": (tf.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128), tf.LlamaForCausalLM),
        "mixtral": (tf.MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, num_local_experts=4),
                    tf.MixtralForCausalLM),
        "gpt2": (tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64), tf.GPT2LMHeadModel),
        "bert": (tf.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               vocab_size=128, max_position_embeddings=64), tf.BertForMaskedLM),
        "vit": (tf.ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             image_size=32, patch_size=8, num_labels=10), tf.ViTForImageClassification),
    }  # fmt: skip
    for model_type, (cfg, cls) in cases.items():
        cfg.to_json_file(str(tmp_path / f"{model_type}.json"))
        with torch.device("meta"):
            want = sum(p.numel() for p in cls(cfg).parameters())
        assert get_model(str(tmp_path / f"{model_type}.json")).num_params() == want, model_type


def test_unknown_name_and_unsupported_model_type(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"known models are gpt2-124m, .*llama3-70b.*config\.json"):
        get_model("llama-9000")
    (tmp_path / "t5.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match=r"'t5' is not supported.*bert, gpt2, llama, mistral, mixtral, vit"):
        get_model(str(tmp_path / "t5.json"))


def test_patchify_equals_strided_convolution() -> None:
    torch.manual_seed(0)
    images, weight = torch.randn(2, 3, 16, 16), torch.randn(5, 3, 4, 4)
    want = F.conv2d(images, weight, stride=4).flatten(2).transpose(1, 2)
    torch.testing.assert_close(patchify(images, 4) @ weight.reshape(5, -1).T, want, rtol=1e-5, atol=1e-5)


def test_plan_step_time_prices_any_choice_like_the_solver() -> None:
    """For any choice of candidates (not only the optimum), the Plan's step time (compute + every collective
    it lists, per consumer edge as the solver counts them, - overlap credit) equals the integer program's price of
    that choice: nothing counted twice (moves inside a decision group), nothing left out, each bundle's latency paid
    by its members' shares. The plan itself prices the collectives as the lowering runs them: here (its bundles
    whole, a value moved once for its consumers) never more. Candidates with moves inside their group are forced in."""
    import math as _math

    from autoshard.compiler.plan_collectives import plan_collectives
    from autoshard.compiler.solve import annotate
    from autoshard.plans.plan import Plan
    from autoshard.search.planned import build_plan
    from autoshard.solver.pricing import GRAD_SINK_CREDIT

    def priced(p: Plan) -> float:  # the plan's collectives as the solver prices them: per edge, bundles by shares
        stats = plan_collectives(gm, ctx, per_edge=True)
        assert not any(c.tensor.startswith(("bucket of", "group of")) for c in stats)
        grads = sum(c.time_s * c.repeat for c in stats if c.consumer in ctx.param_modules)
        return p.stages[0].compute_s + sum(c.time_s * c.repeat for c in stats) - GRAD_SINK_CREDIT * grads

    m = _tiny("mixtral", n_layer=2)
    with fake_world(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        planned = plan_graph(
            m.build(), m.example_inputs(8), mesh, get_cluster("h100-sxm"), PlanConfig(solve_recipes=False)
        )
        plan, gm, ctx = planned.plan, planned.graph, planned.ctx
        assert _math.isclose(priced(plan), plan.solver.objective_s, rel_tol=1e-4)
        problem = ctx.problem
        choice = {c: ctx.solution.choice[c] for c in problem.canon_ids}
        forced = 0
        for c in problem.canon_ids:
            for i, st in enumerate(ctx.strategies[c]):
                trial = {**choice, c: i}
                if st.comm_s > 0 and _math.isfinite(problem.evaluate(trial)):
                    choice, forced = trial, forced + 1
                    break
        assert forced > 0
        full = {g.id: choice[ctx.layer_of_group[g.id]] for g in ctx.groups}
        sol = dataclasses.replace(ctx.solution, choice=full)
        annotate(gm, ctx, sol)
        forced_plan = build_plan(gm, ctx, sol)
        assert _math.isclose(priced(forced_plan), problem.evaluate(choice), rel_tol=1e-9)
    assert forced_plan.step_time_s > plan.step_time_s
    # as the lowering runs them (a value moved once per placement, each bundle one latency): no more here
    assert forced_plan.step_time_s <= priced(forced_plan) + 1e-12
