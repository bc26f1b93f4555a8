"""A data row in one of the formats ``data.format`` names → the conversation it holds (pure).

Used twice: by ``dzctl launch`` on the first rows of a local file (``planning/inputs.py``),
so a format mismatch is refused before any host is touched, and by the data builder on
the nodes for every row (``orchestrator/train/data/``). A conversation is a tuple of
``(role, content)`` with roles ``system``, ``user``, ``assistant`` and ``tool`` (a tool's result).

Formats (docs/data.md has them with examples):

- ``alpaca``: ``instruction``, optional ``input`` (appended after one newline, as LLaMA-Factory
  joins them), ``output``; optional ``system`` (a system turn first) and ``history`` (earlier turns,
  a list of ``[instruction, response]`` pairs, as LLaMA-Factory's alpaca format has them).
- ``messages``: ``messages``, a list of ``{"role": system|user|assistant|tool, "content": text}``
  (OpenAI style); an assistant turn may hold ``tool_calls`` (its content then may be empty), the
  row a ``tools`` list (a JSON string or a list).
- ``sharegpt``: ``conversations``, a list of ``{"from": human|gpt|system|function_call|observation,
  "value": text}`` (``user``/``assistant`` are taken too), optional top-level ``system`` and ``tools``;
  ``data.tags`` renames the keys and the roles as LLaMA-Factory's ``tags`` do. A ``function_call``
  turn is the assistant's tool call (its value: ``{"name": ..., "arguments": ...}`` as JSON, or a
  list of them); an ``observation`` turn is the tool's result.
- ``text``: ``text``, a document trained whole (continued pretraining).

Content may be a list of parts (``[{"type": "text", "text": ...}]``): the text parts are read,
joined; an image, audio or video part, or a non-empty ``images``/``videos``/``audios`` column, is
refused, naming it: dzctl trains text models. A turn's ``train`` key (or ``message_field_training``'s)
says whether that turn is trained (axolotl's per-turn flag).

An assistant turn of ``messages`` or ``sharegpt`` may carry ``reasoning_content`` (its reasoning,
as OpenAI-style APIs and Qwen3's template name it); ``to_turns`` returns it beside the turns,
``to_messages`` leaves it out. ``columns`` renames the fields: ``{instruction: prompt, output: completion}`` reads the
instruction from the row's ``prompt``. Every format needs at least one assistant turn
with text or a tool call: a row with nothing to learn from is an error, not silently kept. Every
text must be encodable as UTF-8: JSON may hold a lone UTF-16 surrogate (``"\\ud800"`` without its
pair), which Python reads into a ``str`` but no tokenizer takes (the Rust ones raise a ``TypeError``
naming no row), so such a row is a bad row here, named, and skipped under ``data.on_error: skip``.

``read_columns`` says which of a row's columns a format reads: the builder names the others in
the data summary ("ignored: images, label"), never dropping one silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# LLaMA-Factory's sharegpt tags and their defaults (data.tags renames them).
TAG_DEFAULTS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
# Columns of media a text model cannot take: refused when they hold anything.
MEDIA_COLUMNS = ("images", "videos", "audios", "image", "video", "audio")
MEDIA_PARTS = ("image", "image_url", "input_image", "audio", "input_audio", "video", "video_url", "file")
TEXT_MODELS = "dzctl trains text models (no image, audio or video input)"

Messages = tuple[tuple[str, str], ...]
Reasoning = tuple[str | None, ...]  # per turn of a Messages: the assistant turn's reasoning_content, else None
ToolCalls = tuple[tuple[dict[str, Any], ...] | None, ...]  # per turn: an assistant turn's tool calls, else None


class DataError(InputError):
    """A data row is malformed; the message starts with ``file:row N:``."""


@dataclass(frozen=True)
class Row:
    """One row read: its turns (empty for ``text``), and what each turn carries beside its text."""

    messages: Messages
    reasoning: Reasoning
    tool_calls: ToolCalls = ()
    tools: tuple[dict[str, Any], ...] | None = None  # the row's tool list, for the template's system turn
    trained: tuple[bool | None, ...] = ()  # per turn: the row's own train flag (None: decided by role)
    text: str | None = None  # format text: the document


@dataclass(frozen=True)
class RowOptions:
    """How a source's rows read beyond their format: renamed fields, sharegpt's tags, the per-turn train key."""

    columns: dict[str, str] | None = None
    tags: dict[str, str] | None = None
    train_field: str | None = None  # None: "train" where a turn has it

    @classmethod
    def of(cls, source: Any) -> RowOptions:
        """From a ``DataSource`` (format filled in): its columns, tags and message_field_training."""
        tags = getattr(source, "tags", None)
        return cls(
            columns=getattr(source, "columns", None),
            tags=tags.model_dump() if tags is not None and hasattr(tags, "model_dump") else tags,
            train_field=getattr(source, "message_field_training", None),
        )


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
    if isinstance(row.get("text"), str):
        return "text"
    return None


FORMAT_KEYS = {"sharegpt": "conversations", "messages": "messages", "alpaca": "instruction", "text": "text"}


def _mismatch_hint(row: dict[str, Any], fmt: str) -> str:
    guessed = guess_format(row)
    if guessed == fmt:
        return ""
    if guessed is None:
        keys = ", ".join(repr(k) for k in list(row)[:8]) or "no keys"
        return (
            f"; the row's layout ({keys}) is none of dzctl's formats (alpaca: instruction/output, messages: "
            "messages, sharegpt: conversations, text: text): map its keys with data.columns "
            "(alpaca: {instruction: KEY, output: KEY})"
        )
    what = " (continued pretraining: every token trained)" if guessed == "text" else ""
    return f"; the row has {FORMAT_KEYS[guessed]!r}: set data.format: {guessed}{what}"


def to_messages(row: Any, fmt: str, where: str, columns: dict[str, str] | None = None) -> Messages:
    """The conversation of one row; ``DataError`` naming ``where`` and the reason when it has none."""
    return to_turns(row, fmt, where, columns)[0]


def to_turns(row: Any, fmt: str, where: str, columns: dict[str, str] | None = None) -> tuple[Messages, Reasoning]:
    """The conversation of one row and each turn's ``reasoning_content`` (None where it has none)."""
    read = read_row(row, fmt, where, RowOptions(columns=columns))
    return read.messages, read.reasoning


