"""A data row in one of the formats ``data.format`` names → the conversation it holds (pure).

Used twice: by ``dzctl launch`` on the first rows of a local file (``planning/inputs.py``),
so a format mismatch is refused before any host is touched, and by the data builder on
the nodes for every row (``orchestrator/train/data/``). A conversation is a tuple of
``(role, content)`` with roles ``system``, ``user`` and ``assistant``.

Formats:

- ``alpaca``: ``instruction``, optional ``input`` (appended after a blank line), ``output``;
  optional ``system`` (a system turn first) and ``history`` (earlier turns, a list of
  ``[instruction, response]`` pairs, as LLaMA-Factory's alpaca format has them).
- ``messages``: ``messages``, a list of ``{"role": system|user|assistant, "content": text}``
  (OpenAI style).
- ``sharegpt``: ``conversations``, a list of ``{"from": human|gpt|system, "value": text}``
  (``user``/``assistant`` are taken too), optional top-level ``system``.

An assistant turn of ``messages`` or ``sharegpt`` may carry ``reasoning_content`` (its reasoning,
as OpenAI-style APIs and Qwen3's template name it); ``to_turns`` returns it beside the turns,
``to_messages`` leaves it out. ``columns`` renames the fields: ``{instruction: prompt, output: completion}`` reads the
instruction from the row's ``prompt``. Every format needs at least one assistant turn
with text: a row with nothing to learn from is an error, not silently kept. Every text must be
encodable as UTF-8: JSON may hold a lone UTF-16 surrogate (``"\\ud800"`` without its pair), which
Python reads into a ``str`` but no tokenizer takes (the Rust ones raise a ``TypeError`` naming no
row), so such a row is a bad row here, named, and skipped under ``data.on_error: skip``.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}

Messages = tuple[tuple[str, str], ...]
Reasoning = tuple[str | None, ...]  # per turn of a Messages: the assistant turn's reasoning_content, else None


class DataError(InputError):
    """A data row is malformed; the message starts with ``file:row N:``."""


def guess_format(row: Any) -> str | None:
    """The format a row looks like, for the hint in a mismatch error."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("conversations"), list):
        return "sharegpt"
    if "messages" in row:
        return "messages"
    if "instruction" in row:
        return "alpaca"
    return None


def _mismatch_hint(row: dict[str, Any], fmt: str) -> str:
    guessed = guess_format(row)
    if guessed is None or guessed == fmt:
        return ""
    key = {"sharegpt": "conversations", "messages": "messages", "alpaca": "instruction"}[guessed]
    return f"; the row has {key!r}: set data.format: {guessed}"


def to_messages(row: Any, fmt: str, where: str, columns: dict[str, str] | None = None) -> Messages:
    """The conversation of one row; ``DataError`` naming ``where`` and the reason when it has none."""
    return to_turns(row, fmt, where, columns)[0]


def to_turns(row: Any, fmt: str, where: str, columns: dict[str, str] | None = None) -> tuple[Messages, Reasoning]:
    """The conversation of one row and each turn's ``reasoning_content`` (None where it has none)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    cols = columns or {}
    if fmt == "alpaca":
        turns = _alpaca(row, where, cols)
        return turns, (None,) * len(turns)
    if fmt == "messages":
        return _chat(row, where, cols)
    if fmt == "sharegpt":
        return _sharegpt(row, where, cols)
    raise DataError(f"{where}: unknown data.format {fmt!r}")


SURROGATE_FIX = "fix the row (a \\udXXX escape needs its pair), or set data.on_error: skip to leave such rows out"


def _encodable(value: str, where: str, shown: str) -> str:
    """``value``, if UTF-8 can encode it; else the row's error, naming the surrogate and where it is."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{where}: {shown} holds a lone UTF-16 surrogate \\u{ord(value[exc.start]):04x} at character "
            f"{exc.start + 1}: not text a tokenizer can read",
            fix=SURROGATE_FIX,
        ) from None
    return value


def _column(cols: dict[str, str], name: str) -> str:
    return cols.get(name, name)


def _shown(cols: dict[str, str], name: str) -> str:
    column = _column(cols, name)
    return repr(column) if column == name else f"{column!r} (data.columns: {name})"


def _text(row: dict[str, Any], name: str, where: str, cols: dict[str, str], *, required: bool, fmt: str) -> str:
    value = row.get(_column(cols, name))
    if value is None:
        if required:
            raise DataError(f"{where}: missing key {_shown(cols, name)}{_mismatch_hint(row, fmt)}")
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: {_shown(cols, name)} must be text, got {type(value).__name__}")
    return _encodable(value, where, _shown(cols, name))


