"""What ``train.stage: dpo | kto`` adds to the memory plan, and the reference policy it chooses (pure).

- Each row is two sequences in the micro-batch (DPO: chosen and rejected; KTO: the answer and its KL
  pair): the planner counts a row of ``2 x max_seq_len`` tokens, so every activation, logits and
  loss term doubles as it would for twice the rows.
- The reference policy (``planning/preference/reference.py``): for full fine-tuning the frozen
  ZeRO-3 copy takes its partition (16-bit weights over the ranks) of every GPU; the plan keeps it
  where the job still fits with that much less memory per GPU, else it plans the precomputed
  log-probs (nothing on the GPU in training). LoRA (adapters off), ORPO and SimPO add nothing.

The choice travels to the trainer in the generated DeepSpeed config under ``REFERENCE_KEY``
(DeepSpeed ignores a key it does not know); a run without it (a hand-written ``zero.config``, a trainer
run by hand) applies the same rule without the plan's peak.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..preference.reference import WORDS, Reference, choose_reference, copy_bytes_per_gpu, sequences_per_row
from .estimate import ALLOCATOR_MARGIN, GIB

REFERENCE_KEY = "dzctl_preference_reference"
COPY_TERM = "reference model (frozen ZeRO-3 copy)"


def planned_fused_loss(stage: str, fused_loss: Any) -> Any:
    """The loss path the plan counts: a preference stage's is TRL's own fused LM head (``trl``), with HF's
    modules as written (dzctl applies no Liger kernel there), whatever dzctl's SFT loss would fuse.

    TRL 1.16's trainers never build the full-vocabulary logits (``add_fused_lm_head``); planned as
    if they did (the unfused logits, 27.8 GiB at micro 4 pairs of 2 x 2048), the 18-layer full
    fine-tuning DPO launch on one H200 (``benchmarks/results/plans-h200x1-20261207/dpo-full-1``)
    came out at 115.2 GiB against 85.83 measured.
    """
    return fused_loss if stage == "sft" else "trl"


def planned_seq_len(stage: str, max_seq_len: int) -> int:
    """The tokens one row puts through the model: the sequences of its stage at ``max_seq_len`` each."""
    return max_seq_len * sequences_per_row(stage)


def with_reference(plan, train: Any, total_params: int, planned: Callable[[Any], Any]) -> tuple[Any, Reference]:
    """The plan and the reference it leaves room for; ``planned(hardware)`` plans again on other hardware."""
    copy = copy_bytes_per_gpu(total_params, plan.world_size)
    hardware = plan.hardware
    if hardware.gpu_mem_gib is None:  # CPU ranks: host RAM, no GPU to share
        reference = choose_reference(train.stage, train.pref_loss, train.method, copy_bytes=copy)
        return _noted(plan, reference, copy), reference
    reference = choose_reference(train.stage, train.pref_loss, train.method, copy_bytes=copy, peak_bytes=0,
                                 capacity_bytes=int(hardware.gpu_mem_gib * GIB))  # fmt: skip
    if reference != "frozen-copy":
        return _noted(plan, reference, copy), reference
    # The copy's tensors are PyTorch's like the rest: the allocator's margin applies to them too.
    beside = planned(replace(hardware, gpu_mem_gib=hardware.gpu_mem_gib - copy * (1 + ALLOCATOR_MARGIN) / GIB))
    if beside.fits:
        terms = {**beside.estimate.gpu_terms, COPY_TERM: copy}  # shown in the breakdown, in the peak
        counted = replace(beside, hardware=hardware, estimate=replace(beside.estimate, gpu_terms=terms))
        return _noted(counted, "frozen-copy", copy), "frozen-copy"
    return _noted(plan, "precomputed", copy), "precomputed"


def _noted(plan, reference: Reference, copy: int):
    word = f"preference reference: {WORDS[reference]}"
    if reference == "frozen-copy":
        word += f", {copy / GIB:.2f} GiB per GPU (in the breakdown)"
    elif reference == "precomputed":
        word += f" (a frozen copy's {copy / GIB:.2f} GiB per GPU does not fit beside the plan)"
    return replace(plan, notes=(*plan.notes, word))


def with_reference_key(ds_config: dict[str, Any] | None, reference: Reference | None) -> dict[str, Any] | None:
    if ds_config is None or reference is None:
        return ds_config
    return {**ds_config, REFERENCE_KEY: reference}
