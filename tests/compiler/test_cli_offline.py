"""Planning for a cluster from this machine: the CLI end to end, and bad input named with its numbers."""

from __future__ import annotations

import json

import pytest
import torch
from harness import case_result, run_two_at_a_time

import autoshard
from autoshard.cli import main
from autoshard.errors import InfeasibleBudget
from autoshard.plans.plan import Plan
from autoshard.plans.report import report

SMALL = ["--model", "gpt2-124m", "--cluster", "h100-sxm:1x8", "--seq", "128", "--global-batch", "16"]
# the CLI runs the tests below check, by case: its arguments (each with --out FILE); their planning is
# single-threaded, so they run two at a time in forked processes (a module fixture) and each test checks its own
CLI_RUNS = {
    "plan": ["plan", *SMALL],
    "pipeline": [
        "plan",
        "--model",
        "gpt2-1.5b",
        "--cluster",
        "a100-80gb:2x8",
        "--seq",
        "1024",
        "--global-batch",
        "16",
        "--pipeline",
        "auto",
        "--no-recipes",
    ],
    "mixed": ["plan", *SMALL, "--recipe", "ddp", "-q", "--mixed-precision", "bf16", "--reduce-dtype", "bf16"],
}
CLI_TESTS = {
    "test_cli_plan_writes_a_plan_that_reads_back": "plan",
    "test_cli_pipeline_auto_puts_a_stage_on_each_node": "pipeline",
    "test_cli_mixed_precision_plans_fp32_masters_and_bf16_matmuls": "mixed",
}


def _cli(arg: tuple[str, str]) -> tuple[int, str, str, str]:
    """``main(argv + --out FILE)`` with stdout and stderr captured: (exit code, stdout, stderr, the file's text)."""
    import contextlib
    import io
    import os

    case, folder = arg
    out_file = os.path.join(folder, f"{case}.json")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*CLI_RUNS[case], "--out", out_file])
    return code, out.getvalue(), err.getvalue(), open(out_file).read() if os.path.exists(out_file) else ""


@pytest.fixture(scope="module")
def cli_runs(request, tmp_path_factory) -> dict:
    folder = str(tmp_path_factory.mktemp("cli"))
    wanted = {
        CLI_TESTS[item.originalname]
        for item in request.session.items
        if item.module is request.module and item.originalname in CLI_TESTS
    }
    runs = run_two_at_a_time(
        _cli,
        [(c, folder) for c in sorted(wanted)],
        cost={("pipeline", folder): 9, ("mixed", folder): 4, ("plan", folder): 3},
    )
    return {case: r for (case, _), r in runs.items()}


@pytest.mark.slow
def test_cli_plan_writes_a_plan_that_reads_back(cli_runs):
    code, out, err, text = case_result(cli_runs, "plan")  # main(["plan", *SMALL, "--out", FILE])
    assert code == 0
    assert "capture" in err and "solve" in err  # progress per stage
    report = out
    assert "vs manual recipes" in report and "tokens/s" in report and "MFU" in report
    plan = Plan.from_json(text)
    assert plan.model == "gpt2-124m" and plan.mesh.shape == (8,) and plan.step_time_s > 0
    assert {b.name for b in plan.recipes} == {"ddp", "zero1", "zero2", "fsdp", "tp"}  # (128 tokens: no cp)
    assert plan.tokens_per_step == 16 * 128 and 0 < plan.mfu < 1
    assert "layers: 3 of 12" in plan.sampled_layers


