"""The SSH layer: one connection per host, reused; parallel fan-out; outcomes as data.

The only module that imports paramiko. Everything dzctl does on a node goes
through a ``Connection`` from a ``HostPool``:

    with HostPool(["node0", "node1"], ssh_config=path) as pool:
        outcomes = pool.run_all(["nvidia-smi", "-L"], timeout=30)   # {host: Result | RemoteError}
        conn = pool.connection("node0")
        conn.run(["docker", "load"], stdin=open("image.tar", "rb"), check=True)
        conn.put(b"KEY=v\\n", "/var/tmp/dzctl/env", mode=0o600)

- Hosts are resolved through an OpenSSH client config (``HostName``, ``User``,
  ``Port``, ``IdentityFile``, ``IdentitiesOnly``, ``UserKnownHostsFile``,
  ``ProxyJump``, ``ConnectTimeout``, ``StrictHostKeyChecking accept-new``);
  keys in ssh-agent are offered too.
- Host keys are checked against known_hosts. An unknown host is refused with
  the fix named, unless ``trust_new_hosts`` (then its key is appended to the
  user's known_hosts, as OpenSSH's ``accept-new`` does). A changed key is always
  refused: that is the one case where going on could hand a secret to someone else.
- Commands are argv lists, quoted with ``shlex.join`` here, at the one
  boundary where a shell (the remote login shell) is unavoidable.
- ``localhost``, ``127.0.0.1`` and ``::1`` run locally with subprocess, no SSH.
- A connection found closed when a command is about to start is dialled again,
  once (the command had not run); a command whose connection drops while it runs
  fails and is never repeated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import getpass
import logging
import os
import select
import shlex
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any, Protocol

import paramiko

from .errors import InputError, RemoteError

log = logging.getLogger(__name__)

# A node that does not answer the TCP handshake in 10 s is down or firewalled
# for our purposes; waiting longer only delays the report for all hosts.
DEFAULT_CONNECT_TIMEOUT = 10.0
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
DEFAULT_SSH_CONFIG = "~/.ssh/config"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
CHUNK = 1 << 16
NO_EXIT_STATUS = -1  # what paramiko reports when no exit-status arrived

OutputCallback = Callable[[bytes], None]
Stdin = bytes | IO[bytes] | None


# -- results ------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    """One command's outcome on one host."""

    host: str
    argv: tuple[str, ...]
    exit_code: int
    stdout: str
    stderr: str
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self) -> Result:
        """Return self, or raise ``RemoteError`` naming the host, command and stderr."""
        if self.exit_code != 0:
            tail = (self.stderr or self.stdout).strip()[-2000:]
            raise RemoteError(
                f"{self.host}: `{shlex.join(self.argv)}` {self.how_it_ended}" + (f": {tail}" if tail else "")
            )
        return self

    @property
    def how_it_ended(self) -> str:
        if self.exit_code == NO_EXIT_STATUS:
            # sshd sends exit-signal instead of exit-status for a command killed by a signal
            # (paramiko does not decode it), and nothing when the session is torn down.
            return "ended without an exit status (killed by a signal, or the session dropped)"
        if self.exit_code < 0:
            return f"was killed by signal {-self.exit_code}"  # subprocess's convention, local hosts
        return f"exited {self.exit_code}"


class GroupResult(dict):
    """``{host: value | Exception}`` for every host of a fan-out, in host order.

    Like Fabric's GroupResult: a failed host never hides the others' results.
    """

    @property
    def succeeded(self) -> dict[str, Any]:
        return {h: v for h, v in self.items() if not isinstance(v, BaseException)}

    @property
    def failed(self) -> dict[str, BaseException]:
        return {h: v for h, v in self.items() if isinstance(v, BaseException)}

    @property
    def ok(self) -> bool:
        return not self.failed and all(getattr(v, "ok", True) for v in self.values())

    def raise_on_failure(self) -> GroupResult:
        """Raise one ``RemoteError`` listing every failed host (after all have finished)."""
        problems = []
        for host, value in self.items():
            if isinstance(value, BaseException):
                problems.append(str(value) if str(value).startswith(host) else f"{host}: {value}")
            elif isinstance(value, Result) and not value.ok:
                try:
                    value.check()
                except RemoteError as exc:
                    problems.append(str(exc))
        if problems:
            fixes = {getattr(v, "fix", None) for v in self.failed.values()} - {None}
            raise RemoteError("\n".join(problems), fix="; ".join(sorted(fixes)) or None)
        return self


