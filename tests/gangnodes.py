"""Real gang-watchdog nodes for tests and benchmarks/gang_detection.py: one process each, one real TCPStore.

``python gangnodes.py store PORT`` serves the rendezvous store (what torchrun's agent
does on node 0); ``python gangnodes.py watch PORT NODE_RANK NUM_NODES [--bad-check]``
runs orchestrator.train.gang's Watchdog as that node's local rank 0 does. A watcher
that decides to stop prints why and exits with gang.GANG_EXIT_CODE.

``--bad-check``: the store's ``check`` raises TypeError, as a call that no longer
matches torch's signature would: a bug in the watchdog, with the store healthy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = "gangtest"
STALE_S = 6.0  # the watchers' DZCTL_GANG_STALE_S: three heartbeats


class BadCheck:
    """The real store, except ``check``: a wrong call inside the watchdog."""

    def __init__(self, store) -> None:
        self._store = store

    def __getattr__(self, name):
        return getattr(self._store, name)

    def check(self, keys):
        raise TypeError("check(): incompatible function arguments")


def _serve(port: int) -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    print("ready", flush=True)
    while True:
        time.sleep(60)
        store.check(["-"])  # keep a reference


def _watch(port: int, node_rank: int, num_nodes: int, bad_check: bool) -> None:
    from torch.distributed import TCPStore

    from orchestrator.train import gang

    store = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
    gang.Watchdog(BadCheck(store) if bad_check else store, JOB, node_rank, num_nodes).start()
    print("watching", flush=True)
    while True:
        time.sleep(60)


@dataclass
class Gang:
    """A store process and one watcher process per node, on a free port of 127.0.0.1."""

    num_nodes: int = 2
    bad_check: tuple[int, ...] = ()
    late: tuple[int, ...] = ()  # nodes not started on entry: start_node() them later
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __enter__(self) -> Gang:
        self.port = _free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        for name in ("DZCTL_NUM_NODES", "TORCHELASTIC_RUN_ID"):  # end_node: only this process ends
            env.pop(name, None)
        # A shorter grace than the default 15 s: each case waits it out (the e2e tests keep the default).
        env["DZCTL_GANG_STALE_S"] = str(STALE_S)
        self.env = env
        try:
            self.procs["store"] = self._spawn(["store", str(self.port)], "ready")
            for node in range(self.num_nodes):
                if node not in self.late:
                    self.start_node(node)
            self.wait_beating()
        except BaseException:
            self.__exit__()  # `with` calls __exit__ only once __enter__ has returned: end what started
            raise
        return self

    def start_node(self, node: int) -> None:
        argv = ["watch", str(self.port), str(node), str(self.num_nodes)]
        self.procs[f"node{node}"] = self._spawn(argv + (["--bad-check"] if node in self.bad_check else []))

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(timeout=30)

    def _spawn(self, argv: list[str], ready: str = "watching") -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, __file__, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env
        )
        line = proc.stdout.readline().strip()
        if line != ready:
            proc.kill()
            raise RuntimeError(f"{argv}: {line!r} {proc.stderr.read()[-2000:]}")
        return proc

    def wait_beating(self, timeout: float = 60) -> None:
        """Until every node's heartbeat counter has moved (the watchers beat every HEARTBEAT_S)."""
        from torch.distributed import TCPStore

        probe = TCPStore("127.0.0.1", self.port, is_master=False, wait_for_workers=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(probe.add(f"dzctl/gang/{JOB}/hb/{n}", 0) > 0 for n in self.started()):
                return
            time.sleep(0.5)
        raise RuntimeError("the watchers never beat")

    def started(self) -> list[int]:
        return [n for n in range(self.num_nodes) if f"node{n}" in self.procs]

    def exit_of(self, name: str, timeout: float) -> tuple[int | None, float, str]:
        """(exit code or None if still running, seconds waited, stderr so far) of one process."""
        proc = self.procs[name]
        started = time.monotonic()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - started, ""
        return proc.returncode, time.monotonic() - started, proc.stderr.read()

    def signal(self, name: str, signum: int) -> None:
        os.kill(self.procs[name].pid, signum)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    if sys.argv[1] == "store":
        _serve(int(sys.argv[2]))
    else:
        _watch(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), "--bad-check" in sys.argv)
