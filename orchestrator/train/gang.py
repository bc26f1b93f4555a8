"""Gang failure: when one node's ranks die, every other node's ranks stop within seconds.

Without this, a node killed mid-run leaves the others blocked in a collective
until NCCL's (or gloo's) 30-minute timeout, holding their GPUs. It works with
or without a dzctl process attached, because the nodes watch each other:

- on each node, local rank 0 bumps a heartbeat counter in the job's rendezvous
  store (the TCPStore that torchrun's agent serves on master_addr:master_port)
  every HEARTBEAT_S, and reads every other node's counter;
- a node whose counter has not moved for STALE_S, a failure mark set by a rank
  that raised, or the store itself gone (node 0 died) makes the watcher print
  why and end its process: torchrun then stops the node's other ranks and
  exits non-zero, and so does the container.

Counters rather than timestamps: nodes' clocks may differ; each watcher only
compares a counter against its own monotonic clock.

The heartbeat says the node's rank *exists*, not that it makes progress: in a training job it
comes from a small forked child of local rank 0 (``dzctl-heartbeat``), which beats while its
parent is there, stopped or not. A rank that is alive but stuck (SIGSTOPped, in uninterruptible
I/O, blocked in a read, waiting in a collective a peer never joins) is a hang, not a lost node:
stall detection (observe/stall.py) finds it, takes every rank's stack first, then names the
culprit. Were the beat in the rank itself, a stopped rank would silence it, and the others would
end their nodes after STALE_S, before anyone could look. A node that freezes whole, or whose
network is cut, stops the child too: still a lost node.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

HEARTBEAT_S = 2.0
STALE_DEFAULT_S = 15.0  # well inside the 30 s promise, well above a GC pause or a slow store round trip
STALE_VARIABLE = "DZCTL_GANG_STALE_S"


def stale_seconds(environ=os.environ) -> float:
    """How long a node may go without news before the others stop: ``DZCTL_GANG_STALE_S``, else 15 s.

    A site whose store is slow to answer may raise it; the tests lower it, so that each of their
    cases waits seconds rather than the default (the detection itself is the same code).
    """
    text = environ.get(STALE_VARIABLE, "").strip()
    if not text:
        return STALE_DEFAULT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value >= 3 * HEARTBEAT_S:
        # Below three heartbeats one late beat would read as a lost node.
        raise ValueError(f"{STALE_VARIABLE}={text!r}: give a number of seconds of at least {3 * HEARTBEAT_S:g}")
    return value


STALE_S = stale_seconds()
GANG_EXIT_CODE = 75  # EX_TEMPFAIL: "stopped because another node failed"
# What talking to a lost or unreachable store raises: torch's DistError family (DistNetworkError,
# DistStoreError: RuntimeError subclasses) and socket errors (OSError). Anything else is a bug here,
# and must not be reported as a lost store (nor stop a healthy job).
STORE_ERRORS = (RuntimeError, OSError)

_watchdog: Watchdog | None = None
# The launcher (torchrun) that started this rank. If it has died since, our
# parent is now a subreaper or init: end_node must not signal that one.
LAUNCHER_PID = os.getppid()


class Watchdog:
    def __init__(self, store, job_key: str, node_rank: int, num_nodes: int, beats: bool = True) -> None:
        self.store = store
        self.beats = beats  # False: a heartbeat child beats for this node (start_heartbeat_child)
        self.prefix = f"dzctl/gang/{job_key}"
        self.node_rank = node_rank
        self.num_nodes = num_nodes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dzctl-gang", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> None:
        """This node ended well: the others must not take its silence for a failure."""
        self._stop.set()
        with contextlib.suppress(Exception):  # a vanished store has nobody left to tell
            self.store.set(f"{self.prefix}/done/{self.node_rank}", "1")

    def mark_failed(self, reason: str) -> int | None:
        """Tell the other nodes to stop now instead of after STALE_S.

        Returns this failure's place in the job (1 = the first node to report one), counted by the
        store on the master: one counter every node increments, so the order holds whatever the
        nodes' clocks say. None when the store cannot be reached."""
        with contextlib.suppress(Exception):  # the store may be the thing that failed
            self.store.set(f"{self.prefix}/failed", f"node {self.node_rank}: {reason}"[:500])
            return int(self.store.add(f"{self.prefix}/failures", 1))
        return None

    def _run(self) -> None:
        seen = {n: (-1, time.monotonic()) for n in range(self.num_nodes) if n != self.node_rank}
        done: set[int] = set()
        store_lost_since: float | None = None
        try:
            while not self._stop.wait(HEARTBEAT_S):
                now = time.monotonic()
                try:
                    self._check_once(seen, done, now)
                    store_lost_since = None
                except STORE_ERRORS as exc:
                    if 0 in done:
                        return  # node 0 finished and its agent took the store with it: nothing to watch
                    store_lost_since = store_lost_since or now
                    if now - store_lost_since > STALE_S:
                        self._abort(f"lost the rendezvous store on the master node ({type(exc).__name__}: {exc})")
        except Exception as exc:
            # A bug in this file, not a failed node: say so plainly and leave the job running. This
            # node stops watching but keeps beating, or the others would take its silence for a loss.
            print(
                f"dzctl gang: node {self.node_rank}: the watchdog itself failed ({type(exc).__name__}: {exc}); "
                "this node no longer watches the others, only heartbeats (a bug in dzctl: please report it)",
                file=sys.stderr,
                flush=True,
            )
            traceback.print_exc()
            self._heartbeat_only()

    def _heartbeat_only(self) -> None:
        while self.beats and not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(*STORE_ERRORS):
                self.store.add(f"{self.prefix}/hb/{self.node_rank}", 1)

    def _check_once(self, seen: dict[int, tuple[int, float]], done: set[int], now: float) -> None:
        if self.beats:
            self.store.add(f"{self.prefix}/hb/{self.node_rank}", 1)
        if self.store.add(f"{self.prefix}/failures", 0) > 0:
            why = self.store.get(f"{self.prefix}/failed").decode(errors="replace")
            self._abort(f"another node failed ({why})")
        for node, (count, since) in seen.items():
            if node in done or self.store.check([f"{self.prefix}/done/{node}"]):
                done.add(node)  # it finished its part; its silence is expected
                continue
            current = self.store.add(f"{self.prefix}/hb/{node}", 0)
            if current != count:
                seen[node] = (current, now)
            # A counter at 0 has never been bumped (add on a missing key reads 0): that node has
            # not reached its watchdog yet (slower data loading, say), which is not silence.
            elif count > 0 and now - since > STALE_S:
                self._abort(f"node {node} stopped answering for {now - since:.0f} s (killed or lost)")
            elif count <= 0 and now - since > STALE_S * 8:
                # A node that never beat: it died while loading (the others waited in a collective).
                self._abort(f"node {node} never started its heartbeat")

    def _abort(self, reason: str) -> None:
        print(f"dzctl gang: node {self.node_rank} stops: {reason}", file=sys.stderr, flush=True)
        end_node(GANG_EXIT_CODE)
        os._exit(GANG_EXIT_CODE)


