"""Attention over packed micro-batches: every example attends only to itself, causally.

A packed micro-batch reaches the model as ONE flattened sequence (batch 1) with
``position_ids`` restarting at every example and the examples' boundaries in
``cu_seq_lens_q``/``cu_seq_lens_k`` (int32 cumulative lengths) and
``max_length_q``/``max_length_k`` (transformers' ``FlashAttentionKwargs``, which
the models pass through to their attention function untouched). No padding is
computed at all; the planner's "micro-batch × max_seq_len tokens" stays an upper
bound of what one micro-step carries.

The function is registered with transformers' ``AttentionInterface`` as
``dzctl_packed`` (``register``), so Qwen3, Llama and the other models that look
their attention up there use it. No attention mask is built for it (the name is
not in ``AttentionMaskInterface``, so ``create_causal_mask`` returns ``None``):
the boundaries travel in the kwargs instead.

Kernels (``DZCTL_PACKED_ATTENTION`` picks one; ``auto`` by default):

- ``varlen``: PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (its flash
  kernel on CUDA: one launch for all examples, no mask, grouped-query heads
  native where the installed torch takes ``enable_gqa``). CUDA only.
- ``flex``: ``flex_attention`` with a document-causal ``BlockMask`` (compiled).
- ``sdpa_split``: one causal SDPA call per example (any device; exact).
- ``sdpa_mask``: one SDPA call with a dense block-diagonal causal mask
  (quadratic memory in the flattened length; the reference, CPU-sized).
- ``auto``: ``varlen`` on CUDA when torch has it, else ``sdpa_split``.

``benchmarks/attention_kernels.py`` measures them on the Qwen3-8B shape.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import torch.nn.functional as F

NAME = "dzctl_packed"
KERNELS = ("varlen", "flex", "sdpa_split", "sdpa_mask")
ENV = "DZCTL_PACKED_ATTENTION"


def varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def choose_kernel(requested: str | None = None) -> str:
    """The kernel to use: ``requested`` (or ``$DZCTL_PACKED_ATTENTION``), ``auto`` resolved."""
    chosen = (requested or os.environ.get(ENV) or "auto").strip()
    if chosen == "auto":
        return "varlen" if varlen_available() else "sdpa_split"
    if chosen not in KERNELS:
        raise ValueError(f"{ENV}={chosen!r}: expected auto or one of {', '.join(KERNELS)}")
    if chosen == "varlen" and not varlen_available():
        raise ValueError(f"{ENV}=varlen needs CUDA and torch.nn.attention.varlen (torch 2.10 or later)")
    return chosen


_kernel = "sdpa_split"


def register(kernel: str) -> str:
    """Register ``dzctl_packed`` with transformers (using ``kernel``); return the name to give the model."""
    from transformers import AttentionInterface

    global _kernel
    _kernel = kernel
    AttentionInterface.register(NAME, packed_attention_forward)
    return NAME


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, heads, tokens, head_dim)
    key: torch.Tensor,  # (1, kv_heads, tokens, head_dim)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns (batch, tokens, heads, head_dim)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        # Not a packed batch (evaluation, generation): transformers' SDPA path.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"a packed micro-batch is one flattened sequence, got batch {query.shape[0]}")
    max_len = int(kwargs.get("max_length_q") or 0)
    out = attend(_kernel, query, key, value, cu, max_len, scaling)
    return out, None


def attend(
    kernel: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    scaling: float | None,
) -> torch.Tensor:
    """Document-causal attention of (1, H, T, D) tensors split at ``cu``; returns (1, T, H, D)."""
    if kernel == "varlen":
        return _varlen(query, key, value, cu, max_len, scaling)
    if kernel == "flex":
        return _flex(query, key, value, cu, scaling)
    if kernel == "sdpa_split":
        return _sdpa_split(query, key, value, cu, scaling)
    if kernel == "sdpa_mask":
        return _sdpa_mask(query, key, value, cu, scaling)
    raise ValueError(f"unknown packed attention kernel {kernel!r}")


class _LastOf:
    """What was derived from the last boundaries tensor, reused while the same tensor comes back.

    Every layer of one forward (and its recomputation under checkpointing) gets the
    same ``cu_seq_lens`` tensor; the cache holds that tensor itself, so its identity
    cannot be reused by a new batch's tensor while the entry lives.
    """

    def __init__(self) -> None:
        self.source: torch.Tensor | None = None
        self.value: Any = None

    def get(self, source: torch.Tensor, make):
        if self.source is not source:
            self.source, self.value = source, make()
        return self.value


_bounds = _LastOf()
_block_mask = _LastOf()
_dense_mask = _LastOf()


def _lengths(cu: torch.Tensor) -> list[int]:
    # One device-to-host copy per micro-step, not one per layer.
    return _bounds.get(cu, lambda: torch.diff(cu).tolist())


def _sdpa_split(query, key, value, cu, scaling):
    gqa = query.shape[1] != key.shape[1]
    outs = []
    start = 0
    for n in _lengths(cu):
        end = start + n
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, start:end],
                key[:, :, start:end],
                value[:, :, start:end],
                is_causal=True,
                scale=scaling,
                enable_gqa=gqa,
            )
        )
        start = end
    return torch.cat(outs, dim=2).transpose(1, 2)


def _segment_ids(cu: torch.Tensor, total: int) -> torch.Tensor:
    lengths = torch.diff(cu)
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
    if ids.numel() < total:  # tokens past the last boundary (none from our collator) form their own segment
        ids = torch.cat([ids, ids.new_full((total - ids.numel(),), len(lengths))])
    return ids


def _sdpa_mask(query, key, value, cu, scaling):
    total = query.shape[2]

    def make():
        seg = _segment_ids(cu, total)
        causal = torch.ones(total, total, dtype=torch.bool, device=query.device).tril()
        return ((seg[:, None] == seg[None, :]) & causal)[None, None]

    mask = _dense_mask.get(cu, make)
    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2)


_compiled_flex = None


def _flex(query, key, value, cu, scaling):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    total = query.shape[2]

    def make():
        seg = _segment_ids(cu, total)

        def document_causal(b, h, q_idx, kv_idx):
            return (seg[q_idx] == seg[kv_idx]) & (q_idx >= kv_idx)

        return create_block_mask(document_causal, None, None, total, total, device=query.device)

    block_mask = _block_mask.get(cu, make)
    gqa = query.shape[1] != key.shape[1]
    out = _compiled_flex(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2)


def _varlen_call():
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    extra: dict[str, Any] = {}
    # torch 2.10 took is_causal; 2.11 and later take a window ((-1, 0) is causal).
    if "window_size" in params:
        extra["window_size"] = (-1, 0)
    else:
        extra["is_causal"] = True
    return varlen_attn, extra, "enable_gqa" in params, "scale" in params


def _varlen(query, key, value, cu, max_len, scaling):
    varlen_attn, extra, takes_gqa, takes_scale = _varlen_call()
    if takes_scale:
        extra["scale"] = scaling
    # (T, H, D), contiguous: after RoPE the (1, H, T, D) tensors are head-major, and a
    # copy of q, k, v costs far less than the attention itself.
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    if k.shape[1] != q.shape[1]:
        if takes_gqa:
            extra = {**extra, "enable_gqa": True}
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if not max_len:
        max_len = max(_lengths(cu))
    cu = cu.to(torch.int32)
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)
    return out.unsqueeze(0)
