"""Random numbers in sharded programs (docs/guide/api.md, "Random numbers"), on stock models as their configs
ship them (dropout on).

- ``random="local"`` (the default): each rank draws only its piece; replicas hold the same numbers, pieces
  others, and the seed before the step decides them.
- ``random="exact"``: a sharded step draws the numbers one device draws after the same ``torch.manual_seed``:
  stock GPT-2, BERT (masked LM), T5 and Phi-MoE (whose training router samples with ``exponential_`` and ``rand_like``)
  equal the unsharded model's loss, every gradient and the parameters after AdamW steps, on dp=2 and
  dp=2 x tp=2, interpreted (LocalTensorMode), lowered and compiled by Inductor with recomputation (a replayed
  layer reuses its mask), and through the ``torch.compile`` backend (gloo ranks).
- Pipeline stages and gradient accumulation: replicas draw the same numbers (their parameters stay equal), and
  stages draw from streams of their own.
"""

from __future__ import annotations

import pytest
import torch
from harness import case_result, local_ranks, run_two_at_a_time, selected_cases
from numerics_utils import LR, PARAM_ATOL, _full, _scalar
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import autoshard
from autoshard.runtime.stage_random import StageStreams
from autoshard.testing.launch import launch

pytest.importorskip("transformers")

from autoshard.models import hf  # noqa: E402

STEPS = 2
SEED = 100  # torch.manual_seed(SEED + step) before every step, on one device and on every rank


def _phimoe(batch: int = 4, seq: int = 16) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A stock ``PhimoeForCausalLM`` from its config class (default dropout, jitter and sampled routing)."""
    import transformers

    config = transformers.PhimoeConfig(
        vocab_size=hf.VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.PhimoeForCausalLM(config)
    model.train()
    return model, hf.lm_batch(batch, seq, 1)


def _build(name: str, layers: int | None = None) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    return _phimoe() if name == "phimoe" else hf.build(name, layers=layers)


def _loss(out: object) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out  # type: ignore[attr-defined]


def reference(name: str, steps: int = STEPS, layers: int | None = None) -> dict:
    """The unsharded model, seeded before every step as the sharded runs are."""
    model, batch = _build(name, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(steps):
        torch.manual_seed(SEED + step)
        loss = _loss(model(**batch))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _check(ref: dict, got: dict, what: str, rtol: float = 2e-4) -> None:
    """Losses to 1e-5, gradients to ``rtol`` of each tensor's largest element (another summation order moves the
    last bits; one other dropout mask moves them by percents), parameters after AdamW also to ``PARAM_ATOL`` (it
    turns last-bit differences of near-zero gradients into steps of up to lr)."""
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-5), f"{what}: losses"
    for kind in ("grads", "params"):
        missing = set(ref[kind]) - set(got[kind])
        assert not missing, f"{what}: no {kind} for {sorted(missing)[:3]}"
        for n, want in ref[kind].items():
            err = (got[kind][n].float() - want.float()).abs().max().item()
            tol = rtol * max(want.abs().max().item(), 1e-3) + (PARAM_ATOL if kind == "params" else 0.0)
            assert err <= tol, f"{what}: {kind} {n} off by {err:.2e}"


# ------------------------------------------------------------- simulated ranks (LocalTensorMode): many models

# (ViT's config ships with dropout 0: test_hf_models trains it; the test below checks that it draws nothing)
LOCAL = [("gpt2", (2, 2)), ("bert", (2, 2)), ("t5", (2, 2)), ("phimoe", (2, 2))]
COST = {("t5", (2, 2)): 12.0, ("bert", (2, 2)): 7.0, ("phimoe", (2, 2)): 6.0, ("gpt2", (2, 2)): 4.0}


def _local_case(case: tuple[str, tuple[int, ...]]) -> tuple[dict, dict]:
    name, shape = case
    ref = reference(name)
    model, batch = _build(name)
    names = ("dp", "tp")[: len(shape)]
    kw = {"recipe": "fsdp+tp"} if len(shape) == 2 else {"constraints": {"inputs": {"dp": Shard(0)}}}
    kw["random"] = "exact"
    with local_ranks(2 * len(shape)):
        sharded = autoshard.compile(model, init_device_mesh("cpu", shape, mesh_dim_names=names), batch, **kw)
        opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
        losses, grads = [], {}
        for step in range(STEPS):
            torch.manual_seed(SEED + step)
            loss = sharded.step(**batch)
            if step == 0:
                grads = {n: _full(p.grad) for n, p in sharded.named_parameters()}  # (asserts replicas agree)
            opt.step()
            opt.zero_grad()
            losses.append(_scalar(_loss(loss)))
        params = {n: _full(p.data) for n, p in sharded.named_parameters()}
        split = any("S(" in str(p) for p in sharded.plan.parameter_placements().values()) or len(shape) == 1
    return ref, {"losses": losses, "grads": grads, "params": params, "split": split}


@pytest.fixture(scope="module")
def local_runs(request: pytest.FixtureRequest) -> dict:
    return run_two_at_a_time(
        _local_case, selected_cases(request, "test_dropout_draws_what_one_device_draws", "case"), cost=COST
    )


@pytest.mark.parametrize("case", LOCAL, ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in LOCAL])
def test_dropout_draws_what_one_device_draws(case: tuple, local_runs: dict) -> None:
    ref, got = case_result(local_runs, case)
    assert got["split"], "the plan left every parameter whole"
    _check(ref, got, f"{case[0]} on {case[1]}")


def test_default_configs_draw_random_numbers() -> None:
    """The test above is not vacuous: each model's gradients depend on the seed (dropout, or Phi-MoE's sampled
    routing), but ViT's, whose config ships with dropout 0."""
    for name in ("gpt2", "bert", "t5", "phimoe", "vit"):
        model, batch = _build(name)
        with torch.random.fork_rng(devices=[]):
            losses = set()
            for step in range(4):  # (the steps' seeds: Phi-MoE's routing samples only near ties)
                torch.manual_seed(SEED + step)
                losses.add(float(_loss(model(**batch)).detach()))
        assert (len(losses) == 1) == (name == "vit"), f"{name}: losses {losses} for 4 seeds"


