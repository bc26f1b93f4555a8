"""The rows of a ``.json`` array or ``.jsonl`` file, read as a stream (pure: it reads the file only).

A 1 M-row SFT file is about 0.7 GB of JSON; ``json.loads`` of all of it holds several
GB of Python objects at once. Here a row is decoded, handed on and dropped: memory
stays at one read chunk plus the row being decoded, whatever the file's size.

Each row comes with ``where`` (``FILE:row N``, ``FILE`` being the name the user knows it
by), so an error about it names the user's own file and row:

- ``.jsonl`` (or any file not starting with ``[``): ``N`` is the line; a line that is not
  JSON is yielded as ``Malformed`` so that ``data.on_error: skip`` can pass over it;
- a JSON array: ``N`` counts the array's items from 1; a syntax error stops the file
  (after it, nothing can be read) and names its line.

A file of a table format (``.csv``, ``.tsv``, Excel) is refused by its name, saying which
formats are read, before a byte of it is parsed as JSON (it would fail as "not valid JSON",
and the old fix, to change ``data.format``, cannot help: that names a row layout, not a file's).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .datarows import DataError

CHUNK = 1 << 22  # 4 MiB of text per read
MAX_ROW = 1 << 26  # 64 MiB: no SFT row is near it
_DECODER = json.JSONDecoder()
_SPACE = " \t\r\n"
# Files people export data to that are not JSON: named, with the ways in that exist.
TABLE_FORMATS = {".csv": "CSV", ".tsv": "TSV", ".xlsx": "Excel", ".xls": "Excel"}
READ_FORMATS = (
    "a JSON array (.json), JSON lines (.jsonl), Parquet (.parquet), a datasets.save_to_disk folder, or hf:ORG/NAME"
)


@dataclass(frozen=True)
class Malformed:
    """A row that is not JSON (JSON lines only): its reason, raised or skipped by the caller."""

    reason: str


def iter_rows(path: Path, display: str | None = None, position: list[int] | None = None) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for every row of ``path``; ``display`` names the file in messages.

    ``position``, when given, holds the bytes read so far in its one item (for an ETA)."""
    shown = display or str(path)
    table = TABLE_FORMATS.get(path.suffix.lower())
    if table:
        raise DataError(
            f"{shown}: a {table} file: {table} is not a data format dzctl reads; it reads {READ_FORMATS}",
            fix=f"convert it to JSON lines (pandas: read_{'excel' if table == 'Excel' else 'csv'}(...)"
            ".to_json('data.jsonl', orient='records', lines=True, force_ascii=False)) and point data.path at it",
        )
    try:
        # A 1 MiB buffer, not the default 8 KB: a thread reading line by line through 8 KB reads gives the GIL back
        # and takes it again at every read, and a waiting thread (the data lock's heartbeat) did not run for
        # seconds while a 1.2 M-row file was counted (CPython's convoy effect); with 1 MiB it ticked on time.
        handle = path.open("rb", buffering=1 << 20)
    except FileNotFoundError:
        raise DataError(f"{shown}: data file not found", fix="check data.path") from None
    with handle:
        head = handle.read(64)
        handle.seek(0)
        start = head.removeprefix(codecs.BOM_UTF8).lstrip()
        if path.suffix == ".json" or start.startswith(b"["):
            yield from _array_rows(handle, shown, position)
        else:
            yield from _line_rows(handle, shown, position)


def peek_rows(path: Path, count: int, display: str | None = None) -> list[tuple[str, Any]]:
    """The first ``count`` rows (what ``dzctl launch`` checks before touching a host)."""
    rows = []
    for item in iter_rows(path, display):
        rows.append(item)
        if len(rows) >= count:
            break
    return rows


def _not_utf8(shown: str, line: int, offset: int) -> DataError:
    return DataError(f"{shown}:row {line}: not UTF-8 (byte {offset})", fix="re-save the file as UTF-8")


