"""autoshard: automatic sharding of PyTorch training programs.

sharded = autoshard.compile(model, mesh, example_inputs=(x, y))
plan = autoshard.plan(model, mesh, example_inputs=(x, y))
plan = autoshard.plan("llama3-70b", cluster="h100-sxm:128x8", seq=8192, global_batch=512)
compiled = torch.compile(model, backend="autoshard", options={"mesh": mesh})
fsdp = autoshard.recipe("fsdp", "llama3-70b", "h100-sxm:128x8", seq=8192, global_batch=512)
print(autoshard.report(plan))               # the plan as a plain-text table
autoshard.write_html(plan, "plan.html")     # the plan as a page: layouts, memory, time, recipes
"""

from autoshard.api import compile, plan, recipe
from autoshard.config import PlanConfig
from autoshard.errors import (
    AutoshardError,
    CallError,
    DataDependentError,
    InfeasibleBudget,
    InputError,
    InternalError,
    LaunchError,
    RankFailed,
    SolverTimeout,
    UsageError,
)
from autoshard.plans.html.page import write_html
from autoshard.plans.plan import Plan
from autoshard.plans.report import report
from autoshard.runtime.param_takeover import as_dtensor, clip_grad_norm_
from autoshard.runtime.sharded_module import ShardedModule
from autoshard.weights.deferred import init_weights, load_pretrained, save_pretrained

__all__ = [
    "clip_grad_norm_",
    "compile",
    "init_weights",
    "load_pretrained",
    "plan",
    "recipe",
    "save_pretrained",
    "Plan",
    "PlanConfig",
    "ShardedModule",
    "as_dtensor",
    "AutoshardError",
    "DataDependentError",
    "InfeasibleBudget",
    "InputError",
    "InternalError",
    "LaunchError",
    "RankFailed",
    "SolverTimeout",
    "UsageError",
    "CallError",
    "report",
    "write_html",
]
