"""autoshard: automatic sharding of PyTorch training programs.

    sharded = autoshard.compile(model, mesh, example_inputs=(x, y))
    plan = autoshard.plan(model, mesh, example_inputs=(x, y))
"""

from autoshard.api import compile, plan
from autoshard.config import PlanConfig
from autoshard.plan import Plan
from autoshard.runtime.sharded_module import ShardedModule

__all__ = ["compile", "plan", "Plan", "PlanConfig", "ShardedModule"]
