"""Training data: a conversation → token ids with labels on the responses only.

Pure Python (the tokenizer is passed in), so it is tested without torch. The row formats
(``data.format``: alpaca with system and history, messages, sharegpt, ``data.columns``) are
``orchestrator/planning/datarows.py``; ``read_conversations`` and ``encode_all`` are the
in-memory path that read, encoded and packed a whole file on every rank before the per-node
cache (``prepare.py``), kept as the reference the cache is tested against.

Rendering (``chat.py``): ``data.template`` (auto: the tokenizer's chat template when it has
one), else this plain template (``{eos}`` is the tokenizer's end-of-sequence token)::

    {system}\\n\\n                      (system turn, if any)
    ### Instruction:\\n{user}\\n\\n       (each user turn)
    ### Response:\\n{assistant}{eos}\\n\\n (each assistant turn)

Loss is computed only on assistant turns (their text and closing tokens); all
other positions get label -100. Every assistant turn is trained: its labels come from
rendering the conversation up to it and aligning tokens (``chat.py``); a template that
re-renders the history (Qwen3's) splits the row into one example per such turn.
Examples are cut to ``train.max_seq_len``; one whose responses are cut away entirely is
dropped (counted, reported).

``data.path: synthetic:random`` is a benchmark source: random token ids of full
``max_seq_len``, loss on every token. It measures throughput, not learning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ...planning.datarows import ROLES, DataError, Row, to_turns
from .chat import IGNORE, ChatRenderer, TrainingRule, TurnStats, encode_rows, make_renderer

__all__ = ["IGNORE", "ROLES", "Conversation", "DataError", "Encoded", "encode", "encode_all", "read_conversations"]


@dataclass(frozen=True)
class Conversation:
    messages: tuple[tuple[str, str], ...]  # (role, content); empty for a text row
    where: str  # "file:row N", for messages about this row
    reasoning: tuple[str | None, ...] = ()  # per message: an assistant turn's reasoning_content
    tool_calls: tuple[Any, ...] = ()  # per message: an assistant turn's tool calls (datarows.Row), else None
    tools: tuple[dict[str, Any], ...] | None = None  # the row's tool list (the template's tools block)
    trained: tuple[bool | None, ...] = ()  # per message: the row's own train flag, else None
    text: str | None = None  # data.format text: the document, every token trained
    rule: TrainingRule | None = None  # the source's roles_to_train / train_on_eos (None: assistant turns, "turn")

    @classmethod
    def of(cls, row: Row, where: str, rule: TrainingRule | None = None) -> Conversation:
        return cls(row.messages, where, row.reasoning, row.tool_calls, row.tools, row.trained, row.text, rule)

    @property
    def key_material(self) -> Any:
        """What identifies the row for data.eval_split (holdout.row_key): its turns, or its text."""
        return self.messages if self.text is None else [["text", self.text]]


@dataclass
class ReadReport:
    conversations: list[Conversation] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "file:row N: reason" for on_error: skip


def read_conversations(path: Path, fmt: Literal["alpaca", "messages"], on_error: Literal["fail", "skip"]) -> ReadReport:
    """Read every row; a malformed one raises ``DataError`` (``fail``) or is listed in ``skipped``."""
    report = ReadReport()
    for where, row in _rows(path):
        try:
            report.conversations.append(_to_conversation(row, fmt, where))
        except DataError as exc:
            if on_error == "fail":
                raise
            report.skipped.append(str(exc))
    if not report.conversations:
        raise DataError(f"{path}: no usable rows", fix="check data.path and data.format")
    return report


def _rows(path: Path):
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: data file not found", fix="check data.path (relative to the job file)") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}:row {line}: not UTF-8 (byte {exc.start})", fix="re-save the file as UTF-8") from None
    text = text.removeprefix("\ufeff")  # a BOM from Windows editors is not data
    if path.suffix == ".json" or text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:line {exc.lineno}: not valid JSON: {exc.msg}") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON array of rows, got a {type(data).__name__}")
        for number, row in enumerate(data, start=1):
            yield f"{path}:row {number}", row
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:row {number}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as exc:
            # Yield the failure as a row so on_error: skip applies to it too.
            yield where, _Malformed(f"not valid JSON: {exc.msg} (column {exc.colno})")


@dataclass(frozen=True)
class _Malformed:
    reason: str


def _to_conversation(row: Any, fmt: str, where: str) -> Conversation:
    if isinstance(row, _Malformed):
        raise DataError(f"{where}: {row.reason}")
    messages, reasoning = to_turns(row, fmt, where)
    return Conversation(messages, where, reasoning)


@dataclass
class Encoded:
    examples: list[dict[str, list[int]]] = field(default_factory=list)
    truncated_away: int = 0  # examples dropped: every response token was past max_seq_len
    stats: TurnStats = field(default_factory=TurnStats)

    @property
    def untrained_turns(self) -> int:
        return self.stats.untrained_turns


def encode_all(
    conversations: list[Conversation], tokenizer: Any, max_len: int, renderer: ChatRenderer | None = None
) -> Encoded:
    out = Encoded()
    renderer = renderer or make_renderer(tokenizer)
    for row in encode_rows(conversations, tokenizer, renderer, max_len, out.stats, [c.where for c in conversations]):
        for ids, labels in row.examples:
            if all(label == IGNORE for label in labels):
                out.truncated_away += 1
                continue
            out.examples.append({"input_ids": ids, "labels": labels})
    return out


def encode(
    conversation: Conversation, tokenizer: Any, max_len: int, renderer: ChatRenderer | None = None
) -> tuple[list[tuple[list[int], list[int]]], TurnStats]:
    """The examples of one conversation (token ids, and labels -100 outside assistant turns), cut to ``max_len``."""
    stats = TurnStats()
    renderer = renderer or make_renderer(tokenizer)
    (row,) = encode_rows([conversation], tokenizer, renderer, max_len, stats, [conversation.where])
    return row.examples, stats
