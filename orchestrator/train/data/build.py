"""The builder: sources → conversations → token ids → packed rows, written as flat files (no torch).

It streams: rows are read one at a time (``sources.iter_rows``), turned into conversations
in chunks of ``CHUNK``, encoded by a pool of worker processes (one per core: the node's
other ranks are waiting meanwhile), and each encoded chunk is appended to the files at
once. What stays in memory grows with the number of examples, not tokens: a length (4
bytes) and a source index (2 bytes) per example, plus the packer's lists at the end
(about 200 bytes an example: ~0.2 GB at 1 M examples). The encoding is
``chat.encode_rows`` with the tokenizer called once per chunk (``encode_batch``), so the
tokens and labels are exactly those of the in-memory path (tests/test_data_cache.py holds
them to it); so is the packing (``packing.pack`` on the same lengths and seed).

Files (all raw little-endian arrays, described in the manifest):

- ``tokens.bin``: every example's ids back to back; the top bit of each is set where the
  label is the id itself (an assistant token), clear where it is -100 (uint16 when the
  vocabulary has fewer than 32,768 tokens, else uint32);
- ``example_offsets.bin`` (int64, examples + 1) and ``example_source.bin`` (uint16);
- ``row_offsets.bin`` (int64, rows + 1) and ``row_examples.bin`` (uint32): the packed rows
  as lists of example indices (only with packing);
- with ``data.eval_split`` (``holdout.py`` chooses): ``train_examples.bin`` and
  ``eval_examples.bin`` (uint32, ascending): the examples trained on and those held out; the
  packed rows above then hold only training examples, and ``eval_row_offsets.bin`` /
  ``eval_row_examples.bin`` pack the held-out ones the same way.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...planning.chattemplate import AUTO, ChatTemplate
from ...planning.datafiles import Malformed
from ...planning.datarows import DataError, RowOptions, read_columns, read_row
from ...planning.preference.rows import StageMismatch, refuse_other_stage
from . import holdout, packing, sources
from .chat import IGNORE, ChatRenderer, TrainingRule, TurnStats, encode_rows, make_renderer
from .conversations import Conversation
from .mix import mix_counts, over_counts

CHUNK = 256  # conversations per task handed to a worker
PROGRESS_EVERY_S = 5.0
MAX_WORKERS = 32  # a bound the planner counts with (planning/memory/estimate.py DATA_MAX_WORKERS)


# What the ranks say of a bad row (data.on_error: fail): what the controller's check of the first rows says.
BAD_ROW_FIX = "fix the row, set data.format (and data.columns) to what the file holds, or set data.on_error: skip"


@dataclass(frozen=True)
class BuildSettings:
    max_seq_len: int
    packing: bool
    seed: int
    on_error: str  # fail | skip
    window: int = packing.DEFAULT_WINDOW
    eval_split: float | int | None = None  # data.eval_split: rows held out of training (holdout.py)
    template: ChatTemplate | None = None  # data.template resolved (None: auto)
    enable_thinking: object = AUTO  # data.enable_thinking
    mix: str = "weights"  # data.mix_strategy resolved: weights | concat | interleave_under | interleave_over


@dataclass
class SourceStats:
    label: str
    weight: float
    available: int | None = None  # rows the source has (known when mixing)
    read: int = 0  # rows taken from it
    examples: int = 0
    skipped: int = 0
    truncated_away: int = 0
    untrained_turns: int = 0
    cut_turns: int = 0  # assistant turns max_seq_len cut away whole (their example may stay, for other turns)
    split_rows: int = 0  # rows made into several examples (a template that re-renders history)
    reasoning_turns: int = 0
    reasoning_dropped: int = 0  # data.enable_thinking: false
    tokens: int = 0
    tool_rows: int = 0  # rows with tools or tool calls
    ignored: list[str] = field(default_factory=list)  # columns of the rows that the format does not read

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class BuildResult:
    files: dict[str, dict[str, Any]]
    info: dict[str, Any]
    skipped_lines: list[str] = field(default_factory=list)


def token_dtype(vocab_size: int) -> tuple[np.dtype, int]:
    """The ids' dtype and the trained flag's bit."""
    if vocab_size < 1 << 15:
        return np.dtype("<u2"), 15
    if vocab_size < 1 << 31:
        return np.dtype("<u4"), 31
    raise DataError(f"a vocabulary of {vocab_size} tokens is past this cache's 2^31")


_WORKER: dict[str, Any] = {}


def encode_batch(
    conversations: list[Conversation], tokenizer: Any, max_len: int, renderer: ChatRenderer, stats: TurnStats
) -> list[list[tuple[list[int], list[int]]]]:
    """Each conversation's examples, as ``conversations.encode_all`` makes them (one tokenizer call for all)."""
    rows = encode_rows(conversations, tokenizer, renderer, max_len, stats, [c.where for c in conversations])
    return [row.examples for row in rows]


