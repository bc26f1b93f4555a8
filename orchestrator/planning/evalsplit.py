"""How many rows ``data.eval_split`` holds out of the training data (pure).

A count is taken as given; a fraction ``f`` of ``n`` rows holds out ``ceil(f * n)`` of them, the
rule of Hugging Face datasets' ``train_test_split`` (``test_size`` as a float), which is what
LLaMA-Factory's ``val_size`` goes through: a fraction above 0 always holds out at least one row.
One difference, on purpose: the product is rounded up without floating point's excess (0.1 of 30
rows is 3 rows here; ``ceil(0.1 * 30)`` is 4 in Python, as ``0.1 * 30`` is 3.0000000000000004).
Both the controller (on the rows of a shipped file, before any host is touched) and the data
builder on the nodes (on the examples it encoded) ask the same question here.
"""

from __future__ import annotations

import math

EVAL_SPLIT_FIX = (
    "hold out fewer rows (data.eval_split: a fraction such as 0.05, or a count below the data's rows), "
    "or give the eval rows their own file with data.eval"
)


def holdout_count(split: float | int, rows: int) -> int:
    """The rows held out of ``rows`` (before duplicates of a held-out row join it: see train/data/holdout.py)."""
    if isinstance(split, float):
        return math.ceil(split * rows - 1e-9)  # 0.1 * 30 is 3.0000000000000004 in floating point: 3 rows
    return int(split)


def split_problem(split: float | int, rows: int, what: str = "rows") -> str | None:
    """Why ``split`` cannot hold out of ``rows`` (it leaves nothing to train on), or None."""
    held = holdout_count(split, rows)
    if held < rows:
        return None
    asked = f"{split:g} of the rows" if isinstance(split, float) else f"{split} rows"
    return f"data.eval_split holds out {asked}: {held} of the data's {rows} {what}, leaving nothing to train on"