def _line_rows(handle, shown: str, position: list[int] | None) -> Iterator[tuple[str, Any]]:
    offset = 0
    for number, raw in enumerate(handle, start=1):
        if position is not None:
            position[0] = offset
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _not_utf8(shown, number, offset + exc.start) from None
        offset += len(raw)
        if number == 1:
            line = line.removeprefix("\ufeff")  # a BOM from Windows editors is not data
        if not line.strip():
            continue
        where = f"{shown}:row {number}"
        # Without its line ending: a row cut short would otherwise fail at the newline, "column 1" of a next line.
        text = line.rstrip("\r\n")
        try:
            yield where, json.loads(text)
        except json.JSONDecodeError as exc:
            cut = ": the row ends there, cut short?" if exc.pos >= len(text.rstrip()) else ""
            yield where, Malformed(f"not valid JSON: {exc.msg} (column {exc.colno}{cut})")


class _Text:
    """The file as decoded text, read on demand; ``line_at`` numbers lines for messages."""

    def __init__(self, handle, shown: str) -> None:
        self.handle, self.shown = handle, shown
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf = ""
        self.pos = 0
        self.lines_before = 0  # newlines in the text already dropped from buf
        self.bytes_read = 0
        self.eof = False
        self.first = True

    def more(self) -> bool:
        if self.eof:
            return False
        raw = self.handle.read(CHUNK)
        try:
            text = self.decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as exc:
            line = self.lines_before + self.buf.count("\n") + raw[: exc.start].count(b"\n") + 1
            raise _not_utf8(self.shown, line, self.bytes_read + exc.start) from None
        self.bytes_read += len(raw)
        if self.first:
            text, self.first = text.removeprefix("\ufeff"), False
        if not raw:
            self.eof = True
        if self.pos > CHUNK:  # drop what is consumed, keeping line numbers right
            self.lines_before += self.buf.count("\n", 0, self.pos)
            self.buf, self.pos = self.buf[self.pos :], 0
        self.buf += text
        return True

    def skip_space(self) -> str:
        """The next non-space character ('' at the end of the file), not consumed."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _SPACE:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def line_at(self, pos: int) -> int:
        return self.lines_before + self.buf.count("\n", 0, pos) + 1

    def invalid(self, msg: str, pos: int | None = None) -> DataError:
        return DataError(f"{self.shown}:line {self.line_at(self.pos if pos is None else pos)}: not valid JSON: {msg}")


def _array_rows(handle, shown: str, position: list[int] | None) -> Iterator[tuple[str, Any]]:
    text = _Text(handle, shown)
    first = text.skip_space()
    if first != "[":
        kind = {"{": "dict", '"': "str"}.get(first, "value" if first else "empty file")
        raise DataError(f"{shown}: expected a JSON array of rows, got a {kind}")
    text.pos += 1
    number = 0
    while True:
        char = text.skip_space()
        if char == "]" and number == 0:
            text.pos += 1
            break
        if not char:
            raise text.invalid("the array is not closed (the file ends early)")
        while True:
            try:
                row, end = _DECODER.raw_decode(text.buf, text.pos)
                # A number or literal cut by the chunk's end decodes as a shorter one: read on.
                if end == len(text.buf) and not text.eof and text.more():
                    continue
                break
            except json.JSONDecodeError as exc:
                # Cut by the chunk's end, or broken? Read on, but not past MAX_ROW of one row:
                # a broken file must not be read whole into memory to find out.
                if len(text.buf) - text.pos < MAX_ROW and text.more():
                    continue
                raise text.invalid(exc.msg, exc.pos) from None
        text.pos = end
        number += 1
        if position is not None:
            position[0] = text.bytes_read
        yield f"{shown}:row {number}", row
        sep = text.skip_space()
        text.pos += 1
        if sep == "]":
            break
        if sep != ",":
            raise text.invalid("expected ',' or ']' after a row", text.pos - 1)
    if text.skip_space():
        raise text.invalid("extra data after the array")