def _alpaca(row: dict[str, Any], where: str, cols: dict[str, str]) -> Messages:
    instruction = _text(row, "instruction", where, cols, required=True, fmt="alpaca")
    extra = _text(row, "input", where, cols, required=False, fmt="alpaca")
    output = _text(row, "output", where, cols, required=True, fmt="alpaca")
    system = _text(row, "system", where, cols, required=False, fmt="alpaca")
    if not instruction.strip():
        raise DataError(f"{where}: {_shown(cols, 'instruction')} is empty")
    if not output.strip():
        raise DataError(f"{where}: {_shown(cols, 'output')} is empty: nothing to learn from this row")
    turns: list[tuple[str, str]] = [("system", system)] if system.strip() else []
    history = row.get(_column(cols, "history"))
    if history is not None:
        if not isinstance(history, list):
            raise DataError(f"{where}: {_shown(cols, 'history')} must be a list of [instruction, response] pairs")
        for index, pair in enumerate(history):
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)):
                raise DataError(f"{where}: {_shown(cols, 'history')}[{index}]: expected [instruction, response] texts")
            for text in pair:
                _encodable(text, where, f"{_shown(cols, 'history')}[{index}]")
            turns += [("user", pair[0]), ("assistant", pair[1])]
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return (*turns, ("user", user), ("assistant", output))


def _turns(
    row: dict[str, Any], where: str, cols: dict[str, str], fmt: str, list_key: str, role_key: str, text_key: str
) -> tuple[list[tuple[str, str]], list[str | None]]:
    items = row.get(_column(cols, list_key))
    if items is None:
        raise DataError(f"{where}: missing key {_shown(cols, list_key)}{_mismatch_hint(row, fmt)}")
    if not isinstance(items, list) or not items:
        raise DataError(f"{where}: {_shown(cols, list_key)} must be a non-empty list")
    role_col, text_col = _column(cols, role_key), _column(cols, text_key)
    reasoning_col = _column(cols, "reasoning_content")
    known = ROLES if fmt == "messages" else tuple(SHAREGPT_ROLES)
    out = []
    reasoning: list[str | None] = []
    for index, item in enumerate(items):
        at = f"{where}: {_column(cols, list_key)}[{index}]"
        if not isinstance(item, dict):
            raise DataError(f"{at}: expected an object with {role_col} and {text_col}")
        role, content = item.get(role_col), item.get(text_col)
        if role not in known:
            raise DataError(f"{at}: {role_col} must be one of {', '.join(known)}, got {role!r}")
        if not isinstance(content, str):
            raise DataError(f"{at}: {text_col} must be text, got {type(content).__name__}")
        _encodable(content, at, text_col)
        role = role if fmt == "messages" else SHAREGPT_ROLES[role]
        thought = item.get(reasoning_col)
        if thought is not None and not isinstance(thought, str):
            raise DataError(f"{at}: {reasoning_col} must be text, got {type(thought).__name__}")
        if thought is not None:
            _encodable(thought, at, reasoning_col)
        if thought is not None and role != "assistant":
            raise DataError(f"{at}: {reasoning_col} belongs to assistant turns, this one is {role!r}")
        out.append((role, content))
        reasoning.append(thought)
    return out, reasoning


def _chat(row: dict[str, Any], where: str, cols: dict[str, str]) -> tuple[Messages, Reasoning]:
    out, reasoning = _turns(row, where, cols, "messages", "messages", "role", "content")
    return _with_an_answer(out, where), tuple(reasoning)


def _sharegpt(row: dict[str, Any], where: str, cols: dict[str, str]) -> tuple[Messages, Reasoning]:
    out, reasoning = _turns(row, where, cols, "sharegpt", "conversations", "from", "value")
    system = _text(row, "system", where, cols, required=False, fmt="sharegpt")
    if system.strip() and not (out and out[0][0] == "system"):
        out.insert(0, ("system", system))
        reasoning.insert(0, None)
    return _with_an_answer(out, where), tuple(reasoning)


def _with_an_answer(turns: list[tuple[str, str]], where: str) -> Messages:
    if not any(role == "assistant" and content.strip() for role, content in turns):
        raise DataError(f"{where}: no assistant turn with text: nothing to learn from this row")
    return tuple(turns)