def end_node(code: int) -> None:
    """End this node's part of a multi-node job now: its launcher first, then this rank.

    Returns (doing nothing) outside a multi-node job under a launcher.

    Measured on the test hosts: after a peer died, a failed rank took ~11 s to
    finish Python's teardown and torchrun ~35 s more to close its worker group,
    well past the 30 s promise. Killing the launcher ends the node at once: in a
    container the init process (``docker run --init``) then exits and the kernel
    ends every process in it; under ``runtime: process`` the supervisor, a child
    subreaper, kills what is left. os._exit, because a rank blocked in a
    collective never returns to Python to exit cleanly.
    """
    if int(os.environ.get("DZCTL_NUM_NODES", "1")) < 2 or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    if os.getppid() == LAUNCHER_PID:
        with contextlib.suppress(OSError):
            os.kill(LAUNCHER_PID, signal.SIGKILL)
    os._exit(code)


def start_watchdog() -> Watchdog | None:
    """Start watching the other nodes (local rank 0 only; multi-node jobs only)."""
    global _watchdog
    num_nodes = int(os.environ.get("DZCTL_NUM_NODES", "1"))
    if num_nodes < 2 or int(os.environ.get("LOCAL_RANK", "0")) != 0 or _watchdog is not None:
        return None
    job_key = os.environ.get("DZCTL_JOB_ID", "job")
    node_rank = int(os.environ.get("DZCTL_NODE_RANK", os.environ.get("GROUP_RANK", "0")))
    child = start_heartbeat_child(f"dzctl/gang/{job_key}/hb/{node_rank}")
    _watchdog = Watchdog(_client(), job_key, node_rank, num_nodes, beats=child is None)
    _watchdog.start()
    return _watchdog


def _client():
    from torch.distributed import TCPStore

    return TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=10),
        wait_for_workers=False,
    )


HEARTBEAT_COMM = b"dzctl-heartbeat"  # its name in ps and /proc/PID/comm (runtimes/rankprobe.py skips it)


def start_heartbeat_child(key: str) -> int | None:
    """Fork the process that bumps ``key`` every HEARTBEAT_S while this rank exists; its pid (None: no fork).

    From the main thread, which lives as long as the rank: the child asks the kernel for SIGKILL
    when its parent ends (PR_SET_PDEATHSIG) and also checks its parent each beat, so it never
    outlives the rank. It closes every descriptor it inherited (the process group's sockets: a
    peer must see this rank's connections close when it dies) and opens its own store client. It
    touches nothing else of the parent: no CUDA, no collective, no Python logging.
    """
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        return None  # no fork: the watchdog thread beats, as before
    if pid:
        return pid
    try:  # the child
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        libc.prctl(15, ctypes.c_char_p(HEARTBEAT_COMM), 0, 0, 0)  # PR_SET_NAME
        if os.getppid() != parent:
            os._exit(0)  # the parent ended before the death signal was armed
        os.closerange(3, os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 65536)
        store = None
        while os.getppid() == parent:
            try:  # a store that is gone for good: the parent's watchdog sees it and ends the node
                store = store or _client()
                store.add(key, 1)
            except STORE_ERRORS:
                store = None
            time.sleep(HEARTBEAT_S)
    finally:
        os._exit(0)


def finish() -> None:
    if _watchdog is not None:
        _watchdog.finish()


def report_failure(reason: str) -> int | None:
    """Tell the other nodes; returns the store's sequence number of this failure (see mark_failed)."""
    return _watchdog.mark_failed(reason) if _watchdog is not None else None
