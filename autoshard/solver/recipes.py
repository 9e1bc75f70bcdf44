"""The hand-made recipes (DDP, FSDP, Megatron TP, FSDP + TP) as data for the solver: what each pins.

A recipe fixes what an engineer fixes by hand: the placement of every parameter and of the batch. Everything
else (the layout of each activation, where the collectives go) is then chosen by the same integer program with
those placements pinned, so a recipe is costed by exactly the model that costs autoshard's plan, and is the
*best* program that recipe allows in that model — an honest bar: the solved plan must beat the recipe done
well, not a straw man. For Megatron TP that freedom is what turns the row-parallel output's all-reduce into
Megatron's sequence-parallel reduce-scatter + all-gather when that is cheaper.

=========  ==========================================================================================
recipe     parameters (mesh axes: ``dp`` = every axis but the last, ``tp`` = the last; 1-D: the one axis)
=========  ==========================================================================================
ddp        Replicate everywhere; the batch is Shard(0) over every axis
zero1      as ddp, and the optimizer state sharded over every axis (DeepSpeed ZeRO-1: gradients all-reduced,
           each rank steps its shard, the parameters gathered back after the step)
zero2      as zero1 with the gradients reduce-scattered to the state's shards (ZeRO-2)
fsdp       Shard(0) over every axis (ZeRO-3: FSDP2's ``fully_shard`` on the flattened mesh); batch as DDP
hsdp       Shard(0) over the last axis (within a node), Replicate over the others (FSDP2's hybrid sharding,
           ``fully_shard`` on a 2-D mesh); batch as DDP
tp         Megatron inside the last axis: column-parallel Linear weights Shard(0) (its bias Shard(0)),
           row-parallel Shard(1), the token embedding and LM head vocab-parallel Shard(0), the rest
           Replicate; Replicate on ``dp``, where the batch is Shard(0) (Megatron TP + SP x DP)
fsdp+tp    tp's layouts on ``tp``, plus a Shard on ``dp`` of every parameter, on the dim tp leaves whole (dim 1 of a
           column-parallel weight, else dim 0; a column-parallel bias, with no such dim, stays Replicate on
           ``dp``) (torchtitan's 2-D recipe, without its strided shard)
ep         expert parallelism (models with stacked expert weights only): each ``[experts, ...]`` weight Shard(0)
           over the last axis (``ep``) and Shard(1) over the others (its FSDP), every other parameter Replicate
           (DDP), the batch Shard(0) over every axis, so tokens reach their experts by all-to-all (GShard,
           DeepSpeed-MoE: experts sharded inside the data-parallel group)
cp         context parallelism (models with attention only): the inputs' sequence (dim 1) Shard over the
           last axis (``cp``), their batch Shard(0) over the others (the sequence there too where the batch does
           not divide over them: one long sequence); every parameter Shard(0) over every axis
           (torchtitan's CP with FSDP over dp x cp); attention gathers the keys and values of the sequence
           (Llama 3's all-gathered K/V) where the solver finds nothing cheaper
=========  ==========================================================================================

Column/row roles come from module names, as in torchtitan's and Megatron's plans (q/k/v, gate/up, fc1 ...
are column-parallel; o/out/down/fc2/w2 ... row-parallel); a Linear the names do not cover stays replicated on
``tp`` and is counted in the recipe's note. A layout the mesh cannot hold evenly (e.g. a bias of odd length)
falls back to Replicate on that axis, also noted.

This module says which recipes apply to a mesh and where each puts every parameter and the batch
(``recipe_placements``); the solve pass (``autoshard/compiler/solve.py``) turns that into pinned candidates of the
integer program (``recipe_pins``) and solves each recipe alongside the plan.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard.solver.intra_op import Solution

_COLUMN = re.compile(
    r"(^|\.)(wq|wk|wv|wqkv|qkv|q_proj|k_proj|v_proj|query|key|value|c_attn|in_proj|w1|w3|fc1|c_fc|gate_proj|up_proj|"
    r"gate_up_proj|fc_in|intermediate\.dense|lm_head|output|head)(\.weight|\.bias|)$"
)
_ROW = re.compile(r"(^|\.)(wo|o_proj|out_proj|c_proj|w2|fc2|down_proj|fc_out|output\.dense|proj)(\.weight|)$")
_TRANSPOSED = ("Conv1D",)
_CONV = (
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
)  # 3-D+ weights, not experts
DATA_PARALLEL = ("ddp", "zero1", "zero2", "fsdp", "hsdp", "ep")  # recipes whose batch is split over every axis


@dataclass(frozen=True)
class RecipeResult:
    """How one recipe fared on this graph: its solution (None when it does not apply) and why."""

    name: str
    solution: Solution | None
    fits: bool
    objective_s: float
    note: str  # (its memory with the step's temporaries: the Plan's recipe row, ``search/planned.py``)


def is_expert_weight(module_type: str, shape: Sequence[int]) -> bool:
    """A stacked expert weight ``[experts, in, out]``: a 3-D parameter of more than one expert that is not a
    convolution's (a ViT's ``[1, tokens, d]`` position embedding is not one)."""
    return len(shape) == 3 and shape[0] > 1 and module_type not in _CONV


def applicable(mesh_shape: Sequence[int], experts: bool = False, attention: bool = False) -> tuple[str, ...]:
    """Recipes that mean something on this mesh (2-D recipes need two axes; TP needs a tp axis > 1; ep needs a
    model with stacked expert weights, ``experts``; cp one with attention over a sequence, ``attention``)."""
    out = ["ddp", "zero1", "zero2", "fsdp"]
    if experts and mesh_shape[-1] > 1:
        out.append("ep")
    if attention and mesh_shape[-1] > 1:
        out.append("cp")
    if len(mesh_shape) >= 2 and mesh_shape[-1] > 1 and any(n > 1 for n in mesh_shape[:-1]):
        out.append("hsdp")
    if mesh_shape[-1] > 1:
        out.append("tp")
        if len(mesh_shape) >= 2 and any(n > 1 for n in mesh_shape[:-1]):
            out.append("fsdp+tp")
    return tuple(out)


def tp_role(name: str, module_type: str, shape: Sequence[int]) -> tuple[str, int | None]:
    """(role, tensor dim to shard on tp) of one parameter under Megatron TP."""
    nd = len(shape)
    transposed = module_type in _TRANSPOSED
    if module_type == "Embedding" and nd == 2:
        return "vocab", 0
    if _COLUMN.search(name) and (nd >= 2 or name.endswith(".bias")):
        if nd == 1:
            return "column-bias", 0
        # [out, in] (or [experts, in, out] for stacked experts, [in, out] for Conv1D): shard the output features
        return "column", (nd - 1 if transposed or nd == 3 else 0)
    if _ROW.search(name) and nd >= 2:
        return "row", (nd - 2 if transposed or nd == 3 else 1)
    if nd >= 2 and module_type in ("Linear", "Conv1D"):
        return "unmatched", None
    return "replicated", None


def recipe_placements(
    recipe: str, name: str, role: str, module_type: str, shape: Sequence[int], mesh_shape: Sequence[int]
) -> tuple[tuple[Placement, ...], str | None]:
    """Target placements of one graph input under ``recipe``, and a note when the recipe had to bend."""
    nd = len(mesh_shape)
    rep = [Replicate() for _ in range(nd)]
    note = None
    if role == "input":
        if not shape:
            return tuple(rep), None
        if (
            recipe == "cp"
        ):  # a batch too small for the other axes (one 128K sequence) is split on its sequence there too
            seq_everywhere = len(shape) > 1 and shape[0] % math.prod(mesh_shape[:-1]) != 0
            return tuple(
                Shard(1)
                if len(shape) > 1 and (i == nd - 1 or seq_everywhere)
                else Shard(0)
                if i < nd - 1
                else Replicate()
                for i in range(nd)
            ), None
        dp_axes = range(nd) if recipe in DATA_PARALLEL else range(nd - 1)
        return tuple(Shard(0) if i in dp_axes else Replicate() for i in range(nd)), None
    if role != "parameter" or not shape:
        return tuple(rep), None
    want = list(rep)
    if recipe in ("tp", "fsdp+tp"):
        kind, dim = tp_role(name, module_type, shape)
        if dim is not None:
            want[nd - 1] = Shard(dim)
        elif kind == "unmatched":
            note = "unmatched"
    if recipe in ("fsdp", "cp"):
        want = [Shard(0) for _ in range(nd)]
    elif recipe == "ep" and is_expert_weight(module_type, shape):
        want = [Shard(1) for _ in range(nd - 1)] + [Shard(0)]
    elif recipe == "hsdp":
        want[nd - 1] = Shard(0)
    elif recipe == "fsdp+tp":
        # FSDP on the dim tp leaves whole: a column-parallel weight [S(0) dp, S(0) tp] nests the dp shard outside
        # the tp one, and un-sharding dp while keeping tp's shard gathers on both axes (two all-gathers, the
        # second of the whole weight); [S(1), S(0)] gathers only its dp shard. (torchtitan's FSDP2 shards the
        # local TP shard's dim 0: a strided shard, which these placements do not have.)
        # A tp-sharded vector (a column-parallel bias) has no dim tp leaves whole: it stays replicated on dp, as
        # sharding its only dim again would nest and gather on both axes (2 collectives per bias and phase).
        if not (len(shape) == 1 and isinstance(want[nd - 1], Shard)):
            dim = 1 if want[nd - 1] == Shard(0) and len(shape) > 1 else 0
            for i in range(nd - 1):
                want[i] = Shard(dim)
    return tuple(want), note


def state_kind(recipe: str) -> str:
    """How ``recipe`` holds a parameter's gradient and optimizer state: "zero1", "zero2" (sharded over every mesh
    axis where the parameter is replicated; see ``autoshard/compiler/parameter_forms.py: state_variants``) or "" (like
    the parameter)."""
    return recipe if recipe in ("zero1", "zero2") else ""


def candidate_state_kind(grad: Sequence[Placement] | None, state: Sequence[Placement] | None) -> str:
    """The state kind of one parameter candidate (``GroupStrategy.grad_placements`` / ``state_placements``)."""
    if state is None:
        return ""
    return "zero2" if grad is not None and tuple(grad) == tuple(state) else "zero1"


def even_prefix(
    target: tuple[Placement, ...], shape: Sequence[int], mesh_shape: Sequence[int]
) -> tuple[Placement, ...]:
    """``target`` with every Shard the tensor cannot hold evenly turned to Replicate (tp axis kept first)."""
    sizes = list(shape)
    out = list(target)
    for axis in sorted(range(len(out)), key=lambda a: -a):
        p = out[axis]
        if isinstance(p, Shard):
            if p.dim < len(sizes) and sizes[p.dim] % mesh_shape[axis] == 0:
                sizes[p.dim] //= mesh_shape[axis]
            else:
                out[axis] = Replicate()
    return tuple(out)