def test_cli_lists_models_and_clusters(capsys):
    assert main(["models"]) == 0 and main(["clusters"]) == 0
    out = capsys.readouterr().out
    for name in ("llama3-405b", "mixtral-8x7b", "vit-h14", "h100-sxm", "a100-80gb", "cpu"):
        assert name in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--model", "llama-9b", "--cluster", "h100-sxm", "--global-batch", "8"], "known models"),
        (["--model", "gpt2-124m", "--cluster", "tpu-v5", "--global-batch", "8"], "known clusters"),
        (
            ["--model", "gpt2-124m", "--cluster", "h100-sxm:2x8", "--mesh", "4x8", "--global-batch", "8"],
            "has 32 devices but cluster 'h100-sxm:2x8' has 16",
        ),
        (
            ["--model", "gpt2-124m", "--cluster", "h100-sxm:2x8", "--global-batch", "3", "--seq", "128"],
            "global batch 3 is not divisible by the data-parallel degree 2",
        ),
        (
            ["--model", "gpt2-124m", "--cluster", "h100-sxm:2x8", "--mesh", "tp=8,pp=2", "--global-batch", "8"],
            "'pp' must be the outermost axis",
        ),
        (
            ["--model", "gpt2-124m", "--cluster", "h100-sxm:2x8", "--mesh", "pp=2,tp=x", "--global-batch", "8"],
            "cannot parse mesh 'pp=2,tp=x'",
        ),
    ],
)
def test_cli_bad_input_is_named(argv, needle, capsys):
    assert main(["plan", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_model_that_cannot_fit_says_how_much_it_needs():
    """Llama-3-8B on 8 devices: at 1 GiB its parameters alone (1.87 GiB each, sharded 8 ways) do not fit, refused
    before anything is captured; at 8 GiB without offload its whole state (7.48 GiB each) does, but no plan with
    its activations and temporaries does: the solver's leanest plan, the devices it would take, and offload."""
    kw = dict(cluster="h100-sxm:1x8", seq=256, global_batch=8, solve_recipes=False)
    with pytest.raises(InfeasibleBudget, match=r"llama3-8b cannot train on 8 x 1.00 GiB: even with its gradients"):
        autoshard.plan("llama3-8b", memory_budget="1GiB", **kw)
    with pytest.raises(
        InfeasibleBudget, match=r"llama3-8b does not fit on 8 x 8.00 GiB: its training state alone"
    ) as e:
        autoshard.plan("llama3-8b", memory_budget="8GiB", offload="none", **kw)
    assert "leanest plan" in str(e.value) and e.value.least_bytes > 8 * 2**30
    assert "offload='params'" in str(e.value)
    assert "a global batch of at most" not in str(e.value)  # (8 rows on 8 devices: accumulation tried what it could)
    import re

    m = re.search(r"about (\d+) devices \(e\.g\. 'h100-sxm:(\d+)x8'\)", str(e.value))
    assert m, str(e.value)
    # the estimate scales the mesh by the overshoot: enough devices for the leanest plan's bytes, in whole nodes
    assert int(m.group(1)) == 8 * int(m.group(2)) >= 8 * e.value.least_bytes / (8 * 2**30)


def test_offline_plan_accumulates_micro_batches():
    """Gradient accumulation is a dimension of the offline plan: ``microbatches=4`` plans a quarter of the global
    batch per pass (its activations), four passes per step; with pipeline stages it is refused (they choose)."""
    kw = dict(cluster="h100-sxm:1x8", seq=128, global_batch=64, solve_recipes=False, memory_budget="none")
    whole = autoshard.plan("gpt2-124m", **kw)
    four = autoshard.plan("gpt2-124m", **kw, microbatches=4)
    assert whole.microbatches == 1 and four.microbatches == 4
    assert four.peak_memory.activations == pytest.approx(whole.peak_memory.activations / 4, rel=0.05)
    assert four.step_time_s > whole.step_time_s  # four smaller passes take longer than one pass of the batch
    assert "gradient accumulation over 4 micro-batches" in report(four)
    with pytest.raises(ValueError, match=r"microbatches=2 is gradient accumulation without pipeline stages"):
        autoshard.plan("gpt2-124m", **kw, microbatches=2, pipeline="auto")
    with pytest.raises(SystemExit) as stop:  # named by the flag, exit status 2, not a traceback
        main(["plan", *SMALL, "--microbatches", "0"])
    assert stop.value.code == 2


def test_plan_json_round_trip_keeps_recipes(tmp_path):
    plan = autoshard.plan("bert-large", cluster="a100-80gb:1x8", seq=128, global_batch=16)
    again = Plan.from_json(plan.to_json())
    assert again == plan and json.loads(plan.to_json())["recipes"]


@pytest.mark.slow
def test_cli_pipeline_auto_puts_a_stage_on_each_node(cli_runs):
    """GPT-2 XL (1.5 B) at sequence 1024 on 2 A100 nodes (25 GB/s per GPU between them): data parallelism over
    the nodes would all-reduce every gradient over the network (GPT-2 small's 0.12 B are few enough for that);
    ``--pipeline auto`` puts a stage on each node instead, says why on stderr, prints the stage table and writes
    a plan that reads back."""
    code, out, err, text = case_result(cli_runs, "pipeline")  # main(CLI_RUNS["pipeline"] + ["--out", FILE])
    assert code == 0
    assert "pipeline   done  2 stages of (8,)" in err and "beats no stages" in err
    assert "pipeline: 2 stages" in out and "1 stage (no pipeline)" in out
    plan = Plan.from_json(text)
    assert plan.mesh.names == ("pp", "dp") and [s.ranks[0] for s in plan.stages] == [0, 8]
    assert plan.stages[0].layers[0] == "wte" and plan.stages[-1].layers[-1] == "ln_f"
    assert plan.tokens_per_step == 16 * 1024 and 0 < plan.mfu < 1
    flat = next(b for b in plan.recipes if b.name == "1 stage (no pipeline)")
    assert plan.step_time_s < flat.step_time_s


@pytest.mark.slow
def test_cli_mixed_precision_plans_fp32_masters_and_bf16_matmuls(cli_runs):
    """``--mixed-precision bf16``: the zoo model's parameters are fp32 masters (16 bytes per parameter with their
    gradient and AdamW state, against 8 in pure bf16), MFU against the bf16 peak, and the report says so."""
    code, out, _, text = case_result(cli_runs, "mixed")  # main(CLI_RUNS["mixed"] + ["--out", FILE])
    assert code == 0
    assert "mixed precision: bfloat16 parameters" in out  # the default policy (--precision-policy params)
    mixed = Plan.from_json(text)
    assert (mixed.mixed_precision, mixed.reduce_dtype, mixed.precision_policy) == ("bfloat16", "bfloat16", "params")
    pure = autoshard.plan("gpt2-124m", cluster="h100-sxm:1x8", seq=128, global_batch=16, recipe="ddp")
    assert "mixed precision" not in report(pure) and not pure.mixed_precision
    dtypes = {t.dtype for t in mixed.stages[0].tensors if t.role == "parameter"}
    assert dtypes == {"float32"} and {t.dtype for t in pure.stages[0].tensors if t.role == "parameter"} == {"bfloat16"}
    assert mixed.peak_flops_per_device == pure.peak_flops_per_device  # the bf16 peak, not fp32's
    state = lambda p: p.peak_memory.parameters + p.peak_memory.gradients + p.peak_memory.optimizer  # noqa: E731
    assert state(mixed) == pytest.approx(2 * state(pure), rel=0.01)


def test_offline_plan_of_a_stock_model_called_with_keywords():
    """A stock Hugging Face model built on meta, planned for a cluster this machine is not, with its inputs as
    its users pass them (``input_ids=..., labels=...``): the keywords reach forward as keywords (they were
    passed positionally once: ``embedding(): argument 'indices' must be Tensor, not str``) and the batch checks
    read the first keyword's tensor."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.zeros(8, 64, dtype=torch.long, device="meta")
    plan = autoshard.plan(
        model, example_inputs=dict(input_ids=ids, labels=ids), cluster="h100-sxm:1x2", solve_recipes=False
    )
    assert plan.step_time_s > 0 and plan.peak_memory.total > 0
    odd = torch.zeros(3, 64, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="global batch 3 is not divisible"):
        autoshard.plan(model, example_inputs=dict(input_ids=odd, labels=odd), cluster="h100-sxm:1x2", recipe="ddp")


class _BatchNormalized(torch.nn.Module):
    """``x / x.sum(0)``: every sample normalized by a sum over the batch (gradient accumulation changes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        y = y / y.sum(0)
        return (y * y).mean()


def test_offline_refusal_of_accumulation_names_the_op():
    """Issue 43 part 4: a budget only micro-batches meet, for a model that mixes its samples: the offline error
    (what ``autoshard plan`` prints) names the op that mixes them, as the in-process error does, and the flag
    that accepts micro-batch statistics knowingly."""
    x = torch.randn(64, 256, 64)
    kw = dict(example_inputs=(x,), cluster="h100-sxm:1x2", solve_recipes=False)
    with pytest.raises(InfeasibleBudget, match="cannot train on 2 x 1 B") as floor:  # (below its state: at once)
        autoshard.plan(_BatchNormalized(), **kw, memory_budget=1, microbatches=1)
    with pytest.raises(InfeasibleBudget) as e:  # (its state fits: the whole batch's activations do not)
        autoshard.plan(_BatchNormalized(), **kw, memory_budget=floor.value.least_bytes, microbatches=1)
    assert e.value.least_bytes * 17 // 20 > floor.value.least_bytes
    with pytest.raises(
        InfeasibleBudget,
        match=r"Gradient accumulation: \d+ micro-batches would fit, but the model "
        r"mixes the samples of its batch before the loss: aten\.sum\.dim_IntList \(sum",
    ) as refused:
        autoshard.plan(_BatchNormalized(), **kw, memory_budget=e.value.least_bytes * 17 // 20)
    import re

    assert re.search(r"--microbatches \d+, trains on micro-batch statistics", str(refused.value)), str(refused.value)
    assert "does not fit either" not in str(refused.value)
