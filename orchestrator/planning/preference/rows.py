"""A preference row (``train.stage: dpo``) or a KTO row (``kto``) → its prompt and answers (pure).

Beside ``datarows.py`` (SFT's rows), and used the same two ways: on the first rows of a local
file by ``dzctl launch`` (``planning/inputs.py``), and on every row by the nodes
(``orchestrator/train/preference/encode.py``, into the node's cache by ``preference/cache.py``). The
prompt is a conversation of ``(role, content)`` turns as ``datarows`` reads it; an answer is one
assistant turn, with its ``reasoning_content``.

Layouts read (docs/preference.md):

- LLaMA-Factory's ranking rows (``ranking: true``): ``alpaca`` rows with ``instruction``
  (``input``, ``system``, ``history``) and ``chosen`` / ``rejected`` texts; ``sharegpt`` rows
  whose ``conversations`` end with the user's turn, with ``chosen`` / ``rejected`` turn objects
  (``{"from": "gpt", "value": ...}``). ``messages`` rows the same way with ``{role, content}``.
- TRL's conversational layout (``messages`` format): ``prompt``, ``chosen`` and ``rejected`` as
  message lists (the answers: one assistant message each); a system message leads the prompt.
- KTO's unpaired rows: a conversation whose last turn is the assistant's answer, with a boolean
  ``label`` (``messages``: LLaMA-Factory's kto_en_demo layout and TRL's, whose ``prompt`` /
  ``completion`` lists are taken too) or ``kto_tag`` (``alpaca``/``sharegpt``, LLaMA-Factory's
  name; ``data.columns: {kto_tag: label}`` reads it from ``label``).

Under ``train.stage: sft`` a row with any of these columns is refused (``stage_of_row``): trained as
SFT, a KTO file's bad answers would become targets and a ranking file's rejected ones would be
dropped or trained, silently. The error names the column and the stage that trains it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..datarows import SHAREGPT_ROLES, DataError, Messages, Reasoning, RowOptions, read_columns, read_row, to_turns

# Where a preference or KTO column sends the row: the stage that trains it.
PREFERENCE_COLUMNS = ("chosen", "rejected")
KTO_COLUMNS = ("kto_tag", "label")


class StageMismatch(DataError):
    """A row holds another stage's data: never skipped (``data.on_error: skip`` would train the rest wrong)."""


@dataclass(frozen=True)
class Answer:
    content: str
    reasoning: str | None = None


@dataclass(frozen=True)
class PreferenceRow:
    prompt: Messages  # ends with a user turn
    prompt_reasoning: Reasoning
    chosen: Answer
    rejected: Answer


@dataclass(frozen=True)
class KtoRow:
    prompt: Messages
    prompt_reasoning: Reasoning
    completion: Answer
    label: bool  # True: a desirable answer


def _column(cols: dict[str, str] | None, name: str) -> str:
    return (cols or {}).get(name, name)


def read_columns_of(stage: str, fmt: str, columns: dict[str, str] | None = None) -> frozenset[str]:
    """The top-level columns a ``dpo`` or ``kto`` row of ``fmt`` is read from: the format's (its prompt), the
    answers (``chosen``/``rejected``; KTO's label column and ``completion``) and TRL's ``prompt``; the others
    are named as ignored (train/preference/cache.py), as SFT's are."""
    answers = PREFERENCE_COLUMNS if stage == "dpo" else (*KTO_COLUMNS, "completion")
    return read_columns(fmt, RowOptions(columns=columns)) | {_column(columns, n) for n in (*answers, "prompt")}


def stage_of_row(row: Any, columns: dict[str, str] | None = None) -> tuple[str, str] | None:
    """``(column, stage)`` when the row holds a preference (``dpo``) or KTO (``kto``) column, else None."""
    if not isinstance(row, dict):
        return None
    for name in PREFERENCE_COLUMNS:
        column = _column(columns, name)
        if row.get(column) is not None:
            return column, "dpo"
    for name in KTO_COLUMNS:
        column = _column(columns, name)
        if isinstance(row.get(column), bool):
            return column, "kto"
    if row.get("completion") is not None and isinstance(row.get("label"), bool):
        return "label", "kto"
    return None


def refuse_other_stage(row: Any, where: str, columns: dict[str, str] | None, stage: str) -> None:
    """Under ``stage: sft`` a preference or KTO row is refused, naming its column and the stage that trains it."""
    if stage != "sft":
        return
    found = stage_of_row(row, columns)
    if found is None:
        return
    column, trains = found
    what = "a chosen/rejected pair (preference data)" if trains == "dpo" else "a KTO label (good/bad answer)"
    raise StageMismatch(
        f"{where}: column {column!r} holds {what}, which train.stage: sft would not train as it means "
        f"(this job's train.stage is sft)",
        fix=f"set train.stage: {trains} to train this file, or give SFT rows",
    )