def read_row(row: Any, fmt: str, where: str, options: RowOptions | None = None) -> Row:
    """One row in format ``fmt`` as a ``Row``; ``DataError`` naming ``where`` and the fix when it is not one."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    options = options or RowOptions()
    cols = options.columns or {}
    _no_media(row, where)
    if fmt == "alpaca":
        turns = _alpaca(row, where, cols)
        return Row(turns, (None,) * len(turns))
    if fmt == "messages":
        return _chat(row, where, cols, options)
    if fmt == "sharegpt":
        return _sharegpt(row, where, cols, options)
    if fmt == "text":
        return Row((), (), text=_document(row, where, cols))
    raise DataError(f"{where}: unknown data.format {fmt!r}")


def read_columns(fmt: str, options: RowOptions | None = None) -> frozenset[str]:
    """The top-level columns a row of ``fmt`` is read from (the others are named as ignored)."""
    from ..spec.job import FORMAT_FIELDS

    cols = (options.columns if options else None) or {}
    # Per-turn keys (role, content, from, value) are not columns of the row.
    per_turn = {"role", "content", "from", "value", "reasoning_content"}
    return frozenset(cols.get(name, name) for name in FORMAT_FIELDS[fmt] if name not in per_turn)


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


def _no_media(row: dict[str, Any], where: str) -> None:
    for column in MEDIA_COLUMNS:
        if row.get(column):
            raise DataError(
                f"{where}: column {column!r} holds {column.rstrip('s')} input: {TEXT_MODELS}",
                fix=f"remove the {column!r} column (and its placeholders in the text), or train this data with a "
                "multimodal trainer",
            )


def _content_text(value: Any, where: str, shown: str) -> str:
    """A turn's content: text, or a list of parts whose text parts are joined; media parts refused."""
    if isinstance(value, str):
        return _encodable(value, where, shown)
    if isinstance(value, list):
        texts = []
        for index, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                raise DataError(
                    f"{where}: {shown}[{index}] is a {kind!r} part: {TEXT_MODELS}",
                    fix="remove the non-text parts (or the rows with them), or use a multimodal trainer",
                )
            if kind != "text" or not isinstance(part.get("text"), str):
                raise DataError(
                    f'{where}: {shown}[{index}]: a content part is {{"type": "text", "text": ...}}, got '
                    f"{json.dumps(part, ensure_ascii=False)[:80]}"
                )
            texts.append(_encodable(part["text"], where, f"{shown}[{index}]"))
        return "".join(texts)
    raise DataError(f"{where}: {shown} must be text, got {type(value).__name__} (a list of text parts is read too)")


