"""Where the optimizer must be offloaded: whether DeepSpeed's partial offload would be faster, and how to ask (pure).

A plan that offloads the whole optimizer (its states do not fit the GPUs) may still have room for part of
them: DeepSpeed's ``offload_optimizer.ratio`` (ZeRO-Offload++) keeps whole sub-groups on the GPU, stepped
there, and the host steps the rest (``memory/estimate.py::PartialOffload``). The GPU memory they take comes
out of the activations, so the plan may recompute more layers; the step-time model weighs the two. Measured
on one H100: the 18-layer Qwen3-8B shape at ratio 0.5 with ``sub_group_size`` 5e8 ran 13,582 tokens/s against
12,948 for the whole optimizer on the host, in the same device call (+4.9 %; benchmarks/results/
plans-h100x1-20261207c, predicted -2.9 %); at ratio 0.4, the ratio this note then named, 12,292 against 12,593
(-2.4 %; plans-h100x1-20261207d, predicted +14.1 %).

The planner does not switch to it by itself (two measured ratios on one card, one slower): it plans each
ratio from 0.1 to 0.9 that keeps a different number of sub-groups, and where the fastest that fits is
predicted faster by more than ``MIN_GAIN``, the plan's note gives the ``--set`` that asks for it. Each ratio
is one more plan: at most nine, whatever the model size or node count.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..memory.estimate import PartialOffload
from ..memory.search import MemoryPlan

# The sub-group size measured with a partial offload (DeepSpeed's default is 1e9): finer sub-groups give
# the ratio finer steps (an 8B shard of 4.7 G elements: 10 sub-groups rather than 5).
SUB_GROUP_SIZE = 500_000_000
# Below this predicted gain the note could send a user to a slower plan: the step model's largest error on a
# measured partial offload is +14.1 % (ratio 0.4 above, predicted faster than the whole offload, measured slower).
MIN_GAIN = 0.15
RATIOS = tuple(round(0.1 * tenth, 1) for tenth in range(1, 10))


def options(shard_elements: int, sub_group_size: int = SUB_GROUP_SIZE) -> list[PartialOffload]:
    """The ratios 0.1 to 0.9 that keep a different number of a rank's sub-groups on the GPU (at least one,
    not all), the fewest on the host first."""
    by_kept: dict[int, PartialOffload] = {}
    for ratio in RATIOS:
        partial = PartialOffload(ratio, sub_group_size)
        kept, groups = partial.groups_on_gpu(shard_elements)
        if 0 < kept < groups:
            by_kept.setdefault(kept, partial)  # the smallest ratio that keeps these many
    return [by_kept[kept] for kept in sorted(by_kept, reverse=True)]


def override_for(partial: PartialOffload) -> str:
    """The job's ``--set`` that asks DeepSpeed for this partial offload."""
    return (
        f"--set 'zero.overrides={{zero_optimization: {{sub_group_size: {partial.sub_group_size}, "
        f"offload_optimizer: {{ratio: {partial.ratio:g}}}}}}}'"
    )


def suggestion(plan: MemoryPlan, plan_with: Callable[[PartialOffload], MemoryPlan | None]) -> str | None:
    """A note naming the fastest partial offload that fits, where it beats ``plan`` (the whole optimizer on the
    host, step time predicted) by ``MIN_GAIN``; ``plan_with`` plans and times the job with one (``None``:
    it does not fit)."""
    whole = plan.speed.step.tokens_per_s if plan.speed and plan.speed.step else None
    if not whole:
        return None
    shard = math.ceil(plan.estimate.trainable_params / plan.world_size)
    best: tuple[float, PartialOffload, MemoryPlan] | None = None
    for partial in options(shard):
        candidate = plan_with(partial)
        step = candidate.speed.step if candidate is not None and candidate.speed else None
        if step is not None and (best is None or step.tokens_per_s > best[0]):
            best = (step.tokens_per_s, partial, candidate)
    if best is None or best[0] < whole * (1 + MIN_GAIN):
        return None
    tokens, partial, candidate = best
    kept, groups = partial.groups_on_gpu(shard)
    layers = candidate.estimate.num_layers
    return (
        f"a partial optimizer offload fits and is predicted faster: {override_for(partial)} keeps {kept} of "
        f"{groups} sub-groups per GPU on the GPU (micro-batch {candidate.choice.micro_batch_size}, "
        f"{candidate.choice.layers_checkpointed(layers)} of {layers} layers recomputed): {tokens:,.0f} tokens/s/GPU "
        f"against {whole:,.0f} ({tokens / whole - 1:+.1%}); measured on one H100: +4.9 % at ratio 0.5, -2.4 % at "
        "ratio 0.4 (docs/steptime.md)"
    )
