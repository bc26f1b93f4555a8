"""Preference and KTO rows → token ids, rendered by the chat template exactly as SFT renders them (no torch).

Each answer is rendered as SFT renders an assistant turn (``chat.template_messages``, then the
template on the prompt with the generation prompt and on the prompt with the answer), and the
whole text is tokenized once with the answer's span trained by the same offsets rule as SFT's
labels (``chat._label_by_offsets``; ``_label_by_pieces`` for a slow tokenizer). The prompt ids are
the tokens before the answer's first trained token, so what DPO scores is exactly what SFT would
train on this answer, in the same context, Qwen3's thinking included. Where the chosen and the
rejected renderings tokenize the prompt differently (a merge across the answer's start), the prompt
is their common prefix and the rest goes with each answer (as TRL's own tokenization does).

Rows past ``train.max_seq_len``: an answer is cut at its end (TRL's ``keep_start``); a row whose
prompt alone fills it is dropped (counted). In a run, the node's data builder (local rank 0) calls
``encode_rows`` on chunks of rows in its worker pool and writes the examples into the node's
memory-mapped cache (``train/preference/cache.py``), which every rank maps; ``encode_job`` and
``split`` are the same encoding in memory, whole (the tests hold the cache to them).

``data.eval_split`` holds out rows by the key of their content (``data/holdout.py``'s rule: the
rows with the smallest keys), so the held-out rows do not depend on the file's order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...planning.chattemplate import node_chat_template
from ...planning.datafiles import Malformed
from ...planning.datarows import DataError
from ...planning.preference.rows import Answer, KtoRow, PreferenceRow, to_kto, to_preference
from ...spec.job import LoadedJob
from ..data import holdout, sources
from ..data.chat import ChatRenderer, TurnStats, common_prefix, make_renderer, template_messages


@dataclass
class Encoded:
    """The examples of one source set, and what the data lines say of it."""

    examples: list[dict[str, Any]] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # each example's row key (holdout.row_key)
    rows: int = 0
    skipped: list[str] = field(default_factory=list)
    too_long: int = 0  # rows whose prompt alone fills max_seq_len
    cut: int = 0  # answers cut at max_seq_len
    stats: TurnStats = field(default_factory=TurnStats)


def answer_ids(
    prompt: tuple[tuple[str, str], ...],
    reasoning: tuple[str | None, ...],
    answer: Answer,
    tokenizer: Any,
    renderer: ChatRenderer,
    stats: TurnStats,
) -> tuple[list[int], int]:
    """The ids of the prompt with this answer, and where the answer's first trained token is.

    SFT's rule (``chat.py``): the text is the template's rendering up to and with the answer, the
    answer's span starts where the prompt's rendering (with the generation prompt) ends, and a token
    is trained where its characters overlap the span, so a token merged across the boundary is the
    answer's first. A slow tokenizer (no offsets) tokenizes the prompt and the answer apart.
    """
    turns = (*prompt, ("assistant", answer.content))
    messages = template_messages(turns, (*reasoning, answer.reasoning), renderer, stats)
    before = renderer.render(messages[:-1], True)
    upto = renderer.render(messages, False)
    start = len(before) if upto.startswith(before) else common_prefix(before, upto)
    if start >= len(upto):
        raise DataError("the chat template renders nothing of the answer")
    if not getattr(tokenizer, "is_fast", False):
        head = tokenizer(upto[:start], add_special_tokens=False)["input_ids"] if start else []
        return head + tokenizer(upto[start:], add_special_tokens=False)["input_ids"], len(head)
    encoded = tokenizer(upto, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    first = next((n for n, (_, end) in enumerate(offsets) if end > start), len(ids))
    return ids, first


def encode_pair(row: PreferenceRow, tokenizer: Any, renderer: ChatRenderer, max_len: int, out: Encoded):
    chosen, first_c = answer_ids(row.prompt, row.prompt_reasoning, row.chosen, tokenizer, renderer, out.stats)
    rejected, first_r = answer_ids(row.prompt, row.prompt_reasoning, row.rejected, tokenizer, renderer, out.stats)
    cut = min(first_c, first_r, common_prefix(chosen, rejected))
    if cut >= max_len:
        out.too_long += 1
        return None
    room = max_len - cut
    out.cut += (len(chosen) - cut > room) + (len(rejected) - cut > room)
    return {"prompt_ids": chosen[:cut], "chosen_ids": chosen[cut:max_len], "rejected_ids": rejected[cut:max_len]}


def encode_kto(row: KtoRow, tokenizer: Any, renderer: ChatRenderer, max_len: int, out: Encoded):
    ids, first = answer_ids(row.prompt, row.prompt_reasoning, row.completion, tokenizer, renderer, out.stats)
    if first >= max_len:
        out.too_long += 1
        return None
    out.cut += len(ids) > max_len
    return {"prompt_ids": ids[:first], "completion_ids": ids[first:max_len], "label": row.label}


def encode_rows(
    rows: Iterable[tuple[str, Any, str, dict[str, str] | None]],
    stage: str,
    tokenizer: Any,
    renderer: ChatRenderer,
    max_len: int,
    seed: int,
    on_error: str,
) -> Encoded:
    """``rows``: ``(where, row, format, columns)``; a bad row raises ``DataError`` (fail) or is listed (skip)."""
    out = Encoded()
    for where, row, fmt, columns in rows:
        out.rows += 1
        try:
            if isinstance(row, Malformed):
                raise DataError(f"{where}: {row.reason}")
            read = to_preference(row, fmt, where, columns) if stage == "dpo" else to_kto(row, fmt, where, columns)
            try:
                if isinstance(read, PreferenceRow):
                    example = encode_pair(read, tokenizer, renderer, max_len, out)
                else:
                    example = encode_kto(read, tokenizer, renderer, max_len, out)
            except DataError as exc:
                raise DataError(f"{where}: {exc.message}") from None
        except DataError as exc:
            if on_error == "fail":
                raise
            out.skipped.append(str(exc))
            continue
        if example is not None:
            answers = (read.chosen, read.rejected) if isinstance(read, PreferenceRow) else (read.completion, read.label)
            out.examples.append(example)
            out.keys.append(holdout.row_key([list(read.prompt), repr(answers)], seed))
    return out


def source_rows(loaded: LoadedJob, source_set: str) -> Iterable[tuple[str, Any, str, dict[str, str] | None]]:
    """Every row of the job's sources (``train`` or ``eval``), each source's ``max_rows`` applied."""
    return rows_of(sources.resolve_sources(loaded, source_set))


def rows_of(found: list[sources.Source]) -> Iterable[tuple[str, Any, str, dict[str, str] | None]]:
    """Every row of these sources, in order, as ``encode_rows`` reads them; each source's ``max_rows`` applied."""
    for source in found:
        for count, (where, row) in enumerate(sources.iter_rows(source), start=1):
            if source.spec.max_rows is not None and count > source.spec.max_rows:
                break
            yield where, row, source.spec.format or "alpaca", source.spec.columns


