"""The micro-batch of packed rows, flattened into one sequence (see ``attention``).

Rows from ``packing.packed_example`` (ids, labels, the examples' lengths) are
concatenated into a batch of one: no padding, position ids restarting at every
example, and the examples' boundaries as transformers' ``FlashAttentionKwargs``
(``cu_seq_lens_q/k``, ``max_length_q/k``) for the packed attention kernel.
Labels already hold IGNORE at every example's first token (``packing``), so after
the loss's shift by one no example predicts across a boundary.

Why one flattened sequence rather than rows padded to ``max_seq_len``: the
varlen kernels take exactly this layout, nothing is computed for padding, and the
micro-batch keeps its meaning for the planner (``micro_batch_size`` rows of at
most ``max_seq_len`` tokens each, so at most micro × max_seq_len tokens a step).
"""

from __future__ import annotations

import torch


class PackedCollator:
    def __call__(self, rows: list[dict[str, list[int]]]) -> dict[str, object]:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        bounds = [0]
        longest = 0
        for row in rows:
            ids.extend(row["input_ids"])
            labels.extend(row["labels"])
            for n in row["seq_lens"]:
                positions.extend(range(n))
                bounds.append(bounds[-1] + n)
                longest = max(longest, n)
        cu = torch.tensor(bounds, dtype=torch.int32)
        return {
            "input_ids": torch.tensor([ids]),
            "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions]),
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": longest,
            "max_length_k": longest,
        }