# -- host resolution ----------------------------------------------------------
@dataclass(frozen=True)
class HostConfig:
    """A host as the OpenSSH client config resolves it."""

    alias: str
    hostname: str
    port: int = 22
    user: str = field(default_factory=getpass.getuser)
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    known_hosts_files: tuple[str, ...] = ()
    proxy_jump: tuple[str, ...] = ()
    connect_timeout: float | None = None
    accept_new: bool = False  # StrictHostKeyChecking accept-new

    @property
    def known_hosts_name(self) -> str:
        """The name known_hosts lists this host under (OpenSSH's convention)."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"


def load_ssh_config(path: str | os.PathLike | None) -> paramiko.SSHConfig:
    """Parse an OpenSSH client config; None means ``~/.ssh/config`` if it exists."""
    explicit = path is not None
    target = Path(os.path.expanduser(str(path if explicit else DEFAULT_SSH_CONFIG)))
    if not target.exists():
        if explicit:
            raise InputError(
                f"SSH config not found: {target}",
                fix="pass an existing file to --ssh-config (or unset DZCTL_SSH_CONFIG)",
            )
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(str(target))
    except (paramiko.ConfigParseError, OSError, ValueError) as exc:
        raise InputError(f"{target}: cannot parse SSH config: {exc}", fix="fix the line named above") from None


def resolve_host(alias: str, config: paramiko.SSHConfig) -> HostConfig:
    """Apply the config's ``Host`` blocks to one name from the hostfile."""
    entry = config.lookup(alias)
    if "proxycommand" in entry and entry["proxycommand"].lower() != "none":
        raise InputError(
            f"SSH config for {alias}: ProxyCommand is not supported by dzctl",
            fix="use ProxyJump instead (dzctl follows ProxyJump chains itself)",
        )
    try:
        port = int(entry.get("port", 22))
    except ValueError:
        raise InputError(f"SSH config for {alias}: Port {entry.get('port')!r} is not a number") from None
    known = entry.get("userknownhostsfile")
    known_files = tuple(os.path.expanduser(p) for p in (known.split() if known else [DEFAULT_KNOWN_HOSTS]))
    jump = entry.get("proxyjump", "")
    jumps = () if not jump or jump.lower() == "none" else tuple(j.strip() for j in jump.split(",") if j.strip())
    timeout = entry.get("connecttimeout")
    return HostConfig(
        alias=alias,
        hostname=entry.get("hostname", alias),
        port=port,
        user=entry.get("user") or getpass.getuser(),
        identity_files=tuple(os.path.expanduser(p) for p in entry.get("identityfile", [])),
        identities_only=entry.get("identitiesonly", "no").lower() == "yes",
        known_hosts_files=known_files,
        proxy_jump=jumps,
        connect_timeout=float(timeout) if timeout else None,
        accept_new=entry.get("stricthostkeychecking", "").lower() == "accept-new",
    )


def _parse_jump(spec: str) -> tuple[str | None, str, int | None]:
    """``[user@]host[:port]`` (ProxyJump's syntax) → (user, host, port)."""
    user, _, rest = spec.rpartition("@")
    host, port = rest, None
    if rest.startswith("["):  # [ipv6]:port
        host, _, tail = rest[1:].partition("]")
        port = int(tail[1:]) if tail.startswith(":") else None
    elif rest.count(":") == 1:
        host, port_text = rest.split(":")
        port = int(port_text)
    return user or None, host, port


