"""Which loss the trainer computes (``train.fused_loss``), decided the same way by the planner and the trainer.

Pure: no torch. ``dzctl plan``/``launch`` resolve ``auto`` here and write the result
into the job file each node reads, so the memory the planner predicted is the memory
the trainer spends; a trainer started on a job file by hand resolves it the same way.

- ``liger``: Liger-Kernel's fused linear cross-entropy (the logits are never built),
  together with Liger's RMSNorm, SwiGLU and RoPE kernels for the model type: the set
  Hugging Face's ``use_liger_kernel=True`` applies, which is what was measured
  (DESIGN §5: 8,300 against 6,545 tokens/s/GPU at micro-batch 6, and 73.6 against
  112.2 GiB). Needs CUDA (Triton) and the ``liger-kernel`` package.
- ``chunked``: plain torch (``orchestrator/train/model/loss.py``): the cross-entropy over
  chunks of tokens, each chunk's logits recomputed in the backward; runs anywhere.
- ``none``: the model's own loss (full logits, upcast to fp32).
- ``trl`` (the planner's alone, never a value of ``train.fused_loss``): a preference stage's
  loss, which TRL's trainers compute through their own fused LM head
  (``trl.trainer.utils.add_fused_lm_head``, 1.16): per-token log-probs in tiles of 4,096
  tokens by 32,768 vocabulary entries, the logits never whole, beside HF's own modules.
- ``auto``: ``liger`` for GPU jobs, ``chunked`` on CPU, for the model types whose
  causal-LM head both paths are known to reproduce; ``none`` for any other type.
"""

from __future__ import annotations

import math
from typing import Literal

FusedLoss = Literal["liger", "chunked", "none", "trl"]
CHOICES = ("auto", "liger", "chunked", "none")

# Dense decoder-only families whose causal-LM forward is exactly "decoder, then
# lm_head(hidden), then shifted cross-entropy" (no logit soft-capping or scaling, no
# auxiliary loss), so a fused loss over the final hidden states gives the model's own
# loss. Liger-Kernel has a patch for each (liger_kernel.transformers.monkey_patch).
FUSED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def resolve(choice: str, *, accelerator: str, model_type: str | None) -> FusedLoss:
    """The concrete loss for ``train.fused_loss: choice`` (an explicit choice is kept as written)."""
    if choice != "auto":
        return choice  # type: ignore[return-value]
    if model_type not in FUSED_MODEL_TYPES:
        return "none"
    # On GPUs Liger is the fastest measured (its kernels, not only the loss). On CPU
    # Triton has no backend; the chunked loss keeps a CPU rank's memory as small as a
    # GPU's would be, which is what CPU jobs (tests, rehearsals) are for.
    return "liger" if accelerator == "gpu" else "chunked"


# TRL's fused LM head (trl/kernels/chunked_logprob.py, 1.16): the projection's tile, tokens by vocabulary entries.
TRL_HEAD_TILE = (4096, 32768)


def chunk_tokens(tokens: int, vocab_size: int, hidden_size: int) -> int:
    """Tokens per chunk of the ``chunked`` loss: one chunk's logits about as large as all the hidden states.

    The same budget Liger uses (``ceil(V / H)`` chunks), so the chunk's fp32 logits
    cost about 4 bytes per hidden value of the micro-batch, whatever the vocabulary.
    """
    if tokens < 1:
        return 1
    chunks = max(1, math.ceil(vocab_size / max(hidden_size, 1)))
    return max(1, math.ceil(tokens / chunks))


def liger_chunk_tokens(tokens: int, vocab_size: int, hidden_size: int) -> int:
    """Liger's own chunk (ops/fused_linear_cross_entropy.py, 0.8): ``ceil(V/H)`` chunks, a power of two."""
    if tokens < 1:
        return 1
    per = math.ceil(tokens / max(1, math.ceil(vocab_size / max(hidden_size, 1))))
    return min(tokens, 1 << (per - 1).bit_length())