def _encode_chunk(
    conversations: list[Conversation],
) -> tuple[np.ndarray, np.ndarray, int, TurnStats, np.ndarray, np.ndarray]:
    tokenizer, max_len, dtype, bit = _WORKER["tokenizer"], _WORKER["max_len"], _WORKER["dtype"], _WORKER["bit"]
    key_seed = _WORKER.get("key_seed")  # data.eval_split: each kept example's row key (holdout.py)
    pieces: list[np.ndarray] = []
    lengths: list[int] = []
    keys: list[int] = []
    row_keys: list[int] = []  # one per row that kept an example: data.eval_split counts these
    truncated = 0
    stats = TurnStats()
    renderer = _WORKER["renderer"]
    for conversation, examples in zip(
        conversations, encode_batch(conversations, tokenizer, max_len, renderer, stats), strict=True
    ):
        # Every example of a row (one per turn where the template re-renders history) has the row's key,
        # so a held-out row is held out whole.
        key = holdout.row_key(conversation.key_material, key_seed) if key_seed is not None else None
        kept = False
        for ids, labels in examples:
            values = np.asarray(ids, dtype=np.int64)
            trained = np.asarray(labels, dtype=np.int64) != IGNORE
            if not trained.any():
                truncated += 1
                continue
            pieces.append((values | (trained.astype(np.int64) << bit)).astype(dtype))
            lengths.append(len(ids))
            kept = True
            if key is not None:
                keys.append(key)
        if kept and key is not None:
            row_keys.append(key)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
    return (
        tokens,
        np.asarray(lengths, dtype=np.int64),
        truncated,
        stats,
        np.asarray(keys, dtype=np.uint64),
        np.asarray(row_keys, dtype=np.uint64),
    )


def quiet_tokenizer() -> None:
    # One worker per core already: the tokenizer's own threads would only contend with the others.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


class Done:
    def __init__(self, value) -> None:
        self.value = value

    def get(self):
        return self.value


def worker_count() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