# -- host keys ----------------------------------------------------------------
_known_hosts_lock = threading.Lock()


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko only for a host absent from known_hosts.

    (A known host whose key differs never reaches here: paramiko raises
    BadHostKeyException, which we always turn into a refusal.)
    """

    def __init__(self, host: HostConfig, trust_new: bool, why: str = "--trust-new-hosts") -> None:
        self.host = host
        self.trust_new = trust_new
        self.why = why  # what allowed it: the flag, or the user's own SSH config (accept-new)

    def missing_host_key(self, client, hostname, key) -> None:
        fingerprint = key.fingerprint  # "SHA256:..." like ssh-keygen -l
        target = self.host.known_hosts_files[0]
        if not self.trust_new:
            keyscan = ["ssh-keyscan"] + (["-p", str(self.host.port)] if self.host.port != 22 else [])
            raise RemoteError(
                f"{self.host.alias}: host key of {hostname} is not in known_hosts "
                f"({', '.join(self.host.known_hosts_files)}); its {key.get_name()} key is {fingerprint}",
                fix=(
                    f"if that fingerprint is right, rerun with --trust-new-hosts, or add it with "
                    f"`{shlex.join([*keyscan, self.host.hostname])} >> {target}`"
                ),
            )
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _known_hosts_lock:
            path = Path(target)
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with path.open("a") as handle:
                handle.write(line)
        # Accepted keys are logged: trusting a key is a decision worth a trace.
        log.warning("trusted new host key for %s (%s): %s %s, recorded in %s (because of %s)", self.host.alias,
                    hostname, key.get_name(), fingerprint, target, self.why)  # fmt: skip
        client.get_host_keys().add(hostname, key.get_name(), key)


# -- connections --------------------------------------------------------------
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


def _stdin_chunks(stdin: Stdin) -> Iterable[bytes]:
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
            for chunk in _stdin_chunks(stdin):
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
                _deliver(chan.recv(CHUNK), out, on_stdout)
            while chan.recv_stderr_ready():
                _deliver(chan.recv_stderr(CHUNK), err, on_stderr)
            if chan.eof_received or chan.closed:
                # After EOF no more data arrives; drain what is buffered.
                while chan.recv_ready():
                    _deliver(chan.recv(CHUNK), out, on_stdout)
                while chan.recv_stderr_ready():
                    _deliver(chan.recv_stderr(CHUNK), err, on_stderr)
                out_open = err_open = False
        return _text(out), _text(err)

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


def _deliver(data: bytes, sink: list[bytes], callback: OutputCallback | None) -> None:
    if callback is None:
        sink.append(data)
    else:
        # Streamed output (logs --follow) is handed on, not kept in memory.
        callback(data)


def _text(chunks: list[bytes]) -> str:
    return b"".join(chunks).decode("utf-8", errors="replace")


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
        if stdin is not None:
            threads.append(threading.Thread(target=_pour, args=(stdin, proc.stdin), daemon=True))
        for thread in threads:
            thread.start()
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
        result = Result(self.host, tuple(argv), code, _text(out), _text(err), time.monotonic() - started)
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
        _deliver(chunk, sink, callback)


def _pour(stdin: Stdin, pipe) -> None:
    try:
        for chunk in _stdin_chunks(stdin):
            pipe.write(chunk)
    except BrokenPipeError:
        pass  # the command exited without reading all; its exit code says why
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


# -- the pool -----------------------------------------------------------------
class HostPool:
    """Connections to a run's hosts: opened on first use, in parallel, one per host.

    A host that cannot be reached is remembered, so every later call for it
    fails at once with the same error instead of waiting out the timeout again.
    """

    def __init__(
        self,
        hosts: Iterable[str],
        ssh_config: str | os.PathLike | None = None,
        trust_new_hosts: bool = False,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        self.hosts = list(dict.fromkeys(hosts))
        self.ssh_config_path = ssh_config
        self._config = load_ssh_config(ssh_config)
        self.trust_new_hosts = trust_new_hosts
        self.connect_timeout = connect_timeout
        self._connections: dict[str, Connection] = {}
        self._failures: dict[str, RemoteError] = {}
        self.connect_seconds: dict[str, float] = {}  # how long each host's connect took (or failed after)
        self._locks = {host: threading.Lock() for host in self.hosts}
        self._closed = False

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def resolve(self, host: str) -> HostConfig:
        return resolve_host(host, self._config)

    def connection(self, host: str) -> Connection:
        """The host's connection, opened now if this is its first use; RemoteError if unreachable."""
        lock = self._locks.setdefault(host, threading.Lock())
        with lock:
            if host in self._connections:
                return self._connections[host]
            if host in self._failures:
                raise self._failures[host]
            started = time.monotonic()
            try:
                conn = self._open(host)
            except RemoteError as exc:
                self._failures[host] = exc
                raise
            finally:
                self.connect_seconds[host] = time.monotonic() - started
            self._connections[host] = conn
            return conn

    def _open(self, host: str) -> Connection:
        if host in LOCAL_HOSTS:
            return LocalConnection(host)
        config = self.resolve(host)
        client, jumps = self._dial(config)
        return SSHConnection(config, client, jumps, dial=functools.partial(self._dial, config))

    def _dial(self, config: HostConfig) -> tuple[paramiko.SSHClient, list[paramiko.SSHClient]]:
        """An authenticated client for the host, and the jump hosts' clients its socket runs through."""
        host = config.alias
        jumps: list[paramiko.SSHClient] = []
        sock = None
        try:
            # ProxyJump a,b: connect to a, through a to b, through b to the target.
            for position, hop in enumerate(config.proxy_jump):
                client = self._connect(self._hop_config(hop), sock)
                jumps.append(client)
                following = config.proxy_jump[position + 1 :]
                if following:
                    nxt = self._hop_config(following[0])
                    next_target = (nxt.hostname, nxt.port)
                else:
                    next_target = (config.hostname, config.port)
                sock = client.get_transport().open_channel(
                    "direct-tcpip", next_target, ("127.0.0.1", 0), timeout=self._timeout(config)
                )
            client = self._connect(config, sock)
        except RemoteError:
            for jump in jumps:
                jump.close()
            raise
        except (paramiko.SSHException, OSError) as exc:
            for jump in jumps:
                jump.close()
            raise RemoteError(
                f"{host}: cannot reach it through ProxyJump {','.join(config.proxy_jump)}: {exc}",
                fix="check the jump host's ssh_config entry and that it may forward TCP (AllowTcpForwarding)",
            ) from None
        return client, jumps

    def _hop_config(self, hop: str) -> HostConfig:
        """A ProxyJump hop (``[user@]host[:port]``), resolved through the same config, without its own jumps."""
        user, name, port = _parse_jump(hop)
        resolved = self.resolve(name)
        return dataclasses.replace(resolved, user=user or resolved.user, port=port or resolved.port, proxy_jump=())

    def _timeout(self, config: HostConfig) -> float:
        return min(config.connect_timeout, self.connect_timeout) if config.connect_timeout else self.connect_timeout

    def _connect(self, config: HostConfig, sock) -> paramiko.SSHClient:
        timeout = self._timeout(config)
        client = paramiko.SSHClient()
        for path in config.known_hosts_files:
            if os.path.exists(path):
                try:
                    # Loaded as read-only "system" keys: we never rewrite the
                    # user's file, only append to it (see _HostKeyPolicy).
                    client.load_system_host_keys(path)
                except (OSError, paramiko.SSHException) as exc:
                    raise InputError(f"{path}: cannot read known_hosts: {exc}") from None
        # OpenSSH's own rule for a user who chose it: `StrictHostKeyChecking accept-new` in the SSH config
        # records unknown keys as --trust-new-hosts does (`no`/`off` are not honoured: still refused).
        why = (
            "--trust-new-hosts"
            if self.trust_new_hosts
            else f"StrictHostKeyChecking accept-new in {config.alias}'s SSH config"
        )
        client.set_missing_host_key_policy(_HostKeyPolicy(config, self.trust_new_hosts or config.accept_new, why))
        keys = [p for p in config.identity_files if os.path.exists(p)]
        started = time.monotonic()
        where = f"{config.user}@{config.hostname}:{config.port}"
        try:
            client.connect(
                config.hostname,
                port=config.port,
                username=config.user,
                key_filename=keys or None,
                # IdentitiesOnly: only the configured keys, as OpenSSH does;
                # otherwise agent keys and ~/.ssh/id_* are tried too.
                allow_agent=not config.identities_only,
                look_for_keys=not keys and not config.identities_only,
                timeout=timeout,
                banner_timeout=timeout,
                auth_timeout=timeout,
                sock=sock,
            )
        except RemoteError:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise RemoteError(
                f"{config.alias}: HOST KEY CHANGED for {config.hostname}: known_hosts has "
                f"{exc.expected_key.get_name()} {exc.expected_key.fingerprint}, the host offered "
                f"{exc.key.get_name()} {exc.key.fingerprint}. Refusing to connect: this may be an attack, "
                "or the host was reinstalled",
                fix=(
                    "if the host was reinstalled, confirm the new fingerprint out of band, then remove the old key "
                    f"with `ssh-keygen -R {shlex.quote(config.known_hosts_name)} -f {config.known_hosts_files[0]}`"
                ),
            ) from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise RemoteError(
                f"{config.alias}: authentication as {config.user} at {where} failed: {exc}",
                fix="check User and IdentityFile in the SSH config, or load the key into ssh-agent (ssh-add)",
            ) from None
        except TimeoutError:
            client.close()
            raise RemoteError(
                f"{config.alias}: unreachable: no answer from {where} within {timeout:g} s",
                fix=f"check that {config.hostname} is up and that port {config.port} is open from here",
            ) from None
        except (OSError, paramiko.SSHException, EOFError) as exc:
            client.close()
            if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
                # paramiko folds "connection refused" per address into one message; unfold it.
                reason = "; ".join(sorted({e.strerror or str(e) for e in exc.errors.values()}))
            elif isinstance(exc, OSError) and exc.strerror:
                reason = exc.strerror
            else:
                reason = str(exc) or type(exc).__name__
            raise RemoteError(
                f"{config.alias}: unreachable: {where}: {reason} (after {time.monotonic() - started:.1f} s)",
                fix=f"check that sshd runs on {config.hostname} and listens on port {config.port}",
            ) from None
        transport = client.get_transport()
        # Keepalives: a long `logs --follow` or launch must notice a dead peer.
        transport.set_keepalive(30)
        return client

    def connect_all(self) -> GroupResult:
        """Open every host's connection in parallel: ``{host: Connection | RemoteError}``."""
        return self.map(lambda conn: conn)

    def map(self, fn: Callable[[Connection], Any], hosts: Iterable[str] | None = None) -> GroupResult:
        """Call ``fn(connection)`` for each host at once; every outcome is returned as data."""
        chosen = list(hosts) if hosts is not None else self.hosts
        if not chosen:
            return GroupResult()

        def one(host: str) -> Any:
            try:
                return fn(self.connection(host))
            except Exception as exc:  # a host's failure is data for the caller
                if not isinstance(exc, RemoteError | InputError):
                    exc = RemoteError(f"{host}: {type(exc).__name__}: {exc}")
                return exc

        # One thread per host: the work is waiting on the network, not CPU.
        with ThreadPoolExecutor(max_workers=len(chosen), thread_name_prefix="dzctl-ssh") as executor:
            outcomes = list(executor.map(one, chosen))
        return GroupResult(zip(chosen, outcomes, strict=True))

    def run_all(
        self,
        argv: list[str] | Callable[[str], list[str]],
        *,
        timeout: float | None = None,
        hosts: Iterable[str] | None = None,
        **kwargs,
    ) -> GroupResult:
        """Run one command on every host (``argv``, or ``argv(host)`` per host): ``{host: Result | RemoteError}``."""

        def run(conn: Connection) -> Result:
            command = argv(conn.host) if callable(argv) else argv
            return conn.run(command, timeout=timeout, **kwargs)

        return self.map(run, hosts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._connections.values():
            try:
                conn.close()
            except Exception as exc:  # closing must never mask the run's own outcome
                log.debug("closing %s: %s", conn.host, exc)
        self._connections.clear()
