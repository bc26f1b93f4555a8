"""``[rankN]:`` before every line a rank prints through Python, so a watcher can tell the ranks apart.

torchrun hands its workers the node's stdout and stderr as they are: the ranks
of one node print into one stream, and the same warning from 8 ranks is 8
identical lines nobody can attribute. With this prefix (torchrun's own
``--tee`` format) ``dzctl launch --follow`` shows each distinct message once
with the ranks it came from. Only Python-level writes are prefixed (print,
warnings, logging, tracebacks); output from C code (NCCL) keeps the node only.
"""

from __future__ import annotations

import io
import os
import sys
from typing import TextIO


class RankPrefixed(io.TextIOBase):
    """A text stream that writes ``prefix`` at the start of each line to the wrapped stream."""

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self._stream = stream
        self._prefix = prefix
        self._at_line_start = True

    def write(self, text: str) -> int:
        if not text:
            return 0
        lines = text.split("\n")
        out = []
        for i, part in enumerate(lines):
            last = i == len(lines) - 1
            if part and self._at_line_start:
                out.append(self._prefix)
            out.append(part)
            if not last:
                out.append("\n")
                self._at_line_start = True
            elif part:
                self._at_line_start = False
        self._stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._stream.encoding

    def __getattr__(self, name: str):
        # Anything else a library asks of sys.stdout (buffer, errors, reconfigure...): the real stream's.
        return getattr(self._stream, name)


def prefix_rank_output(env=None) -> None:
    """Wrap stdout and stderr when a launcher started several ranks (a lone rank needs no label)."""
    env = os.environ if env is None else env
    if int(env.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in env:
        return
    prefix = f"[rank{env['RANK']}]:"
    if not isinstance(sys.stdout, RankPrefixed):
        sys.stdout = RankPrefixed(sys.stdout, prefix)
    if not isinstance(sys.stderr, RankPrefixed):
        sys.stderr = RankPrefixed(sys.stderr, prefix)
