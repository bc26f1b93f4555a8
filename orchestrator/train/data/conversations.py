"""Training data: a conversation → token ids with labels on the responses only.

Pure Python (the tokenizer is passed in), so it is tested without torch. The row formats
(``data.format``: alpaca with system and history, messages, sharegpt, ``data.columns``) are
``orchestrator/planning/datarows.py``; ``read_conversations`` and ``encode_all`` are the
in-memory path that read, encoded and packed a whole file on every rank before the per-node
cache (``prepare.py``), kept as the reference the cache is tested against.

Rendering: the tokenizer's chat template when it has one, else this plain template
(``{eos}`` is the tokenizer's end-of-sequence token)::

    {system}\\n\\n                      (system turn, if any)
    ### Instruction:\\n{user}\\n\\n       (each user turn)
    ### Response:\\n{assistant}{eos}\\n\\n (each assistant turn)

Loss is computed only on assistant turns (their text and closing tokens); all
other positions get label -100. Sequences are cut to ``train.max_seq_len``; a
row whose responses are cut away entirely is dropped (counted, reported).
With a chat template, a turn is trained when rendering the conversation up to it
is a prefix of rendering the whole conversation (true for single-turn rows; some
templates, such as Qwen3's, re-render earlier assistant turns, whose loss is
then left out rather than misaligned).

``data.path: synthetic:random`` is a benchmark source: random token ids of full
``max_seq_len``, loss on every token. It measures throughput, not learning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ...planning.datarows import ROLES, DataError, to_messages

__all__ = ["IGNORE", "ROLES", "Conversation", "DataError", "Encoded", "encode", "encode_all", "read_conversations"]

IGNORE = -100


@dataclass(frozen=True)
class Conversation:
    messages: tuple[tuple[str, str], ...]  # (role, content)
    where: str  # "file:row N", for messages about this row


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
    return Conversation(to_messages(row, fmt, where), where)


def plain_render(messages: list[dict[str, str]], eos: str, add_generation_prompt: bool = False) -> str:
    """The documented plain template (module docstring), for tokenizers without a chat template."""
    parts = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            parts.append(f"{content}\n\n")
        elif role == "user":
            parts.append(f"### Instruction:\n{content}\n\n")
        else:
            parts.append(f"### Response:\n{content}{eos}\n\n")
    if add_generation_prompt:
        parts.append("### Response:\n")
    return "".join(parts)


@dataclass
class Encoded:
    examples: list[dict[str, list[int]]] = field(default_factory=list)
    truncated_away: int = 0  # rows dropped: every response token was past max_seq_len
    untrained_turns: int = 0  # assistant turns left out of the loss (template not prefix-stable)


def encode_all(conversations: list[Conversation], tokenizer: Any, max_len: int) -> Encoded:
    out = Encoded()
    for conversation in conversations:
        ids, labels, skipped_turns = encode(conversation, tokenizer, max_len)
        out.untrained_turns += skipped_turns
        if all(label == IGNORE for label in labels):
            out.truncated_away += 1
            continue
        out.examples.append({"input_ids": ids, "labels": labels})
    return out


def encode(conversation: Conversation, tokenizer: Any, max_len: int) -> tuple[list[int], list[int], int]:
    """Token ids and labels (-100 outside assistant turns), cut to ``max_len``; plus untrained turns."""
    messages = [{"role": role, "content": content} for role, content in conversation.messages]
    render = renderer(tokenizer)
    full = render(messages, False)
    # Character spans of the assistant turns within the full rendering.
    spans: list[tuple[int, int]] = []
    untrained = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = render(messages[:index], True)
        upto = render(messages[: index + 1], False)
        if upto.startswith(prefix) and full.startswith(upto) and len(upto) > len(prefix):
            spans.append((len(prefix), len(upto)))
        else:
            untrained += 1
    ids: list[int] = []
    labels: list[int] = []
    cursor = 0
    # Tokenize piece by piece at span edges so the labels line up exactly with the ids.
    for start, end in spans:
        for piece, trained in ((full[cursor:start], False), (full[start:end], True)):
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids.extend(piece_ids)
                labels.extend(piece_ids if trained else [IGNORE] * len(piece_ids))
        cursor = end
    tail = full[cursor:]
    if tail:
        tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
        ids.extend(tail_ids)
        labels.extend([IGNORE] * len(tail_ids))
    return ids[:max_len], labels[:max_len], untrained


def renderer(tokenizer: Any):
    """``render(messages, add_generation_prompt) -> text``: the chat template, else the plain one."""
    if getattr(tokenizer, "chat_template", None):

        def render(messages: list[dict[str, str]], generation_prompt: bool) -> str:
            if not messages:
                return ""
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

        return render
    eos = tokenizer.eos_token or ""
    return lambda messages, generation_prompt: plain_render(messages, eos, generation_prompt)
