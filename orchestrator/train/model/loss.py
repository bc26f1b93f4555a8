"""The fused losses of ``train.fused_loss`` (``orchestrator/planning/fusedloss.py``): they never hold the full logits.

At seq 4096 and a 152k vocabulary the logits of one micro-batch (bf16, their fp32
copy for the loss, the fp32 gradient and its bf16 cast) are the largest activation
by far: 41.7 GiB per GPU at micro-batch 6 for Qwen3-8B, a third of an H200.

- ``chunked``: ``chunked_causal_lm_loss`` below, plain torch. The forward walks the
  tokens in chunks, keeps one fp32 log-sum-exp per token and drops each chunk's
  logits; the backward recomputes them chunk by chunk, writing the hidden states'
  gradient and accumulating ``lm_head``'s. Same value and gradients as Hugging Face's
  ``ForCausalLMLoss`` (labels shifted, ``-100`` ignored, summed and divided by
  ``num_items_in_batch`` when the Trainer passes it, else a mean).
- ``liger``: Liger-Kernel's patch for the model type (fused linear cross-entropy,
  RMSNorm, SwiGLU, RoPE), as Hugging Face's ``use_liger_kernel=True`` applies it.

Both read ``lm_head.weight`` in the causal-LM module's forward, outside ``lm_head``'s
own forward. Under ZeRO-3 that weight is partitioned and only gathered around its
own module's forward, so it is registered as an external parameter of the causal-LM
module (``register_external_parameter``): DeepSpeed then gathers it for that
module's forward and backward. DeepSpeed 0.19.8 gathers it by itself on first access
during the engine's forward (``ZeROOrderedDict.__getitem__``), which is enough for
Liger (it computes its gradients in the forward) but not for the chunked loss's
backward: without the registration that backward read the empty partition
(``size mismatch ... vec (0)``, 2 gloo ranks; tests/test_fused_loss.py). Liger-Kernel
issue #1048 reports a stack where even Liger's forward was not covered. With tied
embeddings the weight is the embedding's, registered the same way.
"""

from __future__ import annotations

from types import MethodType

import torch

from ...errors import InputError
from ...planning.fusedloss import FUSED_MODEL_TYPES, chunk_tokens
from ..data.conversations import IGNORE

