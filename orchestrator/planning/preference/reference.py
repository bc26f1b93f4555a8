"""What a preference stage adds to a step's memory, and where its reference policy comes from (pure).

The reference policy's log-probabilities (DPO's sigmoid and ipo, KTO):

- ``none``: ORPO and SimPO have no reference;
- ``adapters-off``: LoRA; the reference is the base with the adapters switched off: the policy's
  own partitioned weights, no copy;
- ``frozen-copy``: full fine-tuning; a second model, ZeRO-3-partitioned like the policy (16-bit
  weights: 2 bytes a parameter over the ranks) and gathered layer by layer in its forward;
- ``precomputed``: full fine-tuning; TRL's ``precompute_ref_log_probs``: one pass of the policy's
  initial weights over the data before training, two numbers a row kept: no GPU memory in training,
  one forward per row before it.

The choice is by memory: the copy when its partition fits beside the plan's peak, else the
precomputed log-probs. Without the plan's peak (a trainer run by hand on CPU) the copy.

A step's sequences: DPO (every loss) puts chosen and rejected in one micro-batch, twice the
sequences of SFT's rows; KTO computes the KL term on a second, mismatched batch: twice too.
"""

from __future__ import annotations

from typing import Literal

Reference = Literal["none", "adapters-off", "frozen-copy", "precomputed"]

WORDS: dict[str, str] = {
    "none": "none (the loss has no reference policy)",
    "adapters-off": "the base with the LoRA adapters switched off (no copy)",
    "frozen-copy": "a frozen ZeRO-3-partitioned copy of the model",
    "precomputed": "log-probs computed once before training (TRL's precompute_ref_log_probs)",
}


def needs_reference(stage: str, pref_loss: str) -> bool:
    return stage == "kto" or (stage == "dpo" and pref_loss in ("sigmoid", "ipo"))


def sequences_per_row(stage: str) -> int:
    """Sequences one row puts through the model in a micro-batch: SFT 1, DPO 2 (chosen, rejected), KTO 2 (KL)."""
    return 1 if stage == "sft" else 2


def copy_bytes_per_gpu(params: int, world_size: int, bytes_per_value: int = 2) -> int:
    """The frozen copy's partition on each GPU (its 16-bit weights over the ranks)."""
    return -(-params * bytes_per_value // max(world_size, 1))


def choose_reference(
    stage: str,
    pref_loss: str,
    method: str,
    *,
    copy_bytes: int,
    peak_bytes: int | None = None,
    capacity_bytes: int | None = None,
) -> Reference:
    """Where the reference comes from; ``peak_bytes``/``capacity_bytes``: the plan's GPU peak and the GPU's memory."""
    if not needs_reference(stage, pref_loss):
        return "none"
    if method == "lora":
        return "adapters-off"
    if peak_bytes is None or capacity_bytes is None:
        return "frozen-copy"
    return "frozen-copy" if peak_bytes + copy_bytes <= capacity_bytes else "precomputed"


def reference_terms(reference: Reference, copy_bytes: int) -> dict[str, int]:
    """The memory breakdown's term of the reference (GPU bytes per rank)."""
    return {"reference model (frozen ZeRO-3 copy)": copy_bytes} if reference == "frozen-copy" else {}