def _text(row: dict[str, Any], name: str, where: str, cols: dict[str, str], *, required: bool, fmt: str) -> str:
    value = row.get(_column(cols, name))
    if value is None:
        if required:
            raise DataError(f"{where}: missing key {_shown(cols, name)}{_mismatch_hint(row, fmt)}")
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: {_shown(cols, name)} must be text, got {type(value).__name__}")
    return _encodable(value, where, _shown(cols, name))


def _document(row: dict[str, Any], where: str, cols: dict[str, str]) -> str:
    text = _text(row, "text", where, cols, required=True, fmt="text")
    if not text.strip():
        raise DataError(f"{where}: {_shown(cols, 'text')} is empty: nothing to learn from this row")
    return text


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
    # One newline, as LLaMA-Factory joins them (its alpaca converter: "\n".join([prompt, query])).
    user = f"{instruction}\n{extra}" if extra.strip() else instruction
    return (*turns, ("user", user), ("assistant", output))


def _tools(row: dict[str, Any], where: str, cols: dict[str, str]) -> tuple[dict[str, Any], ...] | None:
    """The row's tool list (a list, or JSON text of one), each in OpenAI's ``{type: function, function}`` form."""
    value = row.get(_column(cols, "tools"))
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: {_shown(cols, 'tools')} is text but not JSON: {exc.msg}") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"{where}: {_shown(cols, 'tools')} must be a list of tool definitions (objects)")
    # LLaMA-Factory writes the bare function ({name, description, parameters}); templates read OpenAI's form.
    return tuple(t if "function" in t else {"type": "function", "function": t} for t in value) or None