def refuse_synthetic(loaded: LoadedJob) -> None:
    """``data.path: synthetic:random`` has no answers to prefer: a preference stage refuses it."""
    spec = loaded.spec
    if spec.data.synthetic:
        raise DataError(
            f"{loaded.where('data.path')}: synthetic:random has no chosen or rejected answers to train "
            f"train.stage: {spec.train.stage} on",
            fix="give preference rows (docs/preference.md), or set train.stage: sft for a throughput run",
        )


def encode_job(loaded: LoadedJob, tokenizer: Any, source_set: str = "train") -> Encoded:
    spec = loaded.spec
    refuse_synthetic(loaded)
    renderer = make_renderer(tokenizer, node_chat_template(loaded), spec.data.enable_thinking)
    out = encode_rows(
        source_rows(loaded, source_set),
        spec.train.stage,
        tokenizer,
        renderer,
        spec.train.max_seq_len,
        spec.train.seed,
        spec.data.on_error,
    )
    if not out.examples:
        raise DataError(
            f"{spec.data.path or 'data.sources'}: no {spec.train.stage} example within train.max_seq_len "
            f"{spec.train.max_seq_len} ({out.rows} rows read, {len(out.skipped)} skipped, "
            f"{out.too_long} prompts too long)",
            fix="check data.format and the rows' columns (docs/preference.md), or raise train.max_seq_len",
        )
    return out


def split(encoded: Encoded, eval_split: float | int | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The training examples and the held-out ones (``data.eval_split``: rows with the smallest content keys)."""
    if eval_split is None:
        return encoded.examples, None
    held = holdout.held_out(np.array(encoded.keys, dtype=np.uint64), eval_split)
    train = [e for e, h in zip(encoded.examples, held, strict=True) if not h]
    evaluated = [e for e, h in zip(encoded.examples, held, strict=True) if h]
    return train, evaluated
