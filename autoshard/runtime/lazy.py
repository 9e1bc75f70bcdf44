"""``autoshard.compile(model, mesh)`` with no example inputs: planned and compiled on the first call.

The input convention is data parallelism's (DDP, and ``torch.compile(backend="autoshard")``): every rank passes
its own shard of the batch, and the global batch is the ranks' shards stacked along dim 0 over the mesh's
data-parallel axes (``dp``-like names, or the one axis of a 1-D mesh), the same on the other axes. The first
call plans from what it sees (global shapes: dim 0 times the data-parallel size) with every input pinned to
that layout, so each rank's shard is exactly its local piece and later calls pass straight through.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from autoshard import _torch_compat as tc
from autoshard.errors import CallError, InputError, UsageError
from autoshard.inputs import Call, signature_of
from autoshard.runtime.input_pieces import cut
from autoshard.runtime.model_face import wear_model_face
from autoshard.weights import deferred
from autoshard.weights.pretrained import fqn_modifiers

if TYPE_CHECKING:
    from autoshard.plans.plan import Plan

log = logging.getLogger(__name__)

DATA_PARALLEL_NAMES = ("dp", "ddp", "fsdp", "hsdp", "dp_shard", "dp_replicate", "data", "batch")


def data_parallel_axes(mesh: DeviceMesh) -> tuple[int, ...]:
    """The mesh axes the batch is split over: those with a data-parallel name, or the only axis of a 1-D mesh."""
    names = tuple(mesh.mesh_dim_names or ())
    axes = tuple(i for i, n in enumerate(names) if n in DATA_PARALLEL_NAMES)
    if axes:
        return axes
    if mesh.ndim == 1:
        return (0,)
    raise InputError(
        f"mesh axes {names or tuple(mesh.shape)}: none is named as a data-parallel axis "
        f"({', '.join(DATA_PARALLEL_NAMES)}), "
        "so which axis splits the batch is unknown. Name it, e.g. init_device_mesh('cpu', (2, 2), "
        "mesh_dim_names=('dp', 'tp')), or pass example_inputs (global-shaped) to compile."
    )


def batch_axes_of(mesh: DeviceMesh, axes: str | Sequence[str] | None) -> tuple[int, ...]:
    """The mesh axes a lazy module's batch is split over: ``None`` for the data-parallel ones
    (``data_parallel_axes``), ``"all"`` for every axis (every process passes its own rows: a loader sharded over
    all processes, as Accelerate's and the Trainer's are), or axis names."""
    if axes is None:
        return data_parallel_axes(mesh)
    if axes == "all":
        return tuple(range(mesh.ndim))
    names = tuple(mesh.mesh_dim_names or ())
    wanted = (axes,) if isinstance(axes, str) else tuple(axes)
    missing = [a for a in wanted if a not in names]
    if missing or not wanted:
        raise InputError(
            f"batch_axes={axes!r}: the mesh's axes are {names}; give some of them, 'all', or None (the "
            "data-parallel ones)"
        )
    return tuple(sorted(names.index(a) for a in wanted))


def batch_constraint(
    mesh: DeviceMesh, example: Call | None = None, axes: Sequence[int] | None = None
) -> dict[str, Any]:
    """Every input split on dim 0 over the batch ``axes`` (default: the data-parallel ones) and whole on the
    others; a 0-d tensor of ``example`` (a count such as ``num_items_in_batch``) whole on every rank."""
    dp = data_parallel_axes(mesh) if axes is None else tuple(axes)
    names = tuple(mesh.mesh_dim_names or (f"d{i}" for i in range(mesh.ndim)))
    pins: dict[str, Any] = {"inputs": {names[a]: (Shard(0) if a in dp else Replicate()) for a in range(mesh.ndim)}}
    if example is not None:
        signature, tensors = signature_of(example)
        for name, t in zip(signature.names, tensors):
            if t.ndim == 0:
                pins[name] = {n: Replicate() for n in names}
    return pins


def batch_shards(mesh: DeviceMesh, axes: Sequence[int] | None = None) -> int:
    """How many ranks' batch shards make the global batch: the batch axes' size (default: data-parallel ones)."""
    size = 1
    for a in data_parallel_axes(mesh) if axes is None else axes:
        size *= mesh.shape[a]
    return size


def global_example(args: tuple, kwargs: dict[str, Any], mesh: DeviceMesh, axes: Sequence[int] | None = None) -> Call:
    """The global call the ranks' shards make: meta tensors with dim 0 scaled by the batch axes' size; a 0-d
    tensor (a count, such as Hugging Face's ``num_items_in_batch``) is the same on every rank and stays 0-d."""
    size = batch_shards(mesh, axes)

    def scale(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.ndim == 0:
            return torch.empty((), dtype=t.dtype, device="meta")
        return torch.empty((t.shape[0] * size, *t.shape[1:]), dtype=t.dtype, device="meta")

    with tc.outside_local_tensor_mode():
        leaves, spec = tc.tree_flatten((tuple(args), dict(kwargs)))
        g_args, g_kwargs = tc.tree_unflatten([scale(x) for x in leaves], spec)
    return Call(tuple(g_args), dict(g_kwargs))


def same_on_every_rank(values: list[torch.Tensor], mesh: DeviceMesh) -> None:
    """Refuse 0-d tensor arguments (counts) that differ between ranks: the program takes them whole, as one value."""
    if tc.in_local_tensor_mode() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = torch.stack([v.detach().reshape(()).to(torch.float64) for v in values]).to(mesh.device_type)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise InputError(
            f"0-d tensor arguments (counts such as num_items_in_batch) differ between ranks: from {low.tolist()} to "
            f"{high.tolist()}. autoshard computes the loss of the global batch, with one value of each: pass the "
            "count over every rank's batch (Hugging Face's TrainingArguments(average_tokens_across_devices=True), "
            "the default)"
        )


def alike_off_the_batch_axes(args: tuple, kwargs: dict[str, Any], mesh: DeviceMesh, axes: Sequence[int]) -> None:
    """At the first call: refuse ranks that differ along a mesh axis the batch is not split over (they must pass
    the same rows): a loader that gives every process its own rows with a mesh whose other axes (tp) expect the
    same rows would otherwise train on one of them silently."""
    others = [a for a in range(mesh.ndim) if a not in axes and mesh.shape[a] > 1]
    if not others or tc.in_local_tensor_mode() or not dist.is_initialized():
        return
    tensors = [t for t in tc.tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        return
    marks = []
    for t in tensors:
        flat = t.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        marks += [flat.sum(), (flat * weights).sum()]
    mine = torch.stack(marks).to(mesh.device_type)
    names = tuple(mesh.mesh_dim_names or (f"d{i}" for i in range(mesh.ndim)))
    for a in others:
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=mesh.get_group(a))
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=mesh.get_group(a))
        if not torch.equal(low, high):
            raise InputError(
                f"the ranks along mesh axis {names[a]!r} passed different rows, but the batch is split over "
                f"{[names[i] for i in axes]} only, so they must pass the same ones. A loader that gives every process "
                "its own rows (a DistributedSampler over all processes, Accelerate's prepare) needs "
                "autoshard.compile(model, mesh, batch_axes='all'); a loader of your own must give the ranks of "
                f"{names[a]!r} the same rows"
            )


# Padding of a rank's rows to the longest rank's length, by argument name (Hugging Face's conventions): positions
# past a row's end are masked (attention_mask 0) and count no target (labels -100), so the real tokens' outputs and
# the loss are those of the unpadded rows.
PAD_VALUES = {
    "input_ids": 0,
    "attention_mask": 0,
    "labels": -100,
    "token_type_ids": 0,
    "decoder_input_ids": 0,
    "decoder_attention_mask": 0,
    "completion_mask": 0,
    "assistant_masks": 0,
}


def same_lengths(args: tuple, kwargs: dict[str, Any], mesh: DeviceMesh) -> tuple[tuple, dict[str, Any]]:
    """The call with every rank's tensors the same shape past dim 0: a collator that pads each batch to its own
    longest row (Hugging Face's default) gives ranks different lengths, and the global batch stacks them. Known
    arguments (``PAD_VALUES``) are padded at the end of dim 1 to the longest rank's; others must agree."""
    if tc.in_local_tensor_mode() or not dist.is_initialized() or dist.get_world_size() == 1:
        return args, kwargs
    leaves, spec = tc.tree_flatten((tuple(args), dict(kwargs)))
    shaped = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.ndim >= 2]
    if not shaped:
        return args, kwargs
    dims = torch.tensor([d for i in shaped for d in leaves[i].shape[1:]], dtype=torch.int64)
    longest = dims.clone().to(mesh.device_type)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    longest = longest.cpu()
    if torch.equal(longest, dims):
        return args, kwargs
    names = dict(zip(range(len(leaves)), signature_of(Call(tuple(args), dict(kwargs)))[0].leaf_names))
    if "attention_mask" not in kwargs:
        raise InputError(
            "the ranks' batches have different lengths (a collator padding each batch to its own "
            "longest row) and the call has no attention_mask to mask the padding autoshard would add: "
            "pad every batch to one length (the collator's padding='max_length' or pad_to_multiple_of)"
        )
    at, out = 0, list(leaves)
    for i in shaped:
        t = leaves[i]
        want = longest[at : at + t.ndim - 1].tolist()
        at += t.ndim - 1
        if list(t.shape[1:]) == want:
            continue
        name = names.get(i, "")
        if name not in PAD_VALUES or list(t.shape[2:]) != want[1:]:
            raise InputError(
                f"argument {name or i} has shape {tuple(t.shape)} on this rank and up to {tuple(want)} past dim 0 on "
                "others; autoshard stacks the ranks' rows into one batch and pads only "
                f"{', '.join(PAD_VALUES)} at the end of dim 1: pad every batch to one length in the collator"
            )
        out[i] = torch.nn.functional.pad(t, (0, want[0] - t.shape[1]), value=PAD_VALUES[name])
    new_args, new_kwargs = tc.tree_unflatten(out, spec)
    return tuple(new_args), dict(new_kwargs)