def _one_call(call: Any, where: str) -> dict[str, Any]:
    if isinstance(call, dict) and isinstance(call.get("function"), dict):
        call = call["function"]
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]):
        raise DataError(f'{where}: a tool call is {{"name": ..., "arguments": ...}}, got {str(call)[:80]}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:  # JSON text of the arguments: as an object, so every template renders it its own way
            parsed = json.loads(arguments)
            arguments = parsed if isinstance(parsed, dict) else arguments
        except json.JSONDecodeError:
            pass
    return {"type": "function", "function": {"name": call["name"], "arguments": arguments}}


def _calls(value: Any, where: str) -> tuple[dict[str, Any], ...]:
    """Tool calls as given: a list of calls, one call, or JSON text of either (sharegpt's function_call value)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            shape = '{"name": ..., "arguments": ...}'
            raise DataError(f"{where}: a tool call must be JSON ({shape}): {exc.msg}") from None
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise DataError(f"{where}: an empty list of tool calls")
    return tuple(_one_call(call, where) for call in calls)


def _train_flag(item: dict[str, Any], at: str, options: RowOptions) -> bool | None:
    key = options.train_field or "train"
    value = item.get(key)
    if value is not None and not isinstance(value, bool):
        raise DataError(f"{at}: {key} (the turn's train flag) must be true or false, got {value!r}")
    return value


@dataclass
class _Turns:
    messages: list[tuple[str, str]]
    reasoning: list[str | None]
    calls: list[tuple[dict[str, Any], ...] | None]
    trained: list[bool | None]

    def add(self, role: str, content: str, thought=None, calls=None, trained=None) -> None:
        self.messages.append((role, content))
        self.reasoning.append(thought)
        self.calls.append(calls)
        self.trained.append(trained)


def _turns(
    row: dict[str, Any], where: str, cols: dict[str, str], fmt: str, options: RowOptions
) -> tuple[_Turns, set[str]]:
    """The turns of a messages / sharegpt row, and the per-turn keys read (for the error on an unknown role)."""
    if fmt == "messages":
        list_key, role_key, text_key = "messages", _column(cols, "role"), _column(cols, "content")
        roles = {role: role for role in ROLES}
        calls_role = None
    else:
        tags = {**TAG_DEFAULTS, **(options.tags or {})}
        list_key = "conversations"
        role_key = tags["role_tag"] if options.tags else _column(cols, "from")
        text_key = tags["content_tag"] if options.tags else _column(cols, "value")
        roles = {
            tags["user_tag"]: "user",
            tags["assistant_tag"]: "assistant",
            tags["system_tag"]: "system",
            tags["observation_tag"]: "tool",
        }
        if not options.tags:
            roles = {**SHAREGPT_ROLES, **roles}
        calls_role = tags["function_tag"]
    items = row.get(_column(cols, list_key))
    if items is None:
        raise DataError(f"{where}: missing key {_shown(cols, list_key)}{_mismatch_hint(row, fmt)}")
    if not isinstance(items, list) or not items:
        raise DataError(f"{where}: {_shown(cols, list_key)} must be a non-empty list")
    reasoning_col = _column(cols, "reasoning_content")
    known = tuple(roles) + ((calls_role,) if calls_role else ())
    out = _Turns([], [], [], [])
    for index, item in enumerate(items):
        at = f"{where}: {_column(cols, list_key)}[{index}]"
        if not isinstance(item, dict):
            raise DataError(f"{at}: expected an object with {role_key} and {text_key}")
        given = item.get(role_key)
        if given not in known:
            raise DataError(f"{at}: {role_key} must be one of {', '.join(known)}, got {given!r}")
        trained = _train_flag(item, at, options)
        if given == calls_role:  # sharegpt's function_call: the assistant's tool call, its value the call(s)
            out.add("assistant", "", None, _calls(item.get(text_key), at), trained)
            continue
        role = roles[given]
        calls = None
        content = item.get(text_key)
        if role == "assistant" and item.get("tool_calls"):
            calls = _calls(item["tool_calls"], at)
            content = "" if content is None else content
        content = _content_text(content, at, text_key)
        thought = item.get(reasoning_col)
        if thought is not None and not isinstance(thought, str):
            raise DataError(f"{at}: {reasoning_col} must be text, got {type(thought).__name__}")
        if thought is not None:
            _encodable(thought, at, reasoning_col)
        if thought is not None and role != "assistant":
            raise DataError(f"{at}: {reasoning_col} belongs to assistant turns, this one is {role!r}")
        out.add(role, content, thought, calls, trained)
    return out, set()


def _chat(row: dict[str, Any], where: str, cols: dict[str, str], options: RowOptions) -> Row:
    turns, _ = _turns(row, where, cols, "messages", options)
    return _row(turns, _tools(row, where, cols), where)


def _sharegpt(row: dict[str, Any], where: str, cols: dict[str, str], options: RowOptions) -> Row:
    turns, _ = _turns(row, where, cols, "sharegpt", options)
    system = _text(row, "system", where, cols, required=False, fmt="sharegpt")
    if system.strip() and not (turns.messages and turns.messages[0][0] == "system"):
        turns.messages.insert(0, ("system", system))
        turns.reasoning.insert(0, None)
        turns.calls.insert(0, None)
        turns.trained.insert(0, None)
    return _row(turns, _tools(row, where, cols), where)


def _row(turns: _Turns, tools: tuple[dict[str, Any], ...] | None, where: str) -> Row:
    answered = any(
        role == "assistant" and (content.strip() or calls)
        for (role, content), calls in zip(turns.messages, turns.calls, strict=True)
    )
    if not answered:
        raise DataError(f"{where}: no assistant turn with text or a tool call: nothing to learn from this row")
    calls = tuple(turns.calls) if any(turns.calls) else ()
    trained = tuple(turns.trained) if any(flag is not None for flag in turns.trained) else ()
    return Row(tuple(turns.messages), tuple(turns.reasoning), calls, tools, trained)
