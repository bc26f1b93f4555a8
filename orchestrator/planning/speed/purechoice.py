"""Where the optimizer must be offloaded: whether ``train.pure_bf16`` would keep it on the GPUs, how much faster (pure).

``train.pure_bf16`` keeps bf16 master weights, gradients and Adam states: 10 bytes a trained parameter instead of
16, and the optimizer never offloaded (``memory/fromjob.py::_optimizer_stays_on_the_gpus``). Where the fp32 states
do not fit the GPUs and the plan offloads the whole optimizer, the bf16 ones may: the host's AdamW step and the
gradients' trips to the host go, and the step-time model weighs that against the activations the states take.
Measured on one H100 through ``dzctl launch --runtime process`` (the 18-layer Qwen3-8B shape, SFT rows, seq 4096,
global batch 32 rows; benchmarks/results/plans-h100x1-20261207e): the auto plan, the optimizer offloaded whole
(micro 4 x 8, none recomputed), 10,720 tokens/s (``dzctl tune``'s first candidate, same machine, 10 minutes
earlier; 13,260 in issue 42's table on another day); with ``--set train.pure_bf16=true`` auto planned micro 8 x 4,
15 of 18 recomputed, nothing offloaded: 18,146 tokens/s measured, 18,932 predicted (+4.3 %), peak 63.71 GiB
measured, 64.57 planned. +69 % over the offloaded plan measured that day (+36.8 % over 13,260).

The planner never turns it on by itself: it changes every update's rounding, so the user asks for it. Where the
job planned with it fits, offloads nothing and is predicted faster by more than ``MIN_GAIN``, the plan's note gives
the ``--set`` that asks for it.
"""

from __future__ import annotations

from ..memory.search import MemoryPlan
from .partialchoice import MIN_GAIN as PARTIAL_MIN_GAIN

# The partial offload's threshold: the step model's largest error measured on an offloaded optimizer's plan
# (+14.1 %, a partial offload predicted faster than the whole one and measured slower). The offloaded side of
# this comparison is that same model's host step, so a smaller gain could send a user to a slower plan.
MIN_GAIN = PARTIAL_MIN_GAIN
MEASURED = "measured on one H100: 18,146 tokens/s against 10,720 offloaded (docs/memory-planner.md)"


def suggestion(plan: MemoryPlan, pure_plan: MemoryPlan | None) -> str | None:
    """A note naming ``train.pure_bf16``, where ``pure_plan`` (the same job planned with it and timed; ``None``: not
    planned) fits, offloads nothing and beats ``plan`` (the optimizer offloaded, its step predicted) by ``MIN_GAIN``.
    """
    offloaded = plan.speed.step.tokens_per_s if plan.speed and plan.speed.step else None
    if not offloaded or pure_plan is None or not pure_plan.fits or pure_plan.choice.offload != "none":
        return None
    step = pure_plan.speed.step if pure_plan.speed else None
    if step is None or step.tokens_per_s < offloaded * (1 + MIN_GAIN):
        return None
    tokens = step.tokens_per_s
    layers = pure_plan.estimate.num_layers
    return (
        "train.pure_bf16 keeps the optimizer on the GPUs and is predicted faster: --set train.pure_bf16=true "
        "(LLaMA-Factory's pure_bf16: true, axolotl's bf16: full) plans micro-batch "
        f"{pure_plan.choice.micro_batch_size}, {pure_plan.choice.layers_checkpointed(layers)} of {layers} layers "
        f"recomputed, nothing offloaded: {tokens:,.0f} tokens/s/GPU against {offloaded:,.0f} "
        f"({tokens / offloaded - 1:+.1%}); it keeps bf16 master weights and Adam states (every update rounded in "
        f"bf16); {MEASURED}"
    )
