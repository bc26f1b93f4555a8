"""Say that a long step is still going: a spinner on a terminal, one line elsewhere, only past a few seconds.

Short steps stay silent (most preflights and uploads take under a second on a
few nodes); one that takes longer (many nodes, a slow link) shows what it waits
for and for how long, on stderr, so ``--json`` stdout stays one object.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator

SHOW_AFTER_S = 2.0


@contextlib.contextmanager
def busy(what: str, *, after_s: float = SHOW_AFTER_S, stream=None) -> Iterator[None]:
    stream = stream or sys.stderr
    done = threading.Event()
    started = time.monotonic()

    def show() -> None:
        if done.wait(after_s):
            return
        if not stream.isatty():
            stream.write(f"{what} (still going after {after_s:g} s)\n")
            stream.flush()
            return
        from rich.console import Console

        console = Console(file=stream)
        with console.status(what) as status:
            while not done.wait(0.5):
                status.update(f"{what} ({time.monotonic() - started:.0f} s)")

    thread = threading.Thread(target=show, daemon=True, name="dzctl-busy")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=2)
