"""Sequence packing: several examples in one row of up to ``train.max_seq_len`` tokens (pure, no torch).

Real SFT data is mostly short rows (median ~500 tokens at ``max_seq_len`` 4096):
padded one per row, half or more of every micro-step is padding, and ZeRO-3
still gathers every parameter for it. Packed, the rows come out nearly full.

- whether a job packs at all is the planner's (``orchestrator/planning/packing.py``):
  ``dzctl launch`` writes the resolved value into the job file.
- ``pack(lengths, capacity, seed, window)``: best-fit decreasing inside a shuffle
  window. The examples are shuffled (``random.Random(seed)``), cut into windows of
  ``window`` examples, and each window's examples go, longest first, into the
  open row with the least room that still takes them (a new row when none does).
  The same lengths, capacity and seed give the same rows on every rank and on
  every resume, which is what lets the Trainer's skip of consumed batches land
  on the right row. The window keeps the order of the data set random at large
  scale (a whole epoch sorted by length would not be) while leaving the packer
  enough choice to fill rows: on a log-normal mix (median 500, mean 700) at 4096
  a window of 1,000 examples fills rows to about 99%.
- ``packed_example(examples, row)``: one packed row: ids and labels concatenated,
  the first label of every example set to IGNORE (so the last token of one
  example never learns to predict the first of the next: the loss shifts labels
  by one), and the examples' lengths, from which the collator builds position ids
  and sequence boundaries.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

IGNORE = -100
DEFAULT_WINDOW = 1000


def pack(lengths: list[int], capacity: int, seed: int, window: int = DEFAULT_WINDOW) -> list[list[int]]:
    """Rows of example indices, each row's lengths summing to at most ``capacity``."""
    if capacity < 1:
        raise ValueError("capacity must be positive")
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise ValueError(f"example {too_long[0]} has {lengths[too_long[0]]} tokens, more than a row's {capacity}")
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    rows: list[list[int]] = []
    for start in range(0, len(order), window):
        rows.extend(_best_fit_decreasing(order[start : start + window], lengths, capacity))
    return rows


def _best_fit_decreasing(indices: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    # Sorted (room left, row number) of the open rows: bisect finds the tightest fit in log time.
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []
    # Longest first; ties keep the shuffled order (sorted() is stable), so the seed decides them.
    for index in sorted(indices, key=lambda i: -lengths[i]):
        need = lengths[index]
        at = bisect.bisect_left(room, (need, -1))
        if at < len(room):
            left, row = room.pop(at)
        else:
            left, row = capacity, len(rows)
            rows.append([])
        rows[row].append(index)
        if left - need > 0:
            bisect.insort(room, (left - need, row))
    return rows


@dataclass(frozen=True)
class PackStats:
    rows: int
    examples: int
    tokens: int  # real tokens in all rows
    capacity: int  # rows × max_seq_len

    @property
    def efficiency(self) -> float:
        """Real tokens over the rows' capacity: 1.0 is rows filled to ``max_seq_len``."""
        return self.tokens / self.capacity if self.capacity else 0.0


def stats(lengths: list[int], rows: list[list[int]], capacity: int) -> PackStats:
    return PackStats(
        rows=len(rows),
        examples=sum(len(r) for r in rows),
        tokens=sum(lengths[i] for r in rows for i in r),
        capacity=len(rows) * capacity,
    )


def packed_example(examples: list[dict[str, list[int]]], row: list[int]) -> dict[str, list[int]]:
    """The examples of one row, concatenated, with their lengths (see the module docstring)."""
    ids: list[int] = []
    labels: list[int] = []
    seq_lens: list[int] = []
    for index in row:
        example = examples[index]
        ids.extend(example["input_ids"])
        labels.append(IGNORE)
        labels.extend(example["labels"][1:])
        seq_lens.append(len(example["input_ids"]))
    return {"input_ids": ids, "labels": labels, "seq_lens": seq_lens}


def pack_examples(
    examples: list[dict[str, list[int]]], capacity: int, seed: int, window: int = DEFAULT_WINDOW
) -> tuple[list[dict[str, list[int]]], PackStats]:
    """Pack encoded examples into rows; the rows plus how full they came out."""
    lengths = [len(e["input_ids"]) for e in examples]
    rows = pack(lengths, capacity, seed, window)
    return [packed_example(examples, row) for row in rows], stats(lengths, rows, capacity)
