"""The fused attention kernels ``scaled_dot_product_attention`` dispatches to, described for ``rules/attention``.

One program traces one of four kernel pairs (forward and backward), each with its own signature:

==========  ====================================================  ==============================================
kernel      forward overload (its backward adds ``_backward``)     where SDPA picks it
==========  ====================================================  ==============================================
cpu         ``_scaled_dot_product_flash_attention_for_cpu``        CPU tensors
flash       ``_scaled_dot_product_flash_attention``                CUDA, fp16/bf16, no mask (FlashAttention-2)
efficient   ``_scaled_dot_product_efficient_attention``            CUDA with a mask, fp32, or older GPUs (xFormers)
cudnn       ``_scaled_dot_product_cudnn_attention``                CUDA where cuDNN's fused attention is preferred
==========  ====================================================  ==============================================

``roles`` names what each argument and output of a call is, from the overload's schema: the query, keys and
values, the output and its log-sum-exp, the output's gradient, a mask, the flags (dropout, causal), the sequence
lengths the CUDA kernels return and take back (``max_q``, ``max_k``), and the rest ("aux": rng state, unused
offsets, a debug mask: tiny tensors, whole on every rank). The log-sum-exp differs in layout: ``[B, H, Lq]``
float32 for cpu and flash, padded to a multiple of 32 queries for efficient, with a trailing 1 for cudnn.

``forward``/``backward`` run one block of queries against one block of keys on a kernel, as context
parallelism's pieces need (``causal_chunks``, ``ring_attention``): no dropout, no mask, causal or not, with
the log-sum-exp always as ``[B, H, Lq]`` float32 (``native_lse`` turns it back into the kernel's own layout).
A block's backward takes the merged output and log-sum-exp of its queries, which every kernel's backward is
exact with, block by block.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

_ARG_ROLES = {
    "query": "query",
    "key": "key",
    "value": "value",
    "grad_out": "grad",
    "grad_out_": "grad",
    "out": "out",
    "logsumexp": "lse",
    "attn_mask": "mask",
    "attn_bias": "mask",
    "dropout_p": "dropout",
    "is_causal": "causal",
    "scale": "scale",
    "max_q": "max_q",
    "max_k": "max_k",
}
_OUT_ROLES = {"output": "out", "logsumexp": "lse", "log_sumexp": "lse", "max_q": "max_q", "max_k": "max_k"}
_GRAD_ROLES = ("grad_query", "grad_key", "grad_value", "grad_mask")


@dataclass(frozen=True)
class Kernel:
    """One kernel pair: ``name`` (see the module docstring), its overloads' names, its log-sum-exp layout."""

    name: str
    forward_op: str  # the overload's name in ``torch.ops.aten``, e.g. "_scaled_dot_product_flash_attention"
    lse_layout: str  # "plain" [B, H, Lq], "padded" [B, H, ceil(Lq / 32) * 32], "trailing" [B, H, Lq, 1]

    def op(self, backward: bool) -> Any:
        return getattr(torch.ops.aten, self.forward_op + ("_backward" if backward else "")).default

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, kw: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, log-sum-exp ``[B, H, Lq]`` float32) of queries ``q`` against keys ``k``, values ``v``."""
        op = self.op(False)
        if self.name in ("cpu", "flash"):
            out, lse = op(q, k, v, 0.0, causal, **kw)[:2]
        else:  # efficient, cudnn: (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal)
            out, lse = op(q, k, v, None, True, 0.0, causal, **kw)[:2]
        return out, plain_lse(self, lse, q.shape[2])

    def backward(
        self,
        g: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        kw: Mapping[str, Any],
    ) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv) of :meth:`forward` given the output ``out`` and log-sum-exp ``lse`` ([B, H, Lq])
        the queries' whole attention had (merged over every key block)."""
        op, lse = self.op(True), native_lse(self, lse)
        # the rng state: read only with dropout, which blocks never have (cuDNN wants it on the device)
        seed = torch.zeros((), dtype=torch.int64, device=q.device if self.name == "cudnn" else "cpu")
        if self.name == "cpu":
            return op(g, q, k, v, out, lse, 0.0, causal, **kw)[:3]
        if self.name == "flash":  # (..., cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, seed, offset)
            return op(g, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, seed, **kw)[:3]
        if self.name == "efficient":  # (..., attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, causal)
            return op(g, q, k, v, None, out, lse, seed, seed, 0.0, [True, True, True, False], causal, **kw)[:3]
        # cudnn: (..., out, lse, seed, offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, causal)
        return op(g, q, k, v, out, lse, seed, seed, None, None, None, q.shape[2], k.shape[2], 0.0, causal, **kw)[:3]


KERNELS = (
    Kernel("cpu", "_scaled_dot_product_flash_attention_for_cpu", "plain"),
    Kernel("flash", "_scaled_dot_product_flash_attention", "plain"),
    Kernel("efficient", "_scaled_dot_product_efficient_attention", "padded"),
    Kernel("cudnn", "_scaled_dot_product_cudnn_attention", "trailing"),
)


def plain_lse(kernel: Kernel, lse: torch.Tensor, q_len: int) -> torch.Tensor:
    """``lse`` in the kernel's layout as ``[B, H, q_len]``."""
    if kernel.lse_layout == "trailing":
        return lse.squeeze(-1)
    return lse.narrow(2, 0, q_len) if kernel.lse_layout == "padded" else lse


