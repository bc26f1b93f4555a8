"""The node side of ``runtime: process``: what a container gives the docker runtime.

    python -m orchestrator.runtimes.process start  --job-dir D --rank R [--env-file F] [--env K=V]... -- CMD...
    python -m orchestrator.runtimes.process status --job-dir D --rank R
    python -m orchestrator.runtimes.process follow --job-dir D --rank R [--tail N]
    python -m orchestrator.runtimes.process stop   --job-dir D --rank R [--grace S]
    python -m orchestrator.runtimes.process run    --job-dir D --rank R [--container NAME] [--env...] -- CMD...

``run`` is ``start`` in the foreground, for a scheduler that owns the process
(a Slurm step): the same log and record, its exit code is the command's, and a
SIGTERM (scancel, ``srun --kill-on-bad-exit``) stops the whole tree, and the
container ``--container`` names, before it exits.

``start`` detaches a supervisor (so the SSH session may close) that runs CMD
in its own process group with its output in ``D/rank-R.log``, and records
pid, start, exit code and end in ``D/rank-R.json``: the truth ``dzctl status``
reads, like ``docker inspect`` for a container. Secrets come from the 0600
env file, never from argv (which ``ps`` shows to every user).

Standard library only: it runs on nodes where only the trainer's Python is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STATE_WAIT_S = 10.0  # how long `start` waits for the supervisor to report the launcher's pid


def _paths(job_dir: str, rank: int) -> tuple[Path, Path]:
    base = Path(job_dir)
    return base / f"rank-{rank}.log", base / f"rank-{rank}.json"


def _read_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _write_state(path: Path, state: dict) -> None:
    # Write then rename: a reader never sees half a file.
    temp = path.with_suffix(".json.tmp")
    temp.write_text(json.dumps(state))
    os.replace(temp, path)


def _read_env_file(path: str) -> dict[str, str]:
    values = {}
    for raw in Path(path).read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and "=" in line:
            name, _, value = line.partition("=")
            values[name.strip()] = value
    return values


def _stat_field(pid: int | str, number: int) -> int | None:
    """Field ``number`` (1-based, as in proc(5)) of /proc/PID/stat; None if the process is gone.

    The command name (field 2) may hold spaces and parentheses: fields are counted
    from the last ')'.
    """
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[number - 3])
    except (OSError, IndexError, ValueError):
        return None


def _start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks since boot, /proc/PID/stat field 22), or None if gone.

    With the pid it names one process for good: pids are reused (pid_max is
    often 32768), and a stale pid must never get a signal meant for a rank.
    """
    return _stat_field(pid, 22)


def _alive(pid: int, ticks: int | None = None) -> bool:
    started = _start_ticks(pid)
    return started is not None and (ticks is None or started == ticks)


def start(args: argparse.Namespace) -> int:
    log_path, state_path = _paths(args.job_dir, args.rank)
    previous = _read_state(state_path)
    if (
        previous
        and previous.get("exit_code") is None
        and _alive(previous.get("pid") or -1, previous.get("pid_start_ticks"))
    ):
        print(f"rank {args.rank} already runs as pid {previous['pid']}", file=sys.stderr)
        return 1
    state_path.unlink(missing_ok=True)
    env = _command_env(args)
    if not args.command:
        print("no command given after --", file=sys.stderr)
        return 2
    if os.fork() == 0:
        _supervise(args.command, env, log_path, state_path)  # never returns
    deadline = time.monotonic() + STATE_WAIT_S
    while time.monotonic() < deadline:
        state = _read_state(state_path)
        if state is not None:
            print(json.dumps(state))
            return 0 if state.get("error") is None else 1
        time.sleep(0.05)
    print(f"the supervisor did not report within {STATE_WAIT_S:g} s; see {log_path}", file=sys.stderr)
    return 1


def _command_env(args: argparse.Namespace) -> dict[str, str]:
    """This process's environment, then each ``--env NAME=VALUE``, then ``--env-file``."""
    env = dict(os.environ)
    for item in args.env:
        name, _, value = item.partition("=")
        env[name] = value
    if args.env_file:
        env.update(_read_env_file(args.env_file))
    return env


