"""One node's end of ``distribute``'s tee, and when that node counts as stalled.

The tee (``distribute._stream_to``) fills each node's pipe; that node's SSH writer drains it into
the node's ``docker load``. A node is stalled when it leaves data it was offered untaken for the
stall bound, whether the tee is still sending or has sent everything and only the pipe's queue
is left, or when, having taken the last byte, its command does not end within the finish bound.
Either way the tee closes that node's link, so no stream size and no phase can hang a run.
"""

from __future__ import annotations

import threading
import time
from collections import deque

DEPTH = 32  # chunks a node may fall behind the fastest before the tee waits on it
# After its last byte a node's `docker load` still writes the image out with nothing to show on
# the wire: Docker 20.10 unpacks the archive only once it has all of it (a 1.82 GB image took
# about 105 s to load from a file for 3 nodes sharing this 2-core machine's disk, 17 MB/s each).
# It gets the stall bound, plus 1 s for every 5 MB it was sent: under a third of that slowest rate.
FINISH_BYTES_PER_S = 5_000_000


def finish_bound(stall_timeout: float, sent: int) -> float:
    """Seconds a node's command may take to end after it took the last byte of ``sent``."""
    return stall_timeout + sent / FINISH_BYTES_PER_S


class NodePipe:
    """A bounded queue of chunks that the tee puts into and that one node's SSH writer reads.

    It is the ``stdin`` file object handed to ``Connection.run``: ``read`` returns the next bytes,
    or ``b""`` once the stream ended (or the node was dropped, so its ``docker load`` sees a
    truncated stream and fails instead of loading half an image).
    """

    def __init__(self, host: str, depth: int = DEPTH) -> None:
        self.host = host
        self._depth = depth
        self._chunks: deque[bytes] = deque()
        self._ready = threading.Condition()
        self._buffer = memoryview(b"")
        self._ended = False  # the tee has put its last chunk
        self.dead = threading.Event()
        self.sent = 0
        self.why_stalled = ""  # set once the node is found stalled
        self._last_taken = time.monotonic()  # when the node last took bytes (or asked for more)
        self._waiting = False  # its reader waits for the tee: nothing it was offered lies untaken
        self._took_end: float | None = None  # when its reader saw the end of the stream

    def read(self, size: int = -1) -> bytes:
        if self.dead.is_set():
            return b""
        if not self._buffer:
            with self._ready:
                self._waiting = True
                while not self._chunks and not self._ended and not self.dead.is_set():
                    self._ready.wait()
                self._waiting = False
                self._last_taken = time.monotonic()
                if self.dead.is_set():
                    return b""
                if not self._chunks:
                    self._took_end = self._last_taken
                    return b""
                self._buffer = memoryview(self._chunks.popleft())
                self._ready.notify_all()
        size = len(self._buffer) if size is None or size < 0 else size
        out, self._buffer = self._buffer[:size], self._buffer[size:]
        self.sent += len(out)
        self._last_taken = time.monotonic()
        return bytes(out)

    def put(self, chunk: bytes, stall_timeout: float) -> bool:
        """Queue a chunk; False if the node is gone, or stalled (``why_stalled`` says so)."""
        with self._ready:
            while len(self._chunks) >= self._depth and not self.dead.is_set():
                if self._stalled(stall_timeout):
                    return False
                self._ready.wait(timeout=min(0.5, stall_timeout))
            if self.dead.is_set():
                return False
            self._chunks.append(chunk)
            self._ready.notify_all()
            return True

    def end(self) -> None:
        """No more chunks: the reader sees the end once it has taken what is queued."""
        with self._ready:
            self._ended = True
            self._ready.notify_all()

    def stalled(self, stall_timeout: float) -> bool:
        """Whether the node has stalled by now (``why_stalled`` then says how)."""
        with self._ready:
            return self._stalled(stall_timeout)

    def _stalled(self, stall_timeout: float) -> bool:
        if self.why_stalled:
            return True
        if self.dead.is_set():
            return False
        now = time.monotonic()
        if self._took_end is not None:
            bound = finish_bound(stall_timeout, self.sent)
            if now - self._took_end > bound:
                self.why_stalled = (
                    f"took all {self.sent / 1e6:,.1f} MB but did not finish within {bound:,.0f} s of the last byte"
                )
        elif not self._waiting and now - self._last_taken > stall_timeout:
            self.why_stalled = f"took no data for {stall_timeout:g} s"
        return bool(self.why_stalled)

    def drop(self) -> None:
        self.dead.set()
        with self._ready:
            self._ready.notify_all()  # wake a reader waiting on an empty queue, and the tee