def _answer(value: Any, where: str, shown: str, fmt: str) -> Answer:
    """A chosen/rejected/completion value: a text, a turn object, or a list ending with the assistant's turn."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: {shown} is empty: nothing to compare")
        return Answer(value)
    if isinstance(value, list):
        if not value:
            raise DataError(f"{where}: {shown} is an empty list")
        value = value[-1]
    if isinstance(value, dict):
        role = value.get("role", value.get("from"))
        content = value.get("content", value.get("value"))
        if role is not None and SHAREGPT_ROLES.get(role) != "assistant":
            raise DataError(f"{where}: {shown} must be the assistant's answer, its role is {role!r}")
        if not isinstance(content, str) or not content.strip():
            raise DataError(f"{where}: {shown} has no text (content or value)")
        thought = value.get("reasoning_content")
        return Answer(content, thought if isinstance(thought, str) else None)
    raise DataError(f"{where}: {shown} must be a text, a turn object or a list of turns, got {type(value).__name__}")


def _prompt_messages(
    row: dict[str, Any], where: str, fmt: str, cols: dict[str, str] | None
) -> tuple[Messages, Reasoning]:
    """The prompt: the row's conversation up to the answers (ending with the user's turn)."""
    if fmt == "messages" and isinstance(row.get(_column(cols, "prompt")), (list, str)):
        prompt = row[_column(cols, "prompt")]
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        # TRL's layout: a system message may lead the answers' lists instead of the prompt's.
        turns, reasoning = to_turns({"messages": [*prompt, {"role": "assistant", "content": "."}]}, "messages", where)
        turns, reasoning = turns[:-1], reasoning[:-1]
    elif fmt == "alpaca":
        filled = {**row, _column(cols, "output"): "."}
        turns, reasoning = to_turns(filled, fmt, where, cols)
        turns, reasoning = turns[:-1], reasoning[:-1]
    else:
        key = _column(cols, "messages" if fmt == "messages" else "conversations")
        items = row.get(key)
        if not isinstance(items, list) or not items:
            raise DataError(f"{where}: missing key {key!r}: the prompt's turns")
        # The answers come apart from the turns: a stand-in answer closes them so they read as SFT's do.
        role, text = ("role", "content") if fmt == "messages" else ("from", "value")
        closing = {_column(cols, role): "assistant", _column(cols, text): "."}
        turns, reasoning = to_turns({**row, key: [*items, closing]}, fmt, where, cols)
        turns, reasoning = turns[:-1], reasoning[:-1]
    if not turns or turns[-1][0] != "user":
        raise DataError(f"{where}: the prompt must end with the user's turn (the answers follow it)")
    return turns, reasoning


def to_preference(row: Any, fmt: str, where: str, columns: dict[str, str] | None = None) -> PreferenceRow:
    """One ``stage: dpo`` row; ``DataError`` naming ``where`` and the reason when it is not one."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [_column(columns, n) for n in PREFERENCE_COLUMNS if row.get(_column(columns, n)) is None]
    if missing:
        raise DataError(
            f"{where}: missing {' and '.join(repr(m) for m in missing)}: train.stage: dpo trains on a chosen and a "
            "rejected answer to each prompt",
            fix="give rows with chosen and rejected (docs/preference.md), or set train.stage: sft for SFT rows",
        )
    prompt, reasoning = _prompt_messages(row, where, fmt, columns)
    chosen = _answer(row[_column(columns, "chosen")], where, repr(_column(columns, "chosen")), fmt)
    rejected = _answer(row[_column(columns, "rejected")], where, repr(_column(columns, "rejected")), fmt)
    return PreferenceRow(prompt, reasoning, chosen, rejected)


def _label_column(row: dict[str, Any], fmt: str, cols: dict[str, str] | None) -> str:
    if fmt == "messages":
        return _column(cols, "label")
    named = _column(cols, "kto_tag")
    return named if named in row or "label" not in row else "label"


def to_kto(row: Any, fmt: str, where: str, columns: dict[str, str] | None = None) -> KtoRow:
    """One ``stage: kto`` row: the prompt, the answer (the conversation's last turn) and its label."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    column = _label_column(row, fmt, columns)
    label = row.get(column)
    if not isinstance(label, bool):
        got = "nothing" if label is None else repr(label)
        raise DataError(
            f"{where}: {column!r} must be true or false (is the answer desirable?), got {got}",
            fix="give each row a boolean label (docs/preference.md), or set data.columns.kto_tag to the column",
        )
    if fmt == "messages" and row.get(_column(columns, "completion")) is not None:
        prompt, reasoning = _prompt_messages(row, where, fmt, columns)
        return KtoRow(
            prompt, reasoning, _answer(row[_column(columns, "completion")], where, "'completion'", fmt), label
        )
    turns, reasoning = to_turns(row, fmt, where, columns)
    if turns[-1][0] != "assistant":
        raise DataError(f"{where}: a KTO row's conversation ends with the answer (an assistant turn)")
    prompt, prompt_reasoning = turns[:-1], reasoning[:-1]
    if not prompt or prompt[-1][0] != "user":
        raise DataError(f"{where}: the answer must follow the user's turn")
    return KtoRow(prompt, prompt_reasoning, Answer(turns[-1][1], reasoning[-1]), label)


def check_row(
    row: Any, fmt: str, where: str, columns: dict[str, str] | None, stage: str, options: RowOptions | None = None
) -> None:
    """The controller's check of one row for ``stage``: a ``DataError`` (``StageMismatch``) when it is not one."""
    if stage == "dpo":
        to_preference(row, fmt, where, columns)
    elif stage == "kto":
        to_kto(row, fmt, where, columns)
    else:
        refuse_other_stage(row, where, columns, stage)
        # The source's tags and per-turn train key too (datarows.RowOptions), as the node's builder reads it.
        read_row(row, fmt, where, options or RowOptions(columns=columns))