def _supervise(command: list[str], env: dict[str, str], log_path: Path, state_path: Path) -> None:
    """The detached child: run the command, record its end. Exits the process."""
    code = 1
    try:
        os.setsid()  # leave the SSH session's process group: a closed session must not kill training
        _become_subreaper()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)  # release the SSH channel, which waits for EOF on our stdout
        with open(log_path, "ab", buffering=0) as log:
            try:
                proc = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
                )
            except OSError as exc:
                log.write(f"dzctl: cannot start {command[0]}: {exc.strerror}\n".encode())
                _write_state(state_path, {"pid": None, "error": str(exc), "exit_code": 127, "finished": time.time()})
                os._exit(1)
            state = {
                "pid": proc.pid,
                "pid_start_ticks": _start_ticks(proc.pid),
                "supervisor": os.getpid(),
                "supervisor_start_ticks": _start_ticks(os.getpid()),
                "started": time.time(),
                "exit_code": None,
            }
            _write_state(state_path, state)
            returncode = proc.wait()
            # torchrun starts each worker in its own session: if the launcher died
            # first (killed, or a rank ended its node), its workers are now ours.
            _kill_orphans()
            # Like a shell and docker: death by signal N is 128+N.
            state.update(exit_code=128 - returncode if returncode < 0 else returncode, finished=time.time())
            _write_state(state_path, state)
            code = 0
    finally:
        os._exit(code)


