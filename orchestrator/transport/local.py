"""``localhost``, ``127.0.0.1`` and ``::1``: the same ``Connection`` interface with subprocess, no SSH."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import RemoteError
from .connection import CHUNK, Connection, OutputCallback, Stdin, decoded, deliver, stdin_chunks
from .results import Result

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


class LocalConnection:
    """The same interface for this machine, with subprocess and no SSH."""

    def __init__(self, host: str = "localhost") -> None:
        self.host = host
        self._running: set[subprocess.Popen] = set()
        self._running_lock = threading.Lock()

    @property
    def connected(self) -> bool:
        return True

    def run(
        self,
        argv,
        *,
        timeout=None,
        stdin=None,
        check=False,
        env=None,
        on_stdout=None,
        on_stderr=None,
    ) -> Result:
        started = time.monotonic()
        full_env = {**os.environ, **env} if env else None
        try:
            proc = subprocess.Popen(
                [str(a) for a in argv],
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=full_env,
            )
        except OSError as exc:
            # The shell would say "command not found" and exit 127; do the same.
            result = Result(self.host, tuple(argv), 127, "", f"{argv[0]}: {exc.strerror}", 0.0)
            return result.check() if check else result
        with self._running_lock:
            self._running.add(proc)
        out: list[bytes] = []
        err: list[bytes] = []
        threads = [
            threading.Thread(target=_pump, args=(proc.stdout, out, on_stdout), daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, err, on_stderr), daemon=True),
        ]
        for thread in threads:
            thread.start()
        if stdin is not None:
            # Not joined: once the command has exited its input no longer matters, and a caller's pipe
            # may stay open until after run() returns (preflight's port listener, whose Python is
            # missing, exits at once while its stdin is the caller's signal to stop).
            threading.Thread(target=_pour, args=(stdin, proc.stdin), daemon=True).start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RemoteError(
                f"{self.host}: `{shlex.join(map(str, argv))}` timed out after {timeout} s",
                fix="raise the timeout or check what the command waits for",
            ) from None
        finally:
            with self._running_lock:
                self._running.discard(proc)
        for thread in threads:
            thread.join()
        result = Result(self.host, tuple(argv), code, decoded(out), decoded(err), time.monotonic() - started)
        return result.check() if check else result

    def put(self, source, remote_path: str, mode: int = 0o644) -> None:
        target = Path(remote_path)
        temp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.part")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            os.fchmod(fd, mode)  # umask does not get a say: the caller asked for these bits
            with os.fdopen(fd, "wb") as handle:
                if isinstance(source, bytes | bytearray):
                    handle.write(bytes(source))
                else:
                    with open(source, "rb") as local:
                        shutil.copyfileobj(local, handle, CHUNK)
            os.replace(temp, target)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise RemoteError(f"{self.host}: writing {remote_path} failed: {exc}") from None

    def get(self, remote_path: str) -> bytes:
        try:
            return Path(remote_path).read_bytes()
        except OSError as exc:
            raise RemoteError(f"{self.host}: reading {remote_path} failed: {exc}") from None

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        try:
            os.makedirs(path, mode=mode, exist_ok=True)
        except OSError as exc:
            raise RemoteError(f"{self.host}: mkdir {path} failed: {exc}") from None

    def close(self) -> None:
        pass

    def kill_running(self) -> None:
        """Kill the commands running now (their ``run`` returns with the signal as exit code)."""
        with self._running_lock:
            running = list(self._running)
        for proc in running:
            with contextlib.suppress(OSError):
                proc.kill()


def _pump(stream, sink: list[bytes], callback: OutputCallback | None) -> None:
    for chunk in iter(lambda: stream.read1(CHUNK), b""):
        deliver(chunk, sink, callback)


def _pour(stdin: Stdin, pipe) -> None:
    try:
        for chunk in stdin_chunks(stdin):
            pipe.write(chunk)
    except (BrokenPipeError, ValueError):
        pass  # the command exited without reading all (its exit code says why), or the caller closed its source
    finally:
        with contextlib.suppress(BrokenPipeError):
            pipe.close()


def run_concurrently(
    conn: Connection, argvs: list[list[str]], *, timeout: float | None = None, max_channels: int = 8
) -> list[Result | Exception]:
    """Several independent commands on one host at once, each on its own channel of the one connection.

    Saves a round trip and a session start-up per command over running them in turn. OpenSSH's
    sshd allows 10 sessions per connection by default (MaxSessions), hence the cap.
    """

    def one(argv: list[str]) -> Result | Exception:
        try:
            return conn.run(argv, timeout=timeout)
        except RemoteError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(1, min(max_channels, len(argvs)))) as executor:
        return list(executor.map(one, argvs))