def native_lse(kernel: Kernel, lse: torch.Tensor) -> torch.Tensor:
    """A ``[B, H, Lq]`` log-sum-exp in the kernel's own layout (what its backward reads)."""
    if kernel.lse_layout == "trailing":
        return lse.unsqueeze(-1).contiguous()
    if kernel.lse_layout == "padded":
        return F.pad(lse, (0, math.ceil(lse.shape[2] / 32) * 32 - lse.shape[2])).contiguous()
    return lse.contiguous()


@functools.lru_cache(maxsize=1)
def _by_op() -> dict[str, tuple[Kernel, bool]]:
    return {f"aten.{k.forward_op}{suffix}.default": (k, bool(suffix)) for k in KERNELS for suffix in ("", "_backward")}


def ops() -> frozenset[str]:
    """Every kernel's forward and backward overload, by name."""
    return frozenset(_by_op())


def kernel_of(op: Any) -> tuple[Kernel, bool]:
    """(kernel, whether ``op`` is its backward) for one of ``ops()``."""
    return _by_op()[str(op)]


def _given(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The schema's argument name -> value for a call of ``op``, defaults filled (None where there is none)."""
    return {
        a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value if a.has_default_value() else None)
        for i, a in enumerate(op._schema.arguments)
    }


def bound(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """role (or the schema's own name) -> value for a call of ``op`` with ``args``/``kwargs``, defaults filled."""
    return {_ARG_ROLES.get(name, name): v for name, v in _given(op, args, kwargs).items()}


def with_args(op: Any, args: Sequence[Any], by_role: Mapping[str, Any]) -> list[Any]:
    """``args`` (positional) with the arguments of the roles in ``by_role`` replaced."""
    out = list(args)
    for i, a in enumerate(op._schema.arguments[: len(args)]):
        out[i] = by_role.get(_ARG_ROLES.get(a.name, a.name), out[i])
    return out


def laid_out_as(t: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """``t`` in the memory order of the traced ``val``: the efficient kernel lays its output and gradients out
    as [B, L, H, D] whatever its inputs' layout, and the program's later views were traced on that."""

    def order(x: torch.Tensor) -> list[int]:
        return sorted(range(x.ndim), key=lambda d: (-x.stride(d), d))

    want = order(val)
    if [d for d in order(t) if t.shape[d] > 1] == [d for d in want if t.shape[d] > 1]:
        return t
    # (a copy in that order without writing in place: the per-rank programs are traced, then partitioned)
    return t.permute(want).contiguous().permute(sorted(range(t.ndim), key=want.__getitem__))


def results(node: fx.Node, made: Sequence[torch.Tensor], q_len: int, k_len: int) -> tuple[Any, ...]:
    """The outputs of ``node``'s call as its kernel returns them, from context parallelism's ``made``: (output,
    log-sum-exp ``[B, H, Lq]``) for a forward, (dq, dk, dv) for a backward; the extras ("aux") as zeros of their
    traced shape and the sequence lengths the local ones (what the kernel returns for these shards)."""
    kernel, backward = kernel_of(node.target)
    vals = node.meta["val"]
    ref = made[0]
    out: list[Any] = []
    for i, (role, val) in enumerate(zip(roles(node).outputs, vals)):
        if backward:
            out.append(laid_out_as(made[i], val) if i < len(made) else None)
        elif role == "out":
            out.append(laid_out_as(made[0], val))
        elif role == "lse":
            out.append(native_lse(kernel, made[1]))
        elif role in ("max_q", "max_k"):
            out.append(q_len if role == "max_q" else k_len)
        else:
            out.append(
                torch.zeros(val.shape, dtype=val.dtype, device=ref.device) if isinstance(val, torch.Tensor) else None
            )
    return tuple(out)


@dataclass(frozen=True)
class Roles:
    """What the arguments and outputs of one call are (``roles``)."""

    tensors: tuple[str, ...]  # per tensor argument, in ``autoshard.ir.tensor_args`` order
    args: Mapping[str, Any]  # role -> the call's argument (a node, a constant, or None) for the named roles
    outputs: tuple[str, ...]  # per output: "out", "lse", "grad_query", ..., "max_q", "aux"


def roles(node: fx.Node) -> Roles:
    """The roles of ``node``'s arguments and outputs (``node`` calls one of ``ops()``), from its schema."""
    schema = node.target._schema
    given = _given(node.target, node.args, node.kwargs)
    tensors = []
    for a in schema.arguments:  # positional first, then keywords: the order ``tensor_args`` flattens them in
        v = given.get(a.name)
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor):
                tensors.append(_ARG_ROLES.get(a.name, "aux"))
    named = {role: given.get(name) for name, role in _ARG_ROLES.items() if name in given}
    _, backward = kernel_of(node.target)
    if backward:
        outs = tuple(_GRAD_ROLES[i] for i in range(len(schema.returns)))
    else:
        outs = tuple(_OUT_ROLES.get(r.name or "", "aux") for r in schema.returns)
    return Roles(tuple(tensors), named, outs)


__all__ = [
    "KERNELS",
    "Kernel",
    "Roles",
    "bound",
    "kernel_of",
    "laid_out_as",
    "native_lse",
    "ops",
    "plain_lse",
    "results",
    "roles",
    "with_args",
]