def run(args: argparse.Namespace) -> int:
    """Run the command in the foreground (under a Slurm step): record it as ``start`` does, return its code."""
    log_path, state_path = _paths(args.job_dir, args.rank)
    state_path.unlink(missing_ok=True)
    env = _command_env(args)
    if not args.command:
        print("no command given after --", file=sys.stderr)
        return 2
    _become_subreaper()
    stopped: list[int] = []

    def on_signal(signum, frame) -> None:
        # The scheduler ends the step: say so in the record (the rank was stopped, it did not fail
        # first), then stop what runs: the container by name (its CLI may not forward), the tree.
        stopped.append(signum)
        if args.container:
            subprocess.run(["docker", "stop", "--time", "5", args.container], capture_output=True, check=False)
        _signal_all({p: _start_ticks(p) for p in descendants(os.getpid()) if p != os.getpid()}, signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with open(log_path, "ab", buffering=0) as log:
        try:
            proc = subprocess.Popen(
                args.command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
            )
        except OSError as exc:
            log.write(f"dzctl: cannot start {args.command[0]}: {exc.strerror}\n".encode())
            _write_state(state_path, {"pid": None, "error": str(exc), "exit_code": 127, "finished": time.time()})
            return 127
        state = {
            "pid": proc.pid,
            "pid_start_ticks": _start_ticks(proc.pid),
            "supervisor": os.getpid(),
            "supervisor_start_ticks": _start_ticks(os.getpid()),
            "host": socket.gethostname(),
            "started": time.time(),
            "exit_code": None,
        }
        _write_state(state_path, state)
        while True:
            try:
                returncode = proc.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for old interpreters
                continue
        _kill_orphans()
        code = 128 - returncode if returncode < 0 else returncode
        if stopped:
            state["stopped_by_signal"] = stopped[0]
        state.update(exit_code=code, finished=time.time())
        _write_state(state_path, state)
    return code


def _become_subreaper() -> None:
    """Orphaned descendants are re-parented to us, not to init, so none can outlive the rank."""
    import ctypes

    pr_set_child_subreaper = 36  # <linux/prctl.h>
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def _kill_orphans() -> None:
    me = os.getpid()
    _signal_all({pid: _start_ticks(pid) for pid in descendants(me) if pid != me}, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG) != (0, 0):
            pass


def status(args: argparse.Namespace) -> int:
    _, state_path = _paths(args.job_dir, args.rank)
    state = _read_state(state_path)
    if state is None:
        print(json.dumps({"state": "missing"}))
        return 0
    if state.get("exit_code") is not None:
        state["state"] = "exited"
    elif _alive(state["pid"], state.get("pid_start_ticks")):
        state["state"] = "running"
    elif state.get("supervisor_start_ticks") is not None and _alive(
        state["supervisor"], state["supervisor_start_ticks"]
    ):
        # The command has ended and its supervisor is recording how (it ends the orphans first, which
        # takes a moment on a loaded node): not dead, its exit code comes next.
        state["state"] = "running"
    else:
        # The supervisor itself died (node reboot, kill -9): the end was never recorded.
        state["state"] = "dead"
    print(json.dumps(state))
    return 0


def follow(args: argparse.Namespace) -> int:
    log_path, state_path = _paths(args.job_dir, args.rank)
    out = sys.stdout.buffer
    if not log_path.exists():
        print(f"no log at {log_path}", file=sys.stderr)
        return 1
    with open(log_path, "rb") as handle:
        if args.tail is not None:
            lines = handle.read().splitlines(keepends=True)
            out.write(b"".join(lines[-args.tail :] if args.tail else []))
        while True:
            chunk = handle.read(1 << 16)
            if chunk:
                out.write(chunk)
                out.flush()
                continue
            if not args.follow:
                return 0
            state = _read_state(state_path) or {}
            if state.get("exit_code") is not None or not _alive(state.get("pid") or -1, state.get("pid_start_ticks")):
                out.write(handle.read())
                out.flush()
                return 0
            time.sleep(0.25)


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, from /proc (torchrun starts each worker in its own
    session, so killing the launcher's process group alone would orphan the workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        ppid = _stat_field(entry.name, 4)
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _signal_all(pids: dict[int, int | None], sig: int) -> None:
    """Signal each pid that is still the process we found (same start time): never a reused pid."""
    for pid, ticks in pids.items():
        if _alive(pid, ticks):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def stop(args: argparse.Namespace) -> int:
    _, state_path = _paths(args.job_dir, args.rank)
    state = _read_state(state_path) or {}
    pid = state.get("pid")
    if not pid or state.get("exit_code") is not None or not _alive(pid, state.get("pid_start_ticks")):
        return 0  # ended, or the pid now belongs to another process: nothing of ours to signal
    # Collect the tree before signalling: once the launcher dies its workers are re-parented.
    # Each pid with its start time: during the grace period an exited pid can be reused.
    tree = {p: _start_ticks(p) for p in descendants(pid)}
    # SIGTERM first: torchrun forwards it to the ranks, which can exit cleanly.
    _signal_all(tree, signal.SIGTERM)
    # Then SIGCONT (as systemd does): a stopped rank (SIGSTOP, a hang someone paused) cannot act on its
    # SIGTERM until continued, and would hold the stop for the whole grace; a running one ignores it.
    _signal_all(tree, signal.SIGCONT)
    deadline = time.monotonic() + args.grace
    while time.monotonic() < deadline and any(_alive(p, t) for p, t in tree.items()):
        time.sleep(0.2)
    _signal_all(tree, signal.SIGKILL)
    # Wait for the supervisor to record the exit code (it reaps the launcher), and for the tree to go.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (
        (_read_state(state_path) or {}).get("exit_code") is None or _survivors(tree)
    ):
        time.sleep(0.1)
    survivors = _survivors(tree)
    if survivors:
        # Unkillable (uninterruptible I/O, another user's process): say so, the controller reports it.
        print(f"rank {args.rank}: still running after SIGKILL: pids {' '.join(map(str, survivors))}", file=sys.stderr)
        return 1
    return 0


def _survivors(tree: dict[int, int | None]) -> list[int]:
    """The pids of ``tree`` still running (a zombie has ended: only its parent's wait is missing)."""
    return [pid for pid, ticks in tree.items() if _alive(pid, ticks) and _proc_state(pid) != "Z"]


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.runtimes.process")
    sub = parser.add_subparsers(dest="action", required=True)
    for name in ("start", "status", "follow", "stop", "run"):
        p = sub.add_parser(name)
        p.add_argument("--job-dir", required=True)
        # run: the rank may come from the scheduler's environment (SLURM_NODEID on each node).
        p.add_argument("--rank", type=int, required=name != "run", default=_env_rank())
        if name == "run":
            p.add_argument("--container")
        if name in ("start", "run"):
            p.add_argument("--env-file")
            p.add_argument("--env", action="append", default=[])
            p.add_argument("command", nargs=argparse.REMAINDER)
        if name == "follow":
            p.add_argument("--tail", type=int)
            p.add_argument("--no-follow", dest="follow", action="store_false")
        if name == "stop":
            p.add_argument("--grace", type=float, default=10.0)
    args = parser.parse_args(argv)
    if args.action in ("start", "run") and args.command and args.command[0] == "--":
        args.command = args.command[1:]
    return {"start": start, "status": status, "follow": follow, "stop": stop, "run": run}[args.action](args)


def _env_rank() -> int | None:
    value = os.environ.get("SLURM_NODEID")
    return int(value) if value and value.isdigit() else None


if __name__ == "__main__":
    sys.exit(main())
