"""The one place that touches private torch internals.

Everything autoshard needs from torch that is not public API goes through this package, so that a torch
upgrade (2.11 on the GPU machines, 2.13 on CPU) is mended here:

- ``capture``: joint forward+backward capture (``aot_export_joint_with_descriptors``) and its input/output
  descriptors; the forward/backward partitioner and Inductor's graph compiler;
- ``dtensor``: DTensor's sharding-strategy registries (the candidate source of the planner), redistribution
  and its caches;
- ``collectives``: functional collectives over one or several (flattened) mesh axes, and waiting on them;
- ``dynamo``: the module a ``torch.compile`` backend is compiling;
- ``worlds``: ``LocalTensorMode`` (several simulated ranks in one process) and the fake process group.

Callers use the flat namespace: ``from autoshard import _torch_compat as tc``.
"""

from autoshard._torch_compat.capture import (
    PREFER_RECOMPUTE,
    InputRole,
    OutputRole,
    data_dependent_op,
    decomposition_table,
    draws_random,
    export_joint,
    inductor_compile,
    is_fake,
    new_fake_mode,
    output_roles,
    partition_joint,
    placeholder_role,
    planning_decompositions,
    split_for_pipeline,
    tag_traced,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)
from autoshard._torch_compat.checkpoint import consolidate_safetensors
from autoshard._torch_compat.collectives import (
    all_gather_dim0,
    all_reduce_on,
    permute_on_axis,
    reduce_scatter_dim0,
    swap_mirrored,
    waited,
)
from autoshard._torch_compat.dtensor import (
    AxisRules,
    OpOverload,
    Placements,
    RawStrategy,
    all_placements,
    clear_dtensor_caches,
    dtensor_like,
    has_sharding_rule,
    is_strided_shard,
    local_tensor,
    make_spec,
    op_strategies,
    output_meta,
    propagate,
    redistribute,
    single_dim_rules,
    tensor_meta,
)
from autoshard._torch_compat.dynamo import (
    compiling_call,
    forget_guards_on,
    forget_guards_on_module,
    graph_break_reason,
    outside_dynamo,
)
from autoshard._torch_compat.worlds import (
    abort_process_groups,
    default_store,
    detach_from_fake_modes,
    fake_process_group,
    for_each_rank,
    in_local_tensor_mode,
    outside_local_tensor_mode,
    per_rank_copies,
    rank_values,
    ranks_disagree,
    simulated_ranks,
)

__all__ = [
    "PREFER_RECOMPUTE",
    "tag_traced",
    "AxisRules",
    "InputRole",
    "OpOverload",
    "OutputRole",
    "Placements",
    "RawStrategy",
    "all_gather_dim0",
    "all_placements",
    "all_reduce_on",
    "reduce_scatter_dim0",
    "clear_dtensor_caches",
    "consolidate_safetensors",
    "compiling_call",
    "forget_guards_on",
    "forget_guards_on_module",
    "graph_break_reason",
    "data_dependent_op",
    "decomposition_table",
    "draws_random",
    "dtensor_like",
    "local_tensor",
    "detach_from_fake_modes",
    "export_joint",
    "fake_process_group",
    "for_each_rank",
    "permute_on_axis",
    "swap_mirrored",
    "abort_process_groups",
    "default_store",
    "has_sharding_rule",
    "is_strided_shard",
    "in_local_tensor_mode",
    "inductor_compile",
    "is_fake",
    "make_spec",
    "new_fake_mode",
    "op_strategies",
    "output_meta",
    "output_roles",
    "outside_dynamo",
    "outside_local_tensor_mode",
    "partition_joint",
    "per_rank_copies",
    "placeholder_role",
    "planning_decompositions",
    "propagate",
    "split_for_pipeline",
    "rank_values",
    "ranks_disagree",
    "redistribute",
    "simulated_ranks",
    "single_dim_rules",
    "tensor_meta",
    "waited",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_unflatten",
]
