"""One SSH connection to a host (paramiko), and the ``Connection`` interface every transport provides.

Commands are argv lists, quoted with ``shlex.join`` in ``command_line``, the one boundary where a
shell (the remote login shell) is unavoidable. A connection found closed when a command is about
to start is dialled again, once (the command had not run); a command whose connection drops while
it runs fails and is never repeated.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shlex
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import PurePosixPath
from typing import IO, Protocol

import paramiko

from ..errors import RemoteError
from .results import Result
from .sshconfig import DEFAULT_CONNECT_TIMEOUT, HostConfig

log = logging.getLogger(__name__)


CHUNK = 1 << 16


OutputCallback = Callable[[bytes], None]


Stdin = bytes | IO[bytes] | None


class Connection(Protocol):
    """What a command on a host needs; SSH and local connections both provide it."""

    host: str

    def run(
        self,
        argv: list[str] | tuple[str, ...],
        *,
        timeout: float | None = None,
        stdin: Stdin = None,
        check: bool = False,
        env: dict[str, str] | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> Result: ...

    def put(self, source: bytes | str | os.PathLike, remote_path: str, mode: int = 0o644) -> None: ...

    def mkdir(self, path: str, mode: int = 0o755) -> None: ...

    def get(self, remote_path: str) -> bytes: ...

    def close(self) -> None: ...

    @property
    def connected(self) -> bool:
        """Whether the link is up now, without dialling again (a local connection always is)."""
        ...


def command_line(argv: list[str] | tuple[str, ...], env: dict[str, str] | None = None) -> str:
    """The one place argv becomes a shell string: every word quoted, so values stay inert."""
    if not argv:
        raise ValueError("empty command")
    words = [str(a) for a in argv]
    if env:
        # `env` rather than `K=V cmd`: it works whatever the login shell is.
        words = ["env", *(f"{k}={v}" for k, v in env.items()), *words]
    return shlex.join(words)


class _Deadline:
    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.end = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    def passed(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


def stdin_chunks(stdin: Stdin) -> Iterable[bytes]:
    if isinstance(stdin, bytes | bytearray | memoryview):
        data = bytes(stdin)
        for start in range(0, len(data), CHUNK):
            yield data[start : start + CHUNK]
        return
    while True:
        chunk = stdin.read(CHUNK)
        if not chunk:
            return
        yield chunk


Dial = Callable[[], tuple[paramiko.SSHClient, list[paramiko.SSHClient]]]


class SSHConnection:
    """One paramiko transport to one host; every command of a run is a channel on it.

    A transport that has closed (sshd restarted, a NAT or firewall dropped the idle
    connection, the server hung up) is dialled again once, but only when the command
    had not started: a channel that could not be opened ran nothing, so running it on
    a fresh connection is safe. A command whose connection dies while it runs is never
    repeated; it fails.
    """

    def __init__(
        self,
        host: HostConfig,
        client: paramiko.SSHClient,
        jumps: list[paramiko.SSHClient],
        dial: Dial | None = None,
    ) -> None:
        self.host = host.alias
        self.config = host
        self._client = client
        self._jumps = jumps  # kept open: the target's socket is a channel through them
        self._dial = dial  # how to connect again (None: never)
        self._sftp: paramiko.SFTPClient | None = None
        self._sftp_lock = threading.Lock()
        self._no_sftp = False  # the server refused the SFTP subsystem: upload through exec channels
        self._redial_lock = threading.Lock()
        self.redials = 0  # how often the connection had to be dialled again

    def _transport(self) -> paramiko.Transport | None:
        return self._client.get_transport()

    @property
    def connected(self) -> bool:
        transport = self._transport()
        return transport is not None and transport.is_active()

    def _redial(self, dead: paramiko.Transport | None) -> paramiko.Transport:
        """A live transport in place of ``dead``; RemoteError when the host cannot be reached again."""
        with self._redial_lock:
            current = self._transport()
            if current is not dead and current is not None and current.is_active():
                return current  # another thread has dialled again already
            if self._dial is None:
                raise RemoteError(f"{self.host}: the SSH connection has closed", fix="rerun; check the host's sshd")
            try:
                client, jumps = self._dial()
            except RemoteError as exc:
                raise RemoteError(
                    f"{self.host}: the SSH connection closed, and connecting again failed: {exc}",
                    fix=exc.fix or "check the host's sshd",
                ) from None
            old_client, old_jumps = self._client, self._jumps
            with self._sftp_lock:
                self._sftp = None  # belonged to the old transport
            self._client, self._jumps = client, jumps
            self.redials += 1
            log.warning("%s: the SSH connection had closed; connected again", self.host)
        old_client.close()
        for jump in reversed(old_jumps):
            jump.close()
        return self._transport()

    def _open_channel(self, deadline: _Deadline) -> paramiko.Channel:
        """A session channel, dialling again once if the connection turns out to be gone."""
        transport = self._transport()
        redialled = transport is None or not transport.is_active()
        if redialled:
            transport = self._redial(transport)
        try:
            return transport.open_session(timeout=deadline.left() or DEFAULT_CONNECT_TIMEOUT)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            # A write to a closed socket (EOFError/OSError) means the link is gone even while
            # paramiko's reader thread has not yet noticed and still calls the transport active.
            link_gone = isinstance(exc, (EOFError, OSError)) or not transport.is_active()
            if redialled or not link_gone:
                raise  # once per command; and a live server that refuses (MaxSessions) did not drop us
        return self._redial(transport).open_session(timeout=deadline.left() or DEFAULT_CONNECT_TIMEOUT)

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
        line = command_line(argv, env)
        started = time.monotonic()
        deadline = _Deadline(timeout)
        try:
            chan = self._open_channel(deadline)
            # Without input the command reads /dev/null, so `cat`-like commands do not wait.
            # Not an SSH EOF after the start: see _end_input for why.
            chan.exec_command(line if stdin is not None else f"{line} </dev/null")
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise RemoteError(f"{self.host}: cannot start `{line}`: {exc}") from None
        writer = None
        try:
            if stdin is not None:
                writer = threading.Thread(target=self._feed, args=(chan, stdin), daemon=True)
                writer.start()
            out, err = self._collect(chan, deadline, on_stdout, on_stderr, line)
            code = chan.recv_exit_status()
        finally:
            with contextlib.suppress(EOFError, OSError, paramiko.SSHException):
                chan.close()  # on a link that just died this raises; what ran is reported below
        if writer is not None:
            writer.join(timeout=5)
            if getattr(chan, "_dz_feed_error", None) is not None:
                raise RemoteError(f"{self.host}: sending stdin to `{line}` failed: {chan._dz_feed_error}")
        result = Result(self.host, tuple(argv), code, out, err, time.monotonic() - started)
        return result.check() if check else result

    @staticmethod
    def _feed(chan: paramiko.Channel, stdin: Stdin) -> None:
        try:
            for chunk in stdin_chunks(stdin):
                chan.sendall(chunk)
            _end_input(chan)
        except EOFError:
            # paramiko's word for a transport that is gone (it carries no message).
            chan._dz_feed_error = ConnectionError("the SSH connection closed")
        except OSError as exc:
            if chan.closed or chan.exit_status_ready():
                return  # the command exited without reading it all; its exit code says why
            chan._dz_feed_error = exc
        except Exception as exc:  # reading the local source failed: reported by run()
            chan._dz_feed_error = exc
            with contextlib.suppress(EOFError, OSError, paramiko.SSHException):
                chan.close()  # or the command would wait for the rest of its input forever

    def _collect(self, chan, deadline, on_stdout, on_stderr, line) -> tuple[str, str]:
        out: list[bytes] = []
        err: list[bytes] = []
        out_open = err_open = True
        while out_open or err_open:
            left = deadline.left()
            if left == 0.0:
                raise RemoteError(
                    f"{self.host}: `{line}` timed out after {deadline.timeout:g} s",
                    fix="raise the timeout or check what the command waits for on that host",
                )
            # The channel's fileno becomes readable on stdout, stderr or EOF.
            select.select([chan], [], [], min(left, 1.0) if left is not None else 1.0)
            while chan.recv_ready():
                deliver(chan.recv(CHUNK), out, on_stdout)
            while chan.recv_stderr_ready():
                deliver(chan.recv_stderr(CHUNK), err, on_stderr)
            if chan.eof_received or chan.closed:
                # After EOF no more data arrives; drain what is buffered.
                while chan.recv_ready():
                    deliver(chan.recv(CHUNK), out, on_stdout)
                while chan.recv_stderr_ready():
                    deliver(chan.recv_stderr(CHUNK), err, on_stderr)
                out_open = err_open = False
        return decoded(out), decoded(err)

    def _sftp_client(self) -> paramiko.SFTPClient | None:
        """The connection's SFTP session, or None when the server has no SFTP subsystem.

        Some hardened sshd configs leave out `Subsystem sftp`: the server then refuses the
        subsystem request and closes the channel, while the connection itself stays up."""
        transport = self._transport()
        if transport is None or not transport.is_active():
            self._redial(transport)  # nothing was sent yet: as for a command's channel
        with self._sftp_lock:
            if self._sftp is None and not self._no_sftp:
                try:
                    self._sftp = self._client.open_sftp()
                except paramiko.SSHException as exc:
                    transport = self._client.get_transport()
                    if transport is None or not transport.is_active():
                        raise RemoteError(f"{self.host}: the connection closed while opening SFTP: {exc}") from None
                    log.info("%s: no SFTP subsystem (%s): uploading through exec channels", self.host, exc)
                    self._no_sftp = True
            return self._sftp

    @property
    def upload_transport(self) -> str:
        """How files reach this host: what preflight's upload check reports."""
        if self._sftp_client() is None:
            return "through exec channels: this sshd has no SFTP subsystem"
        return "over SFTP"

    def _exec_put(self, source, remote_path: str, mode: int) -> None:
        """Upload through a command's stdin, for servers without SFTP: the same guarantees as over
        SFTP (the file has ``mode`` before any byte is written, it appears whole by rename)."""
        target = PurePosixPath(remote_path)
        temp = str(target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.part"))
        script = 'umask 077 && : > "$1" && chmod "$2" "$1" && cat > "$1" && mv -f "$1" "$3" || { rm -f "$1"; exit 1; }'
        argv = ["sh", "-c", script, "sh", temp, format(mode, "o"), str(target)]
        if isinstance(source, bytes | bytearray):
            result = self.run(argv, stdin=bytes(source), timeout=None)
        else:
            with open(source, "rb") as local:
                result = self.run(argv, stdin=local, timeout=None)
        if not result.ok:
            raise RemoteError(
                f"{self.host}: upload to {remote_path} failed (no SFTP; through sh): {_first_line(result)}",
                fix=f"check that {target.parent} exists on {self.host} and is writable by {self.config.user}",
            )

    def put(self, source, remote_path: str, mode: int = 0o644) -> None:
        """Upload bytes or a local file; the file has ``mode`` before any byte is written."""
        sftp = self._sftp_client()
        if sftp is None:
            self._exec_put(source, remote_path, mode)
            return
        target = PurePosixPath(remote_path)
        temp = str(target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.part"))
        try:
            with sftp.open(temp, "wb") as handle:
                # chmod first: an env file holding secrets is never readable by others, not even briefly.
                sftp.chmod(temp, mode)
                handle.set_pipelined(True)
                if isinstance(source, bytes | bytearray):
                    handle.write(bytes(source))
                else:
                    with open(source, "rb") as local:
                        shutil.copyfileobj(local, handle, CHUNK)
            sftp.posix_rename(temp, str(target))
        except (OSError, paramiko.SSHException) as exc:
            with contextlib.suppress(OSError, paramiko.SSHException):
                sftp.remove(temp)
            raise RemoteError(
                f"{self.host}: upload to {remote_path} failed: {exc}",
                fix=f"check that {target.parent} exists on {self.host} and is writable by {self.config.user}",
            ) from None

    def get(self, remote_path: str) -> bytes:
        """Download one file (progress records, tracker event files: small enough to hold in memory)."""
        sftp = self._sftp_client()
        try:
            with sftp.open(remote_path, "rb") as handle:
                handle.prefetch()
                return handle.read()
        except (OSError, paramiko.SSHException) as exc:
            raise RemoteError(f"{self.host}: download of {remote_path} failed: {exc}") from None

    def mkdir(self, path: str, mode: int = 0o755) -> None:
        """``mkdir -p`` over SFTP (or ``mkdir -p`` itself where the server has no SFTP)."""
        sftp = self._sftp_client()
        if sftp is None:
            result = self.run(["mkdir", "-p", "-m", format(mode, "o"), path])
            if not result.ok:
                raise RemoteError(f"{self.host}: mkdir {path} failed: {_first_line(result)}")
            return
        current = PurePosixPath("/") if path.startswith("/") else PurePosixPath(".")
        for part in PurePosixPath(path).parts:
            current = current / part if part != "/" else current
            if part == "/":
                continue
            try:
                sftp.stat(str(current))
            except FileNotFoundError:
                try:
                    sftp.mkdir(str(current), mode)
                except OSError as exc:
                    # Another connection may have made it in the meantime.
                    try:
                        sftp.stat(str(current))
                    except OSError:
                        raise RemoteError(f"{self.host}: mkdir {current} failed: {exc}") from None

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
        self._client.close()
        for jump in reversed(self._jumps):
            jump.close()


def _first_line(result: Result) -> str:
    text = (result.stderr.strip() or result.stdout.strip()).splitlines()
    return text[-1][:300] if text else result.how_it_ended


def _end_input(chan: paramiko.Channel) -> None:
    """``chan.shutdown_write()`` without paramiko's race (paramiko issues #1115, #1584, #1705).

    paramiko builds the EOF message under the channel's lock but sends it after
    releasing it. When the command has just ended, the transport thread can send
    its CLOSE (its answer to the server's) in between; the EOF then follows the
    CLOSE, and OpenSSH drops the whole connection, every channel on it ("ieof
    packet referred to nonexistent channel 0", seen in this project's CI as a
    node whose preflight checks all failed at once). Sent while holding the lock,
    which the transport thread's close handling takes too, the EOF cannot be
    overtaken; a channel already closed gets none. (During a key exchange the send
    waits for it to finish, at most paramiko's ``clear_to_send_timeout``.)
    """
    with chan.lock:
        if chan.closed or chan.eof_sent:
            return
        message = chan._send_eof()
        if message is not None:
            chan.transport._send_user_message(message)


def deliver(data: bytes, sink: list[bytes], callback: OutputCallback | None) -> None:
    if callback is None:
        sink.append(data)
    else:
        # Streamed output (logs --follow) is handed on, not kept in memory.
        callback(data)


def decoded(chunks: list[bytes]) -> str:
    return b"".join(chunks).decode("utf-8", errors="replace")
