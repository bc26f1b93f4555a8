"""Python tracebacks in a node's output, folded to the one line that says what was raised (pure).

A traceback is evidence for ``dzctl logs``; in the view it is thirty lines that push the
failure's own words off the screen, once per rank. ``TracebackFolder`` follows each
stream of a node's output (the node's own lines, and each rank's ``[rankN]:`` lines,
which interleave) and says of each line whether it is part of a traceback, or its
final ``ExceptionType: message`` line.

torchrun's own traceback, when a rank fails, ends in ``ChildFailedError`` and a summary
boxed in ``=`` lines (which failed rank, its exit code, and a link): all of it repeats the
rank's failure, which the rank reported itself, so the whole block folds to nothing, and
so do the two log lines torchrun writes just before it (stopping the other local ranks,
and which one failed with which exit code).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TRACEBACK = "Traceback (most recent call last):"
CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
CHILD_FAILED = "ChildFailedError"
_STREAM_PREFIX = re.compile(r"^\[(?:rank)?(\d+)\]:")
_BORDER = re.compile(r"^=+$")
# torchrun's log lines (glog style: level, date, time, pid, file:line]) as it ends a failed node's ranks.
_LAUNCHER_NARRATION = re.compile(
    r"^[EWI]\d{4} [\d:.]+ +\d+ \S*torch/distributed/elastic/multiprocessing/api\.py:\d+\] "
    r"(failed \(exitcode: -?\d+\) local_rank: \d+|Sending process \d+ closing signal SIG\w+$)"
)
SUMMARY_BORDERS = 2  # torchrun's summary opens and closes with a line of '='

PASS, NOISE, EXCEPTION, RETRACT = "pass", "noise", "exception", "retract"


@dataclass
class TracebackFolder:
    """Per stream: outside a traceback, inside one, or inside torchrun's failure summary."""

    _state: dict[tuple[int, str], str] = field(default_factory=dict)
    _borders: dict[tuple[int, str], int] = field(default_factory=dict)
    _last_exception: dict[tuple[int, str], str] = field(default_factory=dict)

    def take(self, node_rank: int, line: str) -> tuple[str, str | None]:
        """(PASS, None): not a traceback's; (NOISE, None): a traceback's body; (EXCEPTION, text): its last line;
        (RETRACT, text): that last line was only the cause of the exception whose traceback follows."""
        match = _STREAM_PREFIX.match(line)
        # torchrun's summary lists failures as "[0]:" too: inside it, every line is the launcher's.
        key = (node_rank, "")
        if self._state.get(key) != "summary" and match:
            key = (node_rank, match.group(0))
            line = line[match.end() :]
        text = line.strip()
        state = self._state.get(key)
        if state == "summary":
            if _BORDER.match(text):
                self._borders[key] = self._borders.get(key, 0) + 1
                if self._borders[key] >= SUMMARY_BORDERS:
                    self._state.pop(key)
            return NOISE, None
        if text.startswith(TRACEBACK):
            self._state[key] = "traceback"
            return NOISE, None
        if _LAUNCHER_NARRATION.match(text):
            return NOISE, None
        if state is None:
            if text in CHAINED:
                cause = self._last_exception.pop(key, None)
                return (RETRACT, cause) if cause else (NOISE, None)
            if text:
                self._last_exception.pop(key, None)
            return PASS, None
        # Inside a traceback: its frames and source lines are indented (so are the ^^^ markers).
        if not text or line[:1] in (" ", "\t"):
            return NOISE, None
        if CHILD_FAILED in text:
            self._state[key], self._borders[key] = "summary", 0
            return NOISE, None
        self._state.pop(key)
        self._last_exception[key] = text
        return EXCEPTION, text
