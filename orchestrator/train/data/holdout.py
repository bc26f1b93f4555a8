"""Which examples ``data.eval_split`` holds out of training (numpy, no torch).

Each row gets a key: xxh3-64 of its conversation (roles and texts as JSON, as read from the row
in its format), seeded with ``train.seed``, and each of its examples (one per assistant turn under
a template that re-renders the history) carries it. The rows with the smallest keys are held
out, with all their examples: ``planning/evalsplit.py`` says how many rows (``N`` counts rows, as
the controller's check does, never examples), and every other row whose key equals the last
held-out one's goes with it. So the choice depends on the rows' content, not their place in the
file: the same rows are held out whatever the tokenizer, template or ``max_seq_len``, whatever the
order of the file, and a row that the data holds twice (the same conversation) is never trained on
in one copy and evaluated on in the other. A row that yields no example (skipped, or cut away by
``max_seq_len``) is in neither side.

Cost: 8 bytes an example and 8 a row in memory (their keys), one hash of a row's text, and a
linear-time selection.
"""

from __future__ import annotations

import json

import numpy as np
import xxhash

from ...planning.datarows import DataError
from ...planning.evalsplit import EVAL_SPLIT_FIX, holdout_count, split_problem


def row_key(messages, seed: int) -> int:
    """The key of one conversation (``Conversation.messages``)."""
    text = json.dumps(messages, ensure_ascii=False, separators=(",", ":"))
    return xxhash.xxh3_64_intdigest(text.encode("utf-8"), seed=seed & 0xFFFFFFFFFFFFFFFF)


def held_out(example_keys: np.ndarray, split: float | int, row_keys: np.ndarray | None = None) -> np.ndarray:
    """A mask over the examples: True where held out.

    ``example_keys``: each example's ``row_key``; ``row_keys``: one per row that kept an example,
    the count ``split`` applies to (None: each example is a row of its own)."""
    row_keys = example_keys if row_keys is None else row_keys
    count = len(row_keys)
    problem = split_problem(split, count, "rows that kept an example")
    if problem:
        raise DataError(problem, fix=EVAL_SPLIT_FIX)
    held = holdout_count(split, count)
    cut = np.partition(row_keys, held - 1)[held - 1]
    mask = example_keys <= cut
    if mask.all():  # every remaining row is a copy of the last held-out row
        raise DataError(
            f"data.eval_split: every row shares its content with a held-out one ({count} rows): "
            "nothing is left to train on",
            fix=EVAL_SPLIT_FIX,
        )
    return mask