def build(
    found: list[sources.Source],
    tokenizer: Any,
    settings: BuildSettings,
    folder: Path,
    report: Callable[[str], None],
    alive: Callable[[dict[str, Any]], None],
    workers: int | None = None,
) -> BuildResult:
    """Write the cache files into ``folder``; ``report`` prints progress, ``alive`` is called as it goes."""
    dtype, bit = token_dtype(len(tokenizer))
    stats = [SourceStats(s.label, s.spec.weight) for s in found]
    take: list[int | None] = [s.spec.max_rows for s in found]
    # concat: every row of every source (LLaMA-Factory's default), nothing to count.
    if len(found) > 1 and settings.mix != "concat":
        available = []
        for source, stat in zip(found, stats, strict=True):
            report(f"data: counting the rows of {source.label} (for the mix)")
            counted = sources.count_rows(source)
            if counted == 0:
                # A mix keeps every source's share: one source with no rows leaves the mix none at all.
                raise DataError(
                    f"{source.display}: no rows (data.sources[{source.index}], in a mix of {len(found)} sources: "
                    "each gives rows in proportion to its weight, so this one leaves the mix no rows at all)",
                    fix=f"give data.sources[{source.index}] a data file with rows, or remove it from data.sources",
                )
            stat.available = counted
            available.append(min(counted, source.spec.max_rows or counted))
        weights = [s.spec.weight for s in found]
        over = settings.mix == "interleave_over"
        take = list(over_counts(available, weights) if over else mix_counts(available, weights))
    workers = worker_count() if workers is None else workers
    key_seed = settings.seed if settings.eval_split is not None else None
    chat = make_renderer(tokenizer, settings.template, settings.enable_thinking)
    _WORKER.update(
        tokenizer=tokenizer, max_len=settings.max_seq_len, dtype=dtype, bit=bit, key_seed=key_seed, renderer=chat
    )
    # fork: the workers inherit the tokenizer as it is (no pickling, no re-import of transformers).
    # gc.freeze: the workers' collector then never walks (and so never copies) the objects they share
    # with this rank through fork (torch, transformers, the tokenizer): their pages stay shared.
    gc.freeze()
    pool = multiprocessing.get_context("fork").Pool(workers, quiet_tokenizer) if workers > 1 else None
    gc.unfreeze()
    lengths = array("q")
    source_of = array("H")
    keys = array("Q")  # the examples' row keys, with data.eval_split only
    row_keys = array("Q")  # the rows' keys (a row split per turn is one row), with data.eval_split only
    skipped_lines: list[str] = []
    pending: deque = deque()
    started = time.monotonic()
    progress = _Progress(report, alive, started, sum(t for t in take if t) if all(take) else None)
    tokens_path = folder / "tokens.bin"
    try:
        with tokens_path.open("wb") as tokens_out:

            def drain(limit: int) -> None:
                while len(pending) > limit:
                    index, result = pending.popleft()
                    tokens, chunk_lengths, truncated, turns, chunk_keys, chunk_row_keys = result.get()
                    tokens.tofile(tokens_out)
                    keys.extend(chunk_keys.tolist())
                    row_keys.extend(chunk_row_keys.tolist())
                    lengths.extend(chunk_lengths.tolist())
                    source_of.extend([index] * len(chunk_lengths))
                    stat = stats[index]
                    stat.examples += len(chunk_lengths)
                    stat.tokens += int(chunk_lengths.sum())
                    stat.truncated_away += truncated
                    stat.untrained_turns += turns.untrained_turns
                    stat.cut_turns += turns.cut_turns
                    stat.split_rows += turns.split_rows
                    stat.reasoning_turns += turns.reasoning_turns
                    stat.reasoning_dropped += turns.reasoning_dropped

            def submit(index: int, chunk: list[Conversation]) -> None:
                if pool is None:
                    pending.append((index, Done(_encode_chunk(chunk))))
                else:
                    pending.append((index, pool.apply_async(_encode_chunk, (chunk,))))
                drain(2 * workers)

            for source, stat, limit in zip(found, stats, take, strict=True):
                chunk: list[Conversation] = []
                position = [0]
                size = _size(source)
                fmt = source.spec.format or "alpaca"
                options = RowOptions.of(source.spec)
                rule = TrainingRule.of(source.spec)
                columns = UnreadColumns(read_columns(fmt, options))
                for where, row in _cycled(source, position, limit):
                    stat.read += 1
                    try:
                        if isinstance(row, Malformed):
                            raise DataError(f"{where}: {row.reason}")
                        columns.see(row)
                        # This cache holds SFT rows (train/preference/cache.py reads dpo/kto ones): a preference
                        # or KTO row is refused, never skipped (issue 44: never trained silently wrong).
                        refuse_other_stage(row, where, source.spec.columns, "sft")
                        read = read_row(row, fmt, where, options)
                    except StageMismatch:
                        raise
                    except DataError as exc:
                        if settings.on_error == "fail":
                            raise DataError(exc.message, fix=exc.fix or BAD_ROW_FIX) from None
                        stat.skipped += 1
                        if len(skipped_lines) < 20:
                            skipped_lines.append(str(exc))
                        continue
                    stat.tool_rows += bool(read.tools or read.tool_calls)
                    chunk.append(Conversation.of(read, where, rule))
                    if len(chunk) >= CHUNK:
                        submit(source.index, chunk)
                        chunk = []
                    progress.tick(stats, source, position[0] / size if size else None)
                if chunk:
                    submit(source.index, chunk)
                stat.ignored = columns.ignored()
            drain(0)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for source, stat in zip(found, stats, strict=True):
        if stat.read == stat.skipped:
            raise DataError(f"{source.display}: no usable rows", fix="check data.path and data.format")
    if not lengths:
        raise DataError(
            f"{found[0].display if len(found) == 1 else 'data.sources'}: no example keeps a response within "
            f"train.max_seq_len {settings.max_seq_len}"
        )
    files = {"tokens.bin": {"dtype": dtype.str, "count": int(sum(lengths)), "flag_bit": bit}}
    offsets = np.zeros(len(lengths) + 1, dtype="<i8")
    np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=offsets[1:])
    _write(folder, "example_offsets.bin", offsets, files)
    _write(folder, "example_source.bin", np.frombuffer(source_of, dtype=np.uint16).astype("<u2"), files)
    info: dict[str, Any] = {
        "examples": len(lengths),
        "tokens": int(offsets[-1]),
        "sources": [s.as_dict() for s in stats],
        "build_s": round(time.monotonic() - started, 2),
        "workers": workers,
        "template": chat.description,
    }
    all_lengths = np.frombuffer(lengths, dtype=np.int64)
    trained = np.arange(len(lengths))
    if settings.eval_split is not None:
        example_keys, rows_kept = np.frombuffer(keys, dtype=np.uint64), np.frombuffer(row_keys, dtype=np.uint64)
        held = holdout.held_out(example_keys, settings.eval_split, rows_kept)
        trained, evaluated = np.flatnonzero(~held), np.flatnonzero(held)
        _write(folder, "train_examples.bin", trained.astype("<u4"), files)
        _write(folder, "eval_examples.bin", evaluated.astype("<u4"), files)
        info["train_examples"], info["train_tokens"] = len(trained), int(all_lengths[trained].sum())
        info["eval_examples"], info["eval_tokens"] = len(evaluated), int(all_lengths[evaluated].sum())
        held_rows = np.isin(rows_kept, example_keys[evaluated])
        info["eval_rows_held"], info["train_rows"] = int(held_rows.sum()), int((~held_rows).sum())
        if settings.packing:
            info["eval_rows"] = _pack_into(folder, "eval_", evaluated, all_lengths, settings, files)
    if settings.packing:
        info["rows"] = _pack_into(folder, "", trained, all_lengths, settings, files)
        info["capacity"] = info["rows"] * settings.max_seq_len
    return BuildResult(files=files, info=info, skipped_lines=skipped_lines)


