"""A rank blocked reading a FIFO (issue 45, case c) is named from real evidence: two real gloo ranks on this
machine, the node-side probe (runtimes/rankprobe.py) on their real /proc and faulthandler dumps, then the culprit
rule (observe/culprit.py). Cheap: two small processes, no launch; the 2-host launch is test_hang_recovery.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from orchestrator.observe.culprit import collective_of, name_culprit
from orchestrator.runtimes import rankprobe

HERE = Path(__file__).resolve().parent


def _port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def test_a_rank_blocked_reading_a_fifo_is_named_with_the_collective_the_other_waits_in(tmp_path):
    fifo = tmp_path / "hung-nfs"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # a writer that never writes: the reader's read() blocks, open() does not
    port, out = _port(), tmp_path / "out"
    env = {**os.environ, "DZCTL_JOB_ID": "job-fifo"}
    argv = [[sys.executable, str(HERE / "hangrank.py"), "0", "2", port, str(out), "--collective"],
            [sys.executable, str(HERE / "hangrank.py"), "1", "2", port, str(out), "--read", str(fifo)]]  # fmt: skip
    # RANK in the environment the process starts with, as torchrun gives it: the probe reads /proc/PID/environ.
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "RANK": str(i)})
             for i, a in enumerate(argv)]  # fmt: skip
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
        files = out / "dzctl-ranks" / "job-fifo"
        deadline = time.monotonic() + 30
        while rankprobe.blocked_on(procs[1].pid) is None or rankprobe.blocked_on(procs[1].pid)["syscall"] != "read":
            assert time.monotonic() < deadline, rankprobe.blocked_on(procs[1].pid)
            time.sleep(0.1)
        # Rank 0 printed "ready" just before its all_reduce: ask until it is inside (each ask is one dump).
        while collective_of((first := rankprobe.probe_rank(procs[0].pid, files, wait_s=10))["stack"]) is None:
            assert time.monotonic() < deadline, first
            time.sleep(0.2)
        ranks = [first, rankprobe.probe_rank(procs[1].pid, files, wait_s=10)]
        assert all(r["stack_via"] == "faulthandler (SIGUSR1)" for r in ranks), ranks
        assert ranks[1]["blocked_on"] == {"syscall": "read", "kind": "FIFO", "path": str(fifo)}
        assert all(p.poll() is None for p in procs), "the probe must leave the ranks as it found them"
        nodes = [{"node_rank": 0, "host": "node0", "reachable": True, "ranks": [ranks[0]]},
                 {"node_rank": 1, "host": "node1", "reachable": True, "ranks": [ranks[1]]}]  # fmt: skip
        culprit = name_culprit(nodes, step=12)
        assert culprit["kind"] == "blocked-read" and culprit["ranks"] == [1] and culprit["host"] == "node1"
        assert culprit["collective"] == "all_reduce" and culprit["waiting_ranks"] == [0]
        assert culprit["line"] == (
            f"culprit: rank 1 on node 1 (node1) blocked in read of {fifo} (FIFO); rank 0 waits in all_reduce; step 13"
        )
        assert culprit["suspect_hosts"] == ["node1"]
        # The stacks are kept beside the rank's files, one per rank.
        assert "in all_reduce" in (files / "rank-0.stacks").read_text()
        assert "in main" in (files / "rank-1.stacks").read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        os.close(writer)
