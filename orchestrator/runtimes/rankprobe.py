"""The node side of a stall's evidence: each rank's process state and Python stack, nothing stopped.

    python -m orchestrator.runtimes.rankprobe --dir RANK_FILES_DIR [--job-dir D --rank R] [--wait S]

Prints one JSON object: ``ranks`` [{rank, pid, state, wchan, blocked_on, stack, nccl_trace}] and
``gpus`` [{index, utilization}] (where ``nvidia-smi`` exists). Standard library only: it runs on
the node with the trainer's Python, or inside the rank's container (``docker exec``).

The ranks are the ``orchestrator.train`` processes below the node's launcher (``--job-dir``/
``--rank``: the process runtime's record names it) or, in a container, every such process. For
each: its state from /proc (R running, S sleeping, T stopped, D uninterruptible I/O), the kernel
function it sleeps in, the system call its main thread is blocked in and on what (a read of a
FIFO is told from a peer's socket), then its Python stack:

- SIGUSR1, which the trainer's ``faulthandler.register`` (train/hang/stacks.py) answers by appending
  every thread's stack to ``rank-R.stacks`` from C, even while Python is stuck in a collective.
  Sent only when /proc says the rank catches SIGUSR1: to a rank still starting, the signal's
  default action would kill it;
- a stopped rank (T) cannot run a handler: it gets SIGUSR1, then SIGCONT for the instant of the
  dump, and SIGSTOP again once the file has grown. The stack is the one it stopped in (the
  handler runs before the rank returns to its own code);
- ``py-spy dump``, when installed, instead of the signal (it reads a stopped rank as it is).

GPU ranks: a write to the rank's NCCL debug pipe (``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``, set at
launch) makes ProcessGroupNCCL dump its flight recorder (the last collectives, with sequence
numbers) to ``nccl-trace-rank-R``; its size is reported, the file stays with the rank's files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from .process import descendants  # the same tree the process runtime stops

SIGUSR1_BIT = 1 << (signal.SIGUSR1 - 1)
# x86_64 and aarch64 numbers of the blocking calls worth naming (the rest are told by number).
_SYSCALLS = {
    "x86_64": {0: "read", 17: "pread64", 19: "readv", 257: "openat", 2: "open", 202: "futex", 7: "poll",
               271: "ppoll", 232: "epoll_wait", 281: "epoll_pwait", 45: "recvfrom", 47: "recvmsg", 35: "nanosleep"},
    "aarch64": {63: "read", 67: "pread64", 65: "readv", 56: "openat", 98: "futex", 73: "ppoll",
                22: "epoll_pwait", 207: "recvfrom", 212: "recvmsg", 101: "nanosleep"},
}  # fmt: skip
_READS = ("read", "pread64", "readv")
HEARTBEAT_COMM = "dzctl-heartbeat"  # the trainer's heartbeat child (train/gang.py): not a rank


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _state(pid: int) -> str | None:
    text = _read(f"/proc/{pid}/stat")
    return text.rpartition(")")[2].split()[0] if text else None


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _catches_usr1(pid: int) -> bool:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & SIGUSR1_BIT)
    return False


def blocked_on(pid: int) -> dict | None:
    """The system call the main thread sleeps in and, for a read, what it reads (a FIFO, a file, a socket)."""
    words = _read(f"/proc/{pid}/syscall").split()
    if not words or not words[0].lstrip("-").isdigit() or int(words[0]) < 0:
        return None
    table = _SYSCALLS.get(os.uname().machine, {})
    name = table.get(int(words[0]), f"syscall {words[0]}")
    found: dict = {"syscall": name, "kind": None, "path": None}
    if name in _READS and len(words) > 1:
        fd = int(words[1], 16)
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            found["path"] = target
            if target.startswith("socket:"):
                found["kind"] = "socket"
            elif target.startswith("pipe:"):
                found["kind"] = "pipe"
            else:
                mode = os.stat(f"/proc/{pid}/fd/{fd}").st_mode
                found["kind"] = "FIFO" if stat.S_ISFIFO(mode) else "file"
    return found


def is_rank(pid: int) -> bool:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if Path(f"/proc/{pid}/cmdline").exists() else []
    launcher = any(b"torch.distributed.run" in a or b"deepspeed.launcher" in a or a.endswith(b"torchrun") for a in argv)
    return (
        b"orchestrator.train" in argv
        and not launcher
        and _read(f"/proc/{pid}/comm").strip() != HEARTBEAT_COMM
        and "RANK" in _environ(pid)
    )


def rank_pids(job_dir: str | None, node_rank: int | None) -> list[int]:
    if job_dir is not None:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            root = json.loads(Path(job_dir, f"rank-{node_rank}.json").read_text())["pid"]
            candidates = descendants(int(root))
            return [p for p in candidates if _safe(is_rank, p)]
        return []
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _safe(is_rank, int(e.name))]


def _safe(check, pid: int) -> bool:
    try:
        return check(pid)
    except OSError:
        return False


def probe_rank(pid: int, files: Path, wait_s: float) -> dict:
    env = _environ(pid)
    rank = int(env["RANK"]) if env.get("RANK", "").isdigit() else None
    found = {
        "rank": rank,
        "pid": pid,
        "state": _state(pid),
        "wchan": _read(f"/proc/{pid}/wchan").strip() or None,
        "blocked_on": blocked_on(pid),
        "stack": None,
        "stack_via": None,
        "nccl_trace": None,
    }
    stacks = files / f"rank-{rank}.stacks"
    found["stack"], found["stack_via"] = _stack(pid, found["state"], stacks, wait_s)
    pipe = files / f"nccl-pipe-rank-{rank}.pipe"
    if pipe.exists():
        found["nccl_trace"] = _nccl_dump(pipe, files / f"nccl-trace-rank-{rank}", wait_s)
    return found


def _stack(pid: int, state: str | None, stacks: Path, wait_s: float) -> tuple[str | None, str | None]:
    spy = shutil.which("py-spy")
    if spy:
        done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=wait_s + 20)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout, "py-spy"
    if not _catches_usr1(pid):
        return None, "the rank has not registered its stack handler yet (still starting)"
    before = stacks.stat().st_size if stacks.exists() else 0
    os.kill(pid, signal.SIGUSR1)
    stopped = state == "T"
    if stopped:
        os.kill(pid, signal.SIGCONT)  # only for the dump: stopped again below, as it was found
    deadline = time.monotonic() + wait_s
    # A stopped rank runs only until its dump is whole (the file has grown and then held its size for
    # 5 ms: a dump takes about a millisecond), so that it cannot end a step meanwhile; a running one
    # gets a longer settle.
    settle = 0.005 if stopped else 0.2
    size, still_since = before, None
    try:
        while time.monotonic() < deadline:
            now_size = stacks.stat().st_size if stacks.exists() else 0
            if now_size > before and now_size == size:
                still_since = still_since or time.monotonic()
                if time.monotonic() - still_since >= settle:
                    break
            else:
                still_since = None
            size = now_size
            time.sleep(0.001 if stopped else 0.02)
    finally:
        if stopped:
            os.kill(pid, signal.SIGSTOP)
    if size <= before:
        return None, f"no stack within {wait_s:g} s of SIGUSR1"
    with open(stacks, "rb") as handle:
        handle.seek(before)
        return handle.read().decode(errors="replace"), "faulthandler (SIGUSR1)"


def _nccl_dump(pipe: Path, trace: Path, wait_s: float) -> dict:
    before = trace.stat().st_mtime if trace.exists() else None
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)  # never block on a pipe nobody reads
        try:
            os.write(fd, b"1\n")
        finally:
            os.close(fd)
    except OSError as exc:
        return {"path": str(trace), "ok": False, "error": f"the NCCL debug pipe did not answer: {exc.strerror}"}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if trace.exists() and trace.stat().st_mtime != before and trace.stat().st_size > 0:
            return {"path": str(trace), "ok": True, "bytes": trace.stat().st_size}
        time.sleep(0.1)
    return {"path": str(trace), "ok": False, "error": f"no flight-recorder dump within {wait_s:g} s"}


def gpu_utilization() -> list[dict] | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    done = subprocess.run([smi, "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=20)  # fmt: skip
    rows = [line.split(",") for line in done.stdout.splitlines() if "," in line]
    return [{"index": int(i), "utilization": int(u)} for i, u in rows if i.strip().isdigit() and u.strip().isdigit()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.runtimes.rankprobe")
    parser.add_argument("--dir", required=True, type=Path, help="the job's rank files on this node")
    parser.add_argument("--job-dir")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--wait", type=float, default=10.0)
    args = parser.parse_args(argv)
    pids = rank_pids(args.job_dir, args.rank)
    ranks = [probe_rank(pid, args.dir, args.wait) for pid in pids]
    ranks.sort(key=lambda r: (r["rank"] is None, r["rank"] or 0))
    print(json.dumps({"ranks": ranks, "gpus": gpu_utilization()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