def _cycled(source: sources.Source, position: list[int], limit: int | None):
    """The source's rows, at most ``limit``; past its end (interleave_over) from its first row again."""
    read = 0
    while True:
        before = read
        for item in sources.iter_rows(source, position):
            if limit is not None and read >= limit:
                return
            read += 1
            yield item
        if limit is None or read >= limit or read == before:
            return


class UnreadColumns:
    """The columns of a source's rows that its format does not read, named once in the data summary.

    A set of names per source, whatever the rows: memory stays a few names (at most ``LIMIT``)."""

    LIMIT = 20

    def __init__(self, read: frozenset[str]) -> None:
        self.read = read
        self.found: set[str] = set()

    def see(self, row: object) -> None:
        if isinstance(row, dict) and len(self.found) < self.LIMIT:
            self.found.update(key for key in row if key not in self.read)

    def ignored(self) -> list[str]:
        return sorted(self.found)


def _pack_into(
    folder: Path, prefix: str, members: np.ndarray, lengths: np.ndarray, settings: BuildSettings, files: dict
) -> int:
    """Pack the examples ``members`` (indices, ascending) into rows; write them; return how many rows."""
    rows = packing.pack(lengths[members].tolist(), settings.max_seq_len, settings.seed, settings.window)
    row_offsets = np.zeros(len(rows) + 1, dtype="<i8")
    np.cumsum([len(r) for r in rows], out=row_offsets[1:])
    _write(folder, f"{prefix}row_offsets.bin", row_offsets, files)
    # pack() numbers the members from 0: back to the examples' own indices.
    examples = members[np.fromiter((i for r in rows for i in r), dtype=np.int64, count=int(row_offsets[-1]))]
    _write(folder, f"{prefix}row_examples.bin", examples.astype("<u4"), files)
    return len(rows)


def _write(folder: Path, name: str, values: np.ndarray, files: dict[str, dict[str, Any]]) -> None:
    values.tofile(folder / name)
    files[name] = {"dtype": values.dtype.str, "count": int(values.size)}


def _size(source: sources.Source) -> int:
    try:
        return os.path.getsize(source.location) if source.kind == "json" else 0
    except OSError:
        return 0


class _Progress:
    """``data: building: N rows, R rows/s, eta T`` every few seconds, for the logs and the live view."""

    def __init__(self, report, alive, started: float, total: int | None) -> None:
        self.report, self.alive, self.started, self.total = report, alive, started, total
        self.last = started

    def tick(self, stats: list[SourceStats], source: sources.Source, fraction: float | None) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        done = sum(s.read for s in stats)
        rate = done / max(now - self.started, 1e-9)
        eta = None
        if self.total:
            eta = (self.total - done) / rate if rate else None
        elif fraction and len(stats) == 1:
            eta = (now - self.started) * (1 - fraction) / fraction
        eta_text = f", eta {_duration(eta)}" if eta is not None else ""
        self.report(f"data: building: {done:,} rows read ({source.label}), {rate:,.0f} rows/s{eta_text}")
        self.alive({"rows": done, "rows_per_s": round(rate, 1), "eta_s": round(eta, 1) if eta is not None else None})


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
