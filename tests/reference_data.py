"""Today's data path before the per-node cache, kept as the reference the cache is held to.

``reference_rows`` is what ``train/run.py::load_dataset`` did on every rank: read the whole
file (``read_conversations``), encode every row (``encode_all``) and pack the examples
(``pack_examples``), all in Python lists. Run as a script it is the trainer with that
load_dataset swapped in (``python tests/reference_data.py JOB ...`` takes the trainer's
arguments), so a test can compare the per-step losses of both paths.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.train.data import conversations, packing


def reference_rows(path: Path, fmt: str, on_error: str, tokenizer, max_seq_len: int, packed: bool, seed: int):
    report = conversations.read_conversations(path, fmt, on_error)
    encoded = conversations.encode_all(report.conversations, tokenizer, max_seq_len)
    if not packed:
        return encoded.examples
    rows, _ = packing.pack_examples(encoded.examples, max_seq_len, seed)
    return rows


def _reference_load_dataset(loaded, tokenizer, settings, ranks, vocab_size, log):
    import torch

    spec = loaded.spec
    rows = reference_rows(
        loaded.resolve_local(spec.data.path),
        spec.data.format,
        spec.data.on_error,
        tokenizer,
        spec.train.max_seq_len,
        settings.packing,
        spec.train.seed,
    )

    class ListDataset(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, index: int):
            return rows[index]

    return ListDataset(), None  # (training rows, eval rows): this reference has no eval data


if __name__ == "__main__":
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as entry's early_defaults would, before torch imports
    from orchestrator.train import entry, run

    run.load_dataset = _reference_load_dataset
    # As `python -m orchestrator.train` ends: without finalization, which gloo's threads can abort.
    entry.exit_rank(entry.main(sys.argv[1:]))
