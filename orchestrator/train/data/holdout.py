"""Which examples ``data.eval_split`` holds out of training (numpy, no torch).

Each row gets a key: xxh3-64 of its conversation (roles and texts as JSON, as read from the row
in its format), seeded with ``train.seed``. The examples with the smallest keys are held out:
``planning/evalsplit.py`` says how many, and every other example whose key equals the last
held-out one's goes with it. So the choice depends on the rows' content, not their place in the
file: the same rows are held out whatever the tokenizer, template or ``max_seq_len``, whatever the
order of the file, and a row that the data holds twice (the same conversation) is never trained on
in one copy and evaluated on in the other. A row that yields no example (skipped, or cut away by
``max_seq_len``) is in neither side.

Cost: 8 bytes an example in memory (its key), one hash of its text, and a linear-time selection.
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


def held_out(keys: np.ndarray, split: float | int) -> np.ndarray:
    """A mask over the examples: True where held out (``keys``: each example's ``row_key``)."""
    count = len(keys)
    problem = split_problem(split, count, "examples")
    if problem:
        raise DataError(problem, fix=EVAL_SPLIT_FIX)
    cut = np.partition(keys, holdout_count(split, count) - 1)[holdout_count(split, count) - 1]
    mask = keys <= cut
    if mask.all():  # every remaining example is a copy of the last held-out row
        raise DataError(
            f"data.eval_split: every example shares its row's content with a held-out one ({count} examples): "
            "nothing is left to train on",
            fix=EVAL_SPLIT_FIX,
        )
    return mask