LIGER_FIX = "install the train extra with Liger (pip install 'liger-kernel>=0.8'), or set train.fused_loss: chunked"


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum over tokens of ``-log softmax(hidden @ weight.T)[target]``, targets ``IGNORE`` left out.

    ``hidden`` (N, H), ``weight`` (V, H), ``targets`` (N,). Saves only the hidden
    states (the final norm's output, which the LM head would have kept anyway),
    the weight (a reference: the parameter itself) and an fp32 log-sum-exp per token.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        count = hidden.shape[0]
        lse = torch.empty(count, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, count, chunk):
            end = min(start + chunk, count)
            # As the model's own path: logits in the model's dtype, then fp32 for the loss.
            logits = (hidden[start:end] @ weight.t()).float()
            chunk_lse = torch.logsumexp(logits, dim=-1)
            target = targets[start:end]
            keep = target != IGNORE
            picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += torch.where(keep, chunk_lse - picked, 0.0).sum()
            lse[start:end] = chunk_lse
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, targets, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # Accumulated in the weight's dtype, as the unfused LM head's backward produces it.
        grad_weight = torch.zeros_like(weight) if want_weight else None
        count = hidden.shape[0]
        for start in range(0, count, ctx.chunk):
            end = min(start + ctx.chunk, count)
            h = hidden[start:end]
            target = targets[start:end]
            keep = target != IGNORE
            # d(lse - logit[target]) / d logits = softmax - one_hot(target), per kept token.
            grad = (h @ weight.t()).float().sub_(lse[start:end].unsqueeze(1)).exp_()
            rows = torch.arange(end - start, device=grad.device)
            grad[rows, target.clamp(min=0)] -= 1.0
            grad.mul_((keep.to(grad.dtype) * grad_total).unsqueeze(1))
            grad = grad.to(hidden.dtype)
            if want_hidden:
                torch.matmul(grad, weight, out=grad_hidden[start:end])
            if want_weight:
                grad_weight.addmm_(grad.t(), h)
            del grad
        return grad_hidden, grad_weight, None, None


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """The causal-LM loss of ``hidden`` (B, T, H) under the head ``weight`` (V, H), without the full logits.

    Hugging Face's semantics: position t predicts ``labels[t + 1]`` (or ``shift_labels[t]``
    when given), ``-100`` is left out; the sum divided by ``num_items_in_batch`` when
    given (the Trainer's count over the whole accumulated batch), else the mean over
    the kept tokens.
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_causal_lm_loss needs labels or shift_labels")
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels.reshape(-1).to(flat.device)
    size = chunk or chunk_tokens(flat.shape[0], weight.shape[0], weight.shape[1])
    total = _ChunkedLinearCrossEntropy.apply(flat, weight, targets, size)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (targets != IGNORE).sum()


# --- applying a loss to a model ---------------------------------------------------------


def require_available(choice: str, where: str) -> None:
    """Fail before any weight is loaded when the chosen loss cannot run here."""
    if choice != "liger":
        return
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as exc:
        raise InputError(
            f"{where}: liger asked for, but Liger-Kernel cannot be imported here ({exc})", fix=LIGER_FIX
        ) from None
    if not torch.cuda.is_available():
        raise InputError(f"{where}: liger needs a CUDA GPU (Triton); none is visible", fix=LIGER_FIX)


def require_model_type(choice: str, model_type: str | None, where: str) -> None:
    if choice in ("liger", "chunked") and model_type not in FUSED_MODEL_TYPES:
        raise InputError(
            f"{where}: {choice} is implemented for model types {', '.join(sorted(FUSED_MODEL_TYPES))}, "
            f"not {model_type!r}",
            fix="set train.fused_loss: none (or auto)",
        )


def apply_fused_loss(model, choice: str) -> None:
    """Make ``model``'s training forward compute ``choice``'s loss (``none``: leave it as it is)."""
    if choice == "none":
        return
    if choice == "liger":
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    elif choice == "chunked":
        model.forward = MethodType(_chunked_forward, model)
    else:
        raise ValueError(f"unknown fused loss {choice!r}")
    gather_head_weight_with(model)


def gather_head_weight_with(model) -> None:
    """ZeRO-3: have DeepSpeed gather ``lm_head.weight`` for the causal-LM module's forward and backward."""
    weight = model.get_output_embeddings().weight
    if hasattr(weight, "ds_id"):  # a ZeRO-3 partitioned parameter (built under zero.Init)
        import deepspeed

        deepspeed.zero.register_external_parameter(model, weight)


def _chunked_forward(self, *args, labels=None, **kwargs):
    """The causal-LM forward with the chunked loss in place of logits + cross-entropy, whenever labels are given.

    In training, and in dzctl's own eval (``train/evaluation/loss.py``, eval mode, no gradients),
    which computes the same loss the same way; a forward without labels (generation) is the plain one.

    Written against the shape every model in ``FUSED_MODEL_TYPES`` shares
    (``outputs = self.model(...)``; ``logits = self.lm_head(outputs[0])``), passing
    every other argument through, so it follows the transformers version installed.
    """
    plain = type(self).forward
    shift_labels = kwargs.get("shift_labels")
    if args or (labels is None and shift_labels is None):
        return plain(self, *args, labels=labels, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    num_items = kwargs.pop("num_items_in_batch", None)
    kwargs.pop("shift_labels", None)
    kwargs.pop("logits_to_keep", None)  # all positions count in training
    outputs = getattr(self, self.base_model_prefix)(**kwargs)
    loss = chunked_causal_lm_loss(
        outputs[0],
        self.get_output_embeddings().weight,
        labels,
        num_items_in_batch=num_items,
        shift_labels=shift_labels,
    )
    return CausalLMOutputWithPast(loss=loss, logits=None)
