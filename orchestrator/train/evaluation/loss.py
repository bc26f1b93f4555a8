"""The eval loss under ZeRO-3: per token, over every eval row of every rank.

Rows are dealt out in turn (rank r takes rows r, r + W, r + 2W, ...) and run in
micro-batches of the training's size through the training's collator (packed rows:
one flattened sequence with the examples' boundaries, so attention never crosses
one) and the model's training loss (the chunked or fused loss, the packed
attention kernel), in eval mode and without gradients.

Every rank runs the same number of forwards: ZeRO-3 gathers each layer's weights
with a collective, so a rank that ran one forward fewer would leave the others
waiting. A rank out of rows runs its first batch again and counts nothing of it.

Per token: a batch's mean loss times its count of predicted tokens (labels after
the shift by one, -100 left out) is its sum; sums and counts are all-reduced in
float64 and ``eval_loss = sum / count``, the mean over every eval token whatever
the batch it fell in (a mean of batch means would weigh a short batch's tokens
more). Cost: one forward per row, ``ceil(rows / ranks / micro-batch)`` batches per
rank, no optimizer state and no activations kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..data.conversations import IGNORE


def eval_batches(rows: int, rank: int, world_size: int, micro: int) -> list[list[int] | None]:
    """This rank's batches of row indices; ``None`` for a batch it runs only to keep pace with the others."""
    mine = list(range(rank, rows, world_size))
    count = math.ceil(math.ceil(rows / world_size) / micro) if rows else 0
    batches: list[list[int] | None] = [mine[i : i + micro] for i in range(0, len(mine), micro)]
    return batches + [None] * (count - len(batches))


def predicted_tokens(labels: torch.Tensor) -> int:
    """The tokens a causal-LM loss averages over: position t predicts labels[t + 1]; -100 is left out."""
    return int((labels[..., 1:] != IGNORE).sum())


@torch.no_grad()
def eval_loss(
    model,
    dataset,
    collator: Callable[[list[dict]], dict[str, Any]],
    to_device: Callable[[dict[str, Any]], dict[str, Any]],
    *,
    rank: int,
    world_size: int,
    micro: int,
    device: torch.device,
    forward_kwargs: dict[str, Any] | None = None,
) -> tuple[float | None, int]:
    """(eval loss per token, tokens counted) over all ranks; a collective: every rank calls it.

    ``device``: where the reduction's tensor lives (NCCL reduces only GPU tensors, gloo CPU ones).
    """
    was_training = model.training
    model.eval()
    loss_sum, tokens = 0.0, 0
    batches = eval_batches(len(dataset), rank, world_size, micro)
    try:
        for batch in batches:
            rows = [dataset[i] for i in (batch or batches[0] or [0])]
            inputs = collator(rows)
            count = predicted_tokens(inputs["labels"])
            outputs = model(**to_device(inputs), **(forward_kwargs or {}))
            if batch is not None and count:
                loss_sum += float(outputs.loss.detach().float()) * count
                tokens += count
    finally:
        model.train(was_training)
    total = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    loss_sum, tokens = float(total[0]), int(total[1])
    return (loss_sum / tokens if tokens else None), tokens
