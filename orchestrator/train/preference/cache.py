"""A preference stage's examples in the node's cache (``train.stage: dpo | kto``): built once, mapped by every rank.

The same cache as SFT's (``train/data/prepare.py``: local rank 0 builds under the key's lock and heartbeat,
the node's other ranks wait and map; ``train/data/cache.py``: key, check, prune), with its own recipe:

- **Key**: the stage, each source's files' content, format, columns and ``max_rows``; the
  tokenizer's serialization and chat template, ``data.template`` and ``data.enable_thinking``;
  ``max_seq_len``, ``on_error``, and ``data.eval_split`` with the seed of the rows' keys. A DPO and
  a KTO cache of one file, or two ``max_seq_len``, never share a key.
- **Encoding**: ``encode.py``'s ``encode_rows`` on chunks of ``CHUNK`` rows, in a
  pool of forked workers (one per core, as SFT's builder: the node's other ranks wait meanwhile),
  so an example is exactly what the in-memory path gives (tests/test_preference_cache.py).
- **Files**: ``train.arrow`` (and ``eval.arrow`` with ``data.eval_split``): Arrow IPC streams, one
  row an example, columns ``prompt_ids`` and ``chosen_ids`` / ``rejected_ids`` (dpo) or
  ``completion_ids`` / ``label`` (kto), ids as ``list<int32>``, in the rows' order. That is the file
  layout ``datasets.Dataset.from_file`` memory-maps, so TRL's trainers get a ``datasets.Dataset``
  whose pages are the page cache's, shared by the node's ranks: no rank holds the rows in lists.
- **data.eval_split**: the rows with the smallest content keys are held out (``train/data/holdout.py``'s rule,
  each example a row of its own, as ``encode.split``); the builder writes every example to
  ``all.arrow`` first, then streams it into the two parts (a batch at a time) and removes it.

Memory while building: the chunks in flight, plus 8 bytes (its key) and a few counters an example;
the mask of ``data.eval_split`` at the end (1 byte an example).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ...planning.chattemplate import node_chat_template
from ...planning.datarows import DataError
from ...planning.preference.rows import read_columns_of
from ...spec.job import LoadedJob
from ..data import cache, holdout, sources
from ..data.build import BuildResult, Done, UnreadColumns, quiet_tokenizer, worker_count
from ..data.chat import make_renderer
from .encode import encode_rows, rows_of

# Bump when the encoding or the files change: older caches then miss the key.
PREFERENCE_LAYOUT = 1
CHUNK = 256
PROGRESS_EVERY_S = 5.0
TRAIN_FILE, EVAL_FILE, ALL_FILE = "train.arrow", "eval.arrow", "all.arrow"
ANSWERS = {"dpo": ("chosen_ids", "rejected_ids"), "kto": ("completion_ids",)}

_WORKER: dict[str, Any] = {}


def id_columns(stage: str) -> tuple[str, ...]:
    """The token-id columns of a stage's examples."""
    return ("prompt_ids", *ANSWERS[stage])


def schema(stage: str) -> pa.Schema:
    fields = [pa.field(name, pa.list_(pa.int32())) for name in id_columns(stage)]
    if stage == "kto":
        fields.append(pa.field("label", pa.bool_()))
    return pa.schema(fields)


def key_material(loaded: LoadedJob, found: list[sources.Source], tokenizer: Any, cache_dir: Path, split) -> dict:
    """Everything that changes the examples (module docstring)."""
    spec = loaded.spec
    fingerprints = cache.Fingerprints(cache_dir)
    template = node_chat_template(loaded)
    material = {
        "layout": cache.CACHE_LAYOUT,
        "preference_layout": PREFERENCE_LAYOUT,
        "stage": spec.train.stage,
        "sources": [
            {
                "content": [fingerprints.of(path) for path in sources.content_files(s)],
                "format": s.spec.format,
                "columns": s.spec.columns or {},
                "max_rows": s.spec.max_rows,
            }
            for s in found
        ],
        **cache.tokenizer_identity(tokenizer),
        "max_seq_len": spec.train.max_seq_len,
        "on_error": spec.data.on_error,
        "template": [template.name, template.digest] if template else None,
        "enable_thinking": spec.data.enable_thinking,
    }
    if split is not None:
        material["eval_split"] = {"split": split, "seed": spec.train.seed}
    fingerprints.save()
    return material


