"""A built cache, memory-mapped: examples or packed rows, decoded on access (no torch).

Every array is an ``np.memmap`` of the cache's files, read-only: the pages are the page
cache's, shared by every rank of the node (and counted once), and a rank's private memory
is what one micro-batch decodes, whatever the size of the data. An item is the same
``dict`` of lists that the in-memory path gave (``conversations.encode_all`` and
``packing.packed_example``), so the collators and the Trainer see no difference.

``part``: the training examples (``train``, all of them unless ``data.eval_split`` held some
out) or the held-out ones (``eval``); a cache built from ``data.eval``'s own sources is read
whole, as ``train`` (build.py writes the files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .cache import read_manifest
from .packing import IGNORE


class MappedData:
    def __init__(self, folder: Path, part: str = "train") -> None:
        manifest = read_manifest(folder)
        if manifest is None:
            raise FileNotFoundError(f"{folder}: no manifest")
        self.folder = folder
        self.info: dict[str, Any] = manifest["info"]
        files = manifest["files"]
        self._arrays = {name: self._map(name, meta) for name, meta in files.items()}
        self.bit = int(files["tokens.bin"]["flag_bit"])
        self.mask = (1 << self.bit) - 1
        self.tokens = self._arrays["tokens.bin"]
        self.offsets = self._arrays["example_offsets.bin"]
        self.sources = self._arrays["example_source.bin"]
        if part not in ("train", "eval"):
            raise ValueError(f"part {part!r}: train or eval")
        prefix = "eval_" if part == "eval" else ""
        if part == "eval" and "eval_examples.bin" not in self._arrays:
            raise FileNotFoundError(f"{folder}: no examples were held out for evaluation in this cache")
        # The examples of this part (None: every example of the cache, in order).
        self.members = self._arrays.get(f"{part}_examples.bin")
        self.row_offsets = self._arrays.get(f"{prefix}row_offsets.bin")
        self.row_examples = self._arrays.get(f"{prefix}row_examples.bin")

    def _map(self, name: str, meta: dict[str, Any]) -> np.ndarray:
        if meta["count"] == 0:
            return np.zeros(0, dtype=meta["dtype"])
        return np.memmap(self.folder / name, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["count"],))

    @property
    def examples(self) -> int:
        return len(self.offsets) - 1

    @property
    def packed(self) -> bool:
        return self.row_offsets is not None

    @property
    def rows(self) -> int:
        if self.row_offsets is not None:
            return len(self.row_offsets) - 1
        return len(self.members) if self.members is not None else self.examples

    def example_arrays(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        raw = np.asarray(self.tokens[self.offsets[index] : self.offsets[index + 1]], dtype=np.int64)
        ids = raw & self.mask
        labels = np.where(raw >> self.bit, ids, IGNORE)
        return ids, labels

    def example(self, index: int) -> dict[str, list[int]]:
        ids, labels = self.example_arrays(index)
        return {"input_ids": ids.tolist(), "labels": labels.tolist()}

    def packed_row(self, row: int) -> dict[str, list[int]]:
        """As ``packing.packed_example``: ids and labels concatenated, each example's first label IGNORE."""
        assert self.row_offsets is not None and self.row_examples is not None
        members = self.row_examples[self.row_offsets[row] : self.row_offsets[row + 1]]
        ids_parts, label_parts, seq_lens = [], [], []
        for index in members.tolist():
            ids, labels = self.example_arrays(index)
            labels[0] = IGNORE
            ids_parts.append(ids)
            label_parts.append(labels)
            seq_lens.append(len(ids))
        return {
            "input_ids": np.concatenate(ids_parts).tolist(),
            "labels": np.concatenate(label_parts).tolist(),
            "seq_lens": seq_lens,
        }

    def item(self, index: int) -> dict[str, list[int]]:
        if self.packed:
            return self.packed_row(index)
        return self.example(int(self.members[index]) if self.members is not None else index)
