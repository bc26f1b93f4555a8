"""The datasets a run reads: the node's mapped cache (training rows, eval rows), or synthetic rows.

``load_dataset`` prepares the training data (and ``data.eval``'s own, or maps the rows that
``data.eval_split`` held out of it) through ``data/prepare.py``, and prints the data lines.
"""

from __future__ import annotations

from typing import Any

import torch

from ..spec.job import LoadedJob
from .data import prepare
from .data.mapped import MappedData


class SyntheticDataset(torch.utils.data.Dataset):
    """Random token ids of full length, loss on every token: throughput benchmarks only."""

    def __init__(self, length: int, seq_len: int, vocab_size: int, seed: int) -> None:
        self.length, self.seq_len, self.vocab_size, self.seed = length, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        ids = torch.randint(0, self.vocab_size, (self.seq_len,), generator=generator).tolist()
        return {"input_ids": ids, "labels": ids}


def load_dataset(loaded: LoadedJob, tokenizer, settings: Any, ranks: Any, vocab_size: int, log):
    """The training rows, and the eval rows (None without eval data)."""
    spec = loaded.spec
    packing = settings.packing and not spec.data.synthetic

    def prepared_set(source_set: str):
        # One builder per node writes the tokenized, packed data once; every rank maps it (data/prepare.py).
        return prepare.prepare(
            loaded,
            tokenizer,
            packing=packing,
            local_rank=ranks.local_rank,
            cache_dir=prepare.cache_dir_for(loaded, settings.output_dir),
            say=lambda text: print(f"dzctl-train: {text}", flush=True),
            source_set=source_set,
        )

    held = None
    if spec.data.eval is not None:
        held = prepared_set("eval").data
        if ranks.rank == 0:
            for line in data_summary(held.info, spec.train.max_seq_len, packing):
                print(f"dzctl-train: eval {line}", flush=True)
    if spec.data.synthetic:
        if settings.packing and ranks.rank == 0:
            print("dzctl-train: packing does not apply to synthetic:random (its rows are full)", flush=True)
        steps = spec.train.max_steps if spec.train.max_steps > 0 else 100
        rows = steps * settings.micro_batch_size * settings.gradient_accumulation_steps * ranks.world_size
        data = SyntheticDataset(rows, spec.train.max_seq_len, vocab_size, spec.train.seed)
        return data, MappedDataset(held) if held is not None else None
    prepared = prepared_set("train")
    if spec.data.eval_split is not None:
        held = MappedData(prepared.folder, "eval")
    if ranks.rank == 0:
        for line in data_summary(prepared.data.info, spec.train.max_seq_len, settings.packing):
            print(f"dzctl-train: {line}", flush=True)
    return MappedDataset(prepared.data), MappedDataset(held) if held is not None else None


def _left_out(source: dict[str, Any], max_seq_len: int) -> str:
    """The assistant turns out of the loss: rendered nothing new, or cut away whole by max_seq_len."""
    cut = source.get("cut_turns", 0)
    text = f"{source['untrained_turns'] + cut} assistant turns left out of the loss"
    return f"{text} ({cut} past max_seq_len {max_seq_len})" if cut else text


def data_summary(info: dict[str, Any], max_seq_len: int, packed: bool) -> list[str]:
    """The data lines of the log: the skipped rows, one line per source, the packing."""
    lines = [f"skipped row: {line}" for line in info.get("skipped_lines", [])]
    for source in info["sources"]:
        share = ""
        if len(info["sources"]) > 1:
            if source.get("available") is None:  # data.mix_strategy: concat takes every row, uncounted
                share = f" {source['read']:,} rows (concatenated),"
            else:
                share = f" weight {source['weight']:g}, {source['read']:,} of {source['available']:,} rows,"
        reasoning = ""
        if source.get("reasoning_turns"):
            reasoning = f", {source['reasoning_turns']} assistant turns with reasoning"
            if source.get("reasoning_dropped"):
                reasoning += f" ({source['reasoning_dropped']} removed: data.enable_thinking false)"
        split = f", {source['split_rows']} rows split per turn" if source.get("split_rows") else ""
        if source.get("tool_rows"):
            split += f", {source['tool_rows']} rows with tools"
        # Every column accounted for: the ones the format does not read are named (train/data/build.py).
        if source.get("ignored"):
            split += f"; ignored: {', '.join(source['ignored'])}"
        lines.append(
            f"data {source['label']}:{share} {source['examples']:,} examples, {source['skipped']} rows skipped, "
            f"{source['truncated_away']} dropped (responses past max_seq_len {max_seq_len}), "
            f"{_left_out(source, max_seq_len)}{split}{reasoning}"
            + (f"; template {info['template']}" if info.get("template") else "")
        )
    if "eval_examples" in info:
        lines.append(
            f"data held out (data.eval_split): {info['eval_examples']:,} examples ({info['eval_tokens']:,} tokens) "
            f"for evaluation, {info['train_examples']:,} to train on"
        )
    if packed:
        tokens, capacity = info.get("train_tokens", info["tokens"]), info["capacity"]
        lines.append(
            f"data packed: {info.get('train_examples', info['examples'])} examples into {info['rows']} rows of "
            f"{max_seq_len} tokens, packing "
            f"efficiency {tokens / capacity:.1%} ({tokens} real tokens / {capacity} capacity)"
        )
    return lines


class MappedDataset(torch.utils.data.Dataset):
    """The node's mapped cache (data/mapped.py): examples, or packed rows when the job packs."""

    def __init__(self, data) -> None:
        self.data = data

    def __len__(self) -> int:
        return self.data.rows

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.data.item(index)