def _list_array(lists: list[list[int]]) -> pa.Array:
    lengths = np.fromiter((len(x) for x in lists), dtype=np.int32, count=len(lists))
    offsets = np.zeros(len(lists) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter((i for x in lists for i in x), dtype=np.int32, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _encode_chunk(rows: list) -> dict[str, Any]:
    """One chunk's examples as an Arrow record batch, their row keys and the counts of the data line."""
    w = _WORKER
    try:
        out = encode_rows(rows, w["stage"], w["tokenizer"], w["renderer"], w["max_len"], w["seed"], w["on_error"])
    except DataError as exc:  # on_error: fail; sent back whole (an exception's fix does not survive pickling)
        return {"error": (exc.message, exc.fix)}
    columns = {name: _list_array([e[name] for e in out.examples]) for name in id_columns(w["stage"])}
    if w["stage"] == "kto":
        columns["label"] = pa.array([bool(e["label"]) for e in out.examples], pa.bool_())
    batch = pa.RecordBatch.from_pydict(columns, schema=schema(w["stage"]))
    lengths = sum(np.diff(columns[name].offsets.to_numpy()) for name in id_columns(w["stage"]))
    return {
        "batch": batch,
        "keys": np.asarray(out.keys, dtype=np.uint64),
        "tokens": np.asarray(lengths, dtype=np.int64),
        "rows": out.rows,
        "skipped": out.skipped,
        "too_long": out.too_long,
        "cut": out.cut,
        "desirable": sum(1 for e in out.examples if e.get("label")),
    }


def build(
    loaded: LoadedJob,
    found: list[sources.Source],
    tokenizer: Any,
    folder: Path,
    report: Callable[[str], None],
    alive: Callable[[dict[str, Any]], None],
    split,
    workers: int | None = None,
) -> BuildResult:
    """Encode every row of ``found`` into ``folder`` (module docstring); ``split``: ``data.eval_split`` or None."""
    spec = loaded.spec
    stage = spec.train.stage
    renderer = make_renderer(tokenizer, node_chat_template(loaded), spec.data.enable_thinking)
    workers = worker_count() if workers is None else workers
    _WORKER.update(
        stage=stage,
        tokenizer=tokenizer,
        renderer=renderer,
        max_len=spec.train.max_seq_len,
        seed=spec.train.seed,
        on_error=spec.data.on_error,
    )
    gc.freeze()  # the workers share this rank's objects through fork without copying them (build.py)
    pool = multiprocessing.get_context("fork").Pool(workers, quiet_tokenizer) if workers > 1 else None
    gc.unfreeze()
    started = last_said = time.monotonic()
    totals = {"rows": 0, "skipped": 0, "too_long": 0, "cut": 0, "desirable": 0}
    skipped_lines: list[str] = []
    ignored: dict[str, list[str]] = {}  # per source, the columns its rows hold that no reader reads
    keys: list[np.ndarray] = []
    tokens: list[np.ndarray] = []
    pending: deque = deque()
    try:
        with pa.OSFile(str(folder / ALL_FILE), "wb") as sink, pa.ipc.new_stream(sink, schema(stage)) as writer:

            def drain(limit: int) -> None:
                nonlocal last_said
                while len(pending) > limit:
                    result = pending.popleft().get()
                    if "error" in result:
                        message, fix = result["error"]
                        raise DataError(message, fix=fix)
                    writer.write_batch(result["batch"])
                    keys.append(result["keys"])
                    tokens.append(result["tokens"])
                    for name in totals:
                        totals[name] += len(result[name]) if name == "skipped" else result[name]
                    skipped_lines.extend(result["skipped"][: max(0, 20 - len(skipped_lines))])
                    now = time.monotonic()
                    if now - last_said >= PROGRESS_EVERY_S:
                        last_said = now
                        rate = totals["rows"] / (now - started)
                        report(f"data: building ({stage}): {totals['rows']:,} rows encoded, {rate:,.0f} rows/s")
                        alive({"rows": totals["rows"], "rows_per_s": round(rate, 1)})

            chunk: list = []
            for source in found:
                unread = UnreadColumns(read_columns_of(stage, source.spec.format or "alpaca", source.spec.columns))
                for item in rows_of([source]):
                    unread.see(item[1])
                    chunk.append(item)
                    if len(chunk) >= CHUNK:
                        pending.append(
                            pool.apply_async(_encode_chunk, (chunk,)) if pool else Done(_encode_chunk(chunk))
                        )
                        chunk = []
                        drain(2 * workers)
                if unread.ignored():  # every column accounted for, as SFT's builder does
                    ignored[source.display] = unread.ignored()
            if chunk:
                pending.append(pool.apply_async(_encode_chunk, (chunk,)) if pool else Done(_encode_chunk(chunk)))
            drain(0)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    all_keys = np.concatenate(keys) if keys else np.zeros(0, dtype=np.uint64)
    all_tokens = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
    examples = len(all_keys)
    if not examples:
        (folder / ALL_FILE).unlink(missing_ok=True)
        raise DataError(
            f"{spec.data.path or 'data.sources'}: no {stage} example within train.max_seq_len "
            f"{spec.train.max_seq_len} ({totals['rows']} rows read, {totals['skipped']} skipped, "
            f"{totals['too_long']} prompts too long)",
            fix="check data.format and the rows' columns (docs/preference.md), or raise train.max_seq_len",
        )
    info: dict[str, Any] = {
        "stage": stage,
        **totals,
        "examples": examples,
        "tokens": int(all_tokens.sum()),
        "workers": workers,
        "template": renderer.description,
        "ignored": ignored,
    }
    files: dict[str, dict[str, Any]] = {}
    if split is None:
        os.replace(folder / ALL_FILE, folder / TRAIN_FILE)
        files[TRAIN_FILE] = {"format": "arrow", "count": examples}
        info["train_examples"], info["train_tokens"] = examples, info["tokens"]
    else:
        held = holdout.held_out(all_keys, split)
        _split_file(folder, stage, held)
        files[TRAIN_FILE] = {"format": "arrow", "count": int((~held).sum())}
        files[EVAL_FILE] = {"format": "arrow", "count": int(held.sum())}
        info["train_examples"], info["train_tokens"] = int((~held).sum()), int(all_tokens[~held].sum())
        info["eval_examples"], info["eval_tokens"] = int(held.sum()), int(all_tokens[held].sum())
    info["build_s"] = round(time.monotonic() - started, 2)
    return BuildResult(files=files, info=info, skipped_lines=skipped_lines)


def _split_file(folder: Path, stage: str, held: np.ndarray) -> None:
    """``all.arrow`` into ``train.arrow`` and ``eval.arrow`` by the mask, a batch at a time, keeping the order."""
    source = folder / ALL_FILE
    with (
        pa.memory_map(str(source)) as mapped,
        pa.ipc.open_stream(mapped) as reader,
        pa.OSFile(str(folder / TRAIN_FILE), "wb") as train_sink,
        pa.ipc.new_stream(train_sink, schema(stage)) as train,
        pa.OSFile(str(folder / EVAL_FILE), "wb") as eval_sink,
        pa.ipc.new_stream(eval_sink, schema(stage)) as evaluated,
    ):
        start = 0
        for batch in reader:
            mask = pa.array(held[start : start + batch.num_rows])
            start += batch.num_rows
            train.write_batch(batch.filter(pc.invert(mask)))
            evaluated.write_batch(batch.filter(mask))
    source.unlink()


def summary(info: dict[str, Any], max_len: int) -> str:
    """The data line of the log."""
    stage = info["stage"]
    what = "pairs (chosen, rejected)" if stage == "dpo" else "answers (KTO)"
    line = (
        f"data ({stage}): {info['examples']:,} {what} from {info['rows']:,} rows, "
        f"{info['skipped']} skipped, {info['too_long']} dropped (prompt past max_seq_len {max_len}), "
        f"{info['cut']} answers cut at it"
    )
    if stage == "kto":
        line += f"; {info['desirable']} desirable, {info['examples'] - info['desirable']} undesirable"
    line += f"; {info['tokens']:,} tokens (prompts and answers)"
    for where, names in info.get("ignored", {}).items():
        line += f"; ignored in {where}: {', '.join(names)}"
    return line