def test_local_draws_are_seeded_alike_on_replicas_and_differ_by_piece() -> None:
    """The default: GPT-2 on dp=2 x tp=2 (fsdp+tp), each rank drawing only its piece of every mask: the same seed
    gives the same step, another seed another; replicated values agree on every rank (``_full`` checks); and the
    pieces are not one device's numbers (the loss is not the exact run's)."""
    exact = reference("gpt2", steps=1)
    model, batch = hf.build("gpt2")
    with local_ranks(4):
        sharded = autoshard.compile(
            model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")), batch, recipe="fsdp+tp"
        )
        losses = []
        for seed in (SEED, SEED, SEED + 1):
            torch.manual_seed(seed)
            losses.append(_scalar(_loss(sharded.step(**batch))))
            grads = {n: _full(p.grad) for n, p in sharded.named_parameters()}
            for p in sharded.parameters():
                p.grad = None
    assert losses[0] == losses[1] != losses[2], losses
    assert abs(losses[0] - exact["losses"][0]) > 1e-6, "local pieces drew one device's numbers"
    assert all(torch.isfinite(g).all() for g in grads.values())


# ----------------------------------------------------------------------------------------- real gloo ranks


def _gloo(rank: int, world: int, arg: tuple) -> dict:
    name, shape, layers, kw = arg
    model, batch = hf.build(name, layers=layers)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")[: len(shape)])
    if kw.pop("torch_compile", False):  # the backend: parameters hold this rank's shards, each rank its batch rows
        model.loss_type = "ForCausalLM"  # (unset, transformers logs a warning inside forward: a graph break)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        compiled = torch.compile(model, backend="autoshard", options={"mesh": mesh, **kw})
        rows = batch["input_ids"].shape[0] // mesh.size(0)
        mine = {k: v.split(rows)[mesh.get_local_rank(0)] for k, v in batch.items()}

        def step() -> torch.Tensor:
            loss = compiled(**mine).loss
            loss.backward()
            return loss

        def whole(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return autoshard.as_dtensor(p, v).full_tensor()

        params = model.named_parameters
    else:
        sharded = autoshard.compile(model, mesh, batch, **kw)
        opt = torch.optim.AdamW(sharded.parameters(), lr=LR)

        def step() -> torch.Tensor:
            return _loss(sharded.step(**batch))

        def whole(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return _full(v)

        params = sharded.named_parameters
    losses, grads = [], {}
    for i in range(STEPS):
        torch.manual_seed(SEED + i)
        loss = step()
        if i == 0:
            grads = {n: whole(p, p.grad) for n, p in params()}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": grads, "params": {n: whole(p, p.data) for n, p in params()}}


def _replicas_agree(results: list[dict]) -> None:
    for r, got in enumerate(results[1:], start=1):
        assert got["losses"] == results[0]["losses"], f"rank {r}'s loss differs from rank 0's"
        for n, g in got["grads"].items():
            assert torch.equal(g, results[0]["grads"][n]), f"rank {r}'s gradient of {n} differs from rank 0's"


@pytest.mark.parametrize(
    "backend,shape,kw",
    [
        (
            "inductor",
            (2,),
            {"constraints": {"inputs": {"dp": Shard(0)}}, "recompute": "transformer.h", "random": "exact"},
        ),
        ("eager", (2,), {"torch_compile": True, "random": "exact"}),
    ],
    ids=["inductor-dp2-recomputed", "torch-compile-backend"],
)
def test_stock_gpt2_with_dropout_on_gloo_ranks(backend: str, shape: tuple, kw: dict) -> None:
    """Lowered programs on real ranks: Inductor's (which calls ATen's random kernels, not its own), each layer
    recomputed in the backward from its saved mask; the ``torch.compile`` backend (the eager FX graphs)."""
    layers = 1 if backend == "inductor" else 2  # (Inductor compiles every kernel on each rank: one layer suffices)
    world = shape[0] * (shape[1] if len(shape) > 1 else 1)
    kw = dict(kw, backend=backend)
    results = launch(world, _gloo, ("gpt2", shape, layers, kw), timeout=600)
    ref = reference("gpt2", layers=layers)
    _replicas_agree(results if len(shape) == 1 else results[:1])
    _check(ref, results[0], f"gpt2 {backend} on {shape}")


def _unpadded(batch: int = 8) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, hf.VOCAB, (batch, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}  # (no padding: each micro-batch's loss weighs 1 / micro-batches)


def _pipelined(rank: int, world: int, arg: None) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    out = {}
    for mode in ("exact", "local"):
        model, _ = hf.build("gpt2", batch=8, layers=2)
        sharded = autoshard.compile(
            model, mesh, _unpadded(), backend="eager", schedule="1F1B", microbatches=2, random=mode
        )
        losses, grads = [], {}
        for seed in (SEED, SEED, SEED + 1):
            torch.manual_seed(seed)
            losses.append(float(sharded.step(**_unpadded())))
            if not grads:
                grads = {n: _full(p.grad) for n, p in sharded.named_parameters()}
                after = torch.rand(4)  # where the step left the generator
            for p in sharded.parameters():
                p.grad = None
        out[mode] = {"losses": losses, "grads": grads, "after": after}
    return out


def test_pipeline_stages_draw_as_one_device_accumulating_or_alike_on_replicas() -> None:
    """GPT-2 with dropout in 2 stages x 2 data-parallel replicas, 2 micro-batches. ``exact``: the loss, every
    gradient and the generator after the step equal one device running the same 2 micro-batches one after the
    other (each stage replays the others' draws). ``local``: the replicas of a stage end the step with the same
    gradients (they drew the same masks); the same seed gives the same loss, another seed another."""
    results = launch(4, _pipelined, None, timeout=600)
    model, _ = hf.build("gpt2", batch=8, layers=2)
    batch = _unpadded()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        loss = 0.0
        for piece in ({k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}):
            part = model(**piece).loss / 2
            part.backward()
            loss += float(part)
        after = torch.rand(4)
    for r, got in enumerate(results):
        exact = got["exact"]
        assert exact["losses"][0] == pytest.approx(loss, rel=1e-5), f"rank {r}"
        assert torch.equal(exact["after"], after), f"rank {r}: the step left the generator elsewhere than one device"
        for n, g in exact["grads"].items():
            want = dict(model.named_parameters())[n].grad
            assert (g - want).abs().max() <= 2e-4 * max(want.abs().max().item(), 1e-3), f"rank {r}: {n}"
    local = [got["local"] for got in results]
    for stage in ((0, 1), (2, 3)):
        _replicas_agree([local[r] for r in stage])
    assert local[0]["losses"][0] == local[0]["losses"][1] != local[0]["losses"][2], local[0]["losses"]
    assert abs(local[0]["losses"][0] - loss) > 1e-6, "local draws equal one device's"


def test_stage_streams_differ_by_stage_and_step_and_leave_the_generator_in_step() -> None:
    def draws(stages: tuple[int, ...]) -> tuple[dict, torch.Tensor]:
        torch.manual_seed(3)
        streams = StageStreams(torch.device("cpu"), stages)
        out = {}
        for step in range(2):
            streams.begin_step()
            for k in stages:
                for mb in range(2):
                    with streams.drawing(k):
                        out[(step, k, mb)] = torch.rand(4)
        return out, torch.rand(1)

    rank_a, after_a = draws((0, 2))  # a rank holding stages 0 and 2 (interleaved)
    rank_b, after_b = draws((1, 2))  # another holding stages 1 and 2
    assert torch.equal(after_a, after_b)  # every rank's own generator moved alike
    assert all(torch.equal(rank_a[(s, 2, m)], rank_b[(s, 2, m)]) for s in range(2) for m in range(2))
    values = [tuple(v.tolist()) for v in [*rank_a.values(), *rank_b.values()]]
    assert len(set(values)) == len(values) - 4  # all distinct but stage 2's, held twice


def _accumulated(rank: int, world: int, arg: None) -> dict:
    model, batch = hf.build("gpt2", batch=8)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    sharded = autoshard.compile(
        model, mesh, batch, backend="eager", microbatches=2, constraints={"inputs": {"dp": Shard(0)}}
    )
    torch.manual_seed(SEED)
    loss = float(sharded.step(**batch))
    return {"losses": [loss], "grads": {n: _full(p.grad) for n, p in sharded.named_parameters()}}


def test_accumulated_micro_batches_replicas_draw_alike() -> None:
    results = launch(2, _accumulated, None, timeout=600)
    _replicas_agree(results)


class _Sampler(torch.nn.Module):
    """Draws that read values: a token sampled from each row's softmax (``multinomial``) and Gaussian noise with
    per-element scales (``normal`` of two tensors) before a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = torch.nn.Linear(8, 6), torch.nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        pick = torch.multinomial(h.detach().softmax(-1), 1)  # [B, 1]
        h = h + torch.normal(h.detach(), h.detach().abs() + 0.1)
        return (self.head(h.gather(1, pick.expand(-1, 6))) ** 2).mean()


def test_draws_that_read_values_run_whole_and_equal_one_device() -> None:
    torch.manual_seed(0)
    model = _Sampler()
    x = torch.randn(8, 8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        want = model(x)
        want.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with local_ranks(2):
        sharded = autoshard.compile(
            model,
            init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)),
            (x,),
            constraints={"inputs": {"dp": Shard(0)}},
            random="exact",
        )
        torch.manual_seed(SEED)
        got = _scalar(sharded.step(x))
        grads = {n: _full(p.grad) for n, p in sharded.named_parameters()}
    assert got == pytest.approx(float(want), rel=1e-5)
    for n, g in ref.items():
        assert torch.allclose(grads[n], g, rtol=1e-4, atol=1e-6), n