class LazyShardedModule(nn.Module):
    """What ``compile(model, mesh)`` returns without example inputs; the ``ShardedModule`` once called.

    ``module(*shard, **shard_kwargs)``: this rank's batch shard, as with DDP; returns the global batch's loss.
    ``step(*global_inputs)``: forward and backward on the global batch (every rank passes the same values).
    ``pipelined=True`` (a mesh with a ``pp`` axis): only ``step`` applies, as for a ``PipelinedModule``.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        build: Callable[[Call, dict[str, Any]], nn.Module],
        pipelined: bool = False,
        options: dict[str, Any] | None = None,
        batch_axes: str | Sequence[str] | None = None,
        before_plan: Callable[[LazyShardedModule], None] | None = None,
    ) -> None:
        """``build(global example, input pins)`` plans and compiles; ``before_plan(self)`` runs just before it
        (the loops' defaults: ``autoshard/integrations/``)."""
        super().__init__()
        self.module = model
        self.mesh = mesh
        # compile's options, which ``build`` reads when it runs: an integration may still set one the user left
        # unset (the trainer's mixed precision: autoshard/integrations/)
        self.plan_options: dict[str, Any] = options if options is not None else {}
        self._after_compile: list[Callable[[nn.Module], None]] = []
        self._before_plan = before_plan
        wear_model_face(self, model)
        self._build = build
        self._compiled: nn.Module | None = None
        self._pipelined = pipelined
        self.batch_axes_given = batch_axes is not None
        self.batch_axes: tuple[int, ...] = () if pipelined else batch_axes_of(mesh, batch_axes)  # refused now if none

    def split_batch_over_every_rank(self, why: str) -> None:
        """Every process passes its own rows (``why``: the loader that shards them); before the first call."""
        every = tuple(range(self.mesh.ndim))
        if self.batch_axes == every or self._pipelined:
            return
        if self._compiled is not None:
            raise InputError(
                f"{why} gives every process its own rows, but this module was planned at its first call "
                f"with the batch split over mesh axes {self.batch_axes} only: compile it again, with "
                "batch_axes='all'"
            )
        if self.batch_axes_given:
            raise InputError(
                f"{why} gives every process its own rows, but compile was given batch_axes over mesh "
                f"axes {self.batch_axes}: drop batch_axes= (or pass 'all')"
            )
        log.info(
            "autoshard: %s gives every process its own rows: the global batch is all %d ranks' rows",
            why,
            self.mesh.size(),
        )
        self.batch_axes = every

    @property
    def compiled(self) -> nn.Module:
        if self._compiled is None:
            raise UsageError(
                "not compiled yet: autoshard.compile(model, mesh) plans on the first call; call the "
                "module with this rank's batch shard (or .step with the global batch) first"
            )
        return self._compiled

    @property
    def plan(self) -> Plan:
        return self.compiled.plan

    def _ensure(self, args: tuple, kwargs: dict[str, Any], whole: bool = False) -> nn.Module:
        """The compiled module, planned now from this call if it is the first: this rank's shard of the batch,
        or (``whole``: ``step``) the global batch."""
        if self._compiled is None:
            if self._before_plan is not None:
                self._before_plan(self)
            if whole:
                example = Call(tuple(args), dict(kwargs))
            else:
                example = global_example(args, kwargs, self.mesh, self.batch_axes)
                alike_off_the_batch_axes(args, kwargs, self.mesh, self.batch_axes)
            log.info("compile: planning on the first call, global inputs %s", example)
            # the training step is planned (and a checkpoint read into it) whatever mode the first call comes in:
            # an evaluation first (a loop's sanity check, under no_grad or inference_mode) would otherwise trace a
            # joint graph with no gradients, and the module would never train
            with torch.inference_mode(False), torch.enable_grad():
                self._compiled = self._build(example, batch_constraint(self.mesh, example, self.batch_axes))
                self._compiled.batch_axes = self.batch_axes
                for action in self._after_compile:
                    action(self._compiled)
            self._after_compile.clear()
        return self._compiled

    def when_compiled(self, action: Callable[[nn.Module], None]) -> None:
        """Run ``action(compiled module)`` once its shards exist: now if compiled, else right after the first
        call plans and compiles it, before its program runs (a checkpoint to resume from)."""
        if self._compiled is not None:
            action(self._compiled)
        else:
            self._after_compile.append(action)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's batch shard, called as the model is. Training: the global batch's loss, shaped as the
        model returns it (its ``ModelOutput`` with ``loss`` set, a tuple, or the tensor); evaluation (``eval()``):
        the model's output for this rank's rows (``ShardedModule.evaluate`` computes them, this cuts them).

        ``num_items_in_batch`` (Hugging Face's count of the targets in the whole step, over every rank, which
        its models divide their summed loss by) is the same on every rank; each rank gets its share of the loss,
        1/N of it for N batch shards, which DDP's gradient averaging expects: the Trainer multiplies it by its
        number of processes, and the gradients are the global batch's."""
        if self._pipelined:
            raise CallError(
                "a pipelined model trains one step at a time over micro-batches: call "
                "sharded.step(...) with the global batch, as you call the model (it returns the loss); "
                "a loop that calls the model's forward (the Hugging Face Trainer, Lightning) needs a mesh "
                "without a 'pp' axis"
            )
        args, kwargs = same_lengths(args, kwargs, self.mesh)
        compiled = self._ensure(args, kwargs)
        counts = [t for t in tc.tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.ndim == 0]
        if counts:
            same_on_every_rank(counts, self.mesh)
        out = compiled(*args, **kwargs)
        share = kwargs.get("num_items_in_batch") is not None
        if not self.training:
            out = self._my_rows(out, args, kwargs)
            return self._share_of(out) if share else out
        return compiled.loss_form(self._share_of(out) if share else out)

    def _share_of(self, out: Any) -> Any:
        """This rank's share of the loss in ``out`` (a tensor, a mapping's ``loss``, a tuple's first element)."""
        n = batch_shards(self.mesh, self.batch_axes)
        if isinstance(out, torch.Tensor):
            return out / n
        if isinstance(out, Mapping) and out.get("loss") is not None:
            out["loss"] = out["loss"] / n  # type: ignore[index]
        elif isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and out[0].ndim == 0:
            out = (out[0] / n, *out[1:])
        return out

    def _my_rows(self, out: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The evaluation output's tensors whose dim 0 is the global batch, cut to this rank's rows (the rows its
        shard of the call produced); the others (a loss) as they are."""
        batch = [t.shape[0] for t in tc.tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.ndim]
        if not batch:
            return out
        whole = batch[0] * batch_shards(self.mesh, self.batch_axes)
        rows = [Shard(0) if a in self.batch_axes else Replicate() for a in range(self.mesh.ndim)]
        leaves, spec = tc.tree_flatten(out)
        mine = [
            cut(t, self.mesh, rows) if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == whole else t
            for t in leaves
        ]
        return tc.tree_unflatten(mine, spec)

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._ensure(args, kwargs, whole=True).step(*args, **kwargs)

    def shard_inputs(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled.shard_inputs(*args, **kwargs)

    def _target(self) -> nn.Module:
        return self._compiled if self._compiled is not None else self.module

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # type: ignore[override]
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):  # type: ignore[override]
        return self._target().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self._target().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        return self._target().load_state_dict(state_dict, strict=strict, assign=assign)

    def _fqn_modifiers(self) -> dict[str, str]:
        """``get_state_dict`` / ``set_state_dict`` see the model's own names (``weights/pretrained.py``)."""
        return fqn_modifiers(self.module, "module")

    def init_weights(self, seed: int = 0) -> None:
        """The model's own initialization on the shards; before the first call on a meta model, it runs as soon
        as the first call has allocated them (``autoshard/weights/deferred.py``)."""
        deferred.init_weights(self, seed)

    def load_pretrained(self, path: str, *, strict: bool = True) -> None:
        """A ``save_pretrained`` directory into the shards (deferred to the first call like ``init_weights``)."""
        deferred.load_pretrained(self, path, strict=strict)

    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        deferred.save_pretrained(self.compiled, path, **kwargs)
