"""`stop` of a process rank whose process is stopped (SIGSTOP, state T): a stopped process cannot act on
SIGTERM until it is continued, so the stop sends SIGCONT after SIGTERM (as systemd does) and the rank
ends at once, not after the whole grace period and a SIGKILL. A hung rank a user or the hang test
(tests/test_hang_recovery.py) stopped is the case: the supervisor's stop of the gang waited 10 s on it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = """
import signal, subprocess, sys
worker = subprocess.Popen(["sleep", "300"])
signal.signal(signal.SIGTERM, lambda *_: worker.terminate())
code = worker.wait()
sys.exit(128 - code if code < 0 else code)
"""


def _nodeexec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.runtimes.process", *args], capture_output=True, text=True, timeout=60
    )


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_stopped_process_of_the_rank_ends_on_sigterm_well_inside_the_grace(tmp_path):
    # A launcher that, like torchrun, forwards SIGTERM to its worker and waits for it (had it died at once,
    # the kernel would continue its orphaned, stopped worker itself), and the worker that gets SIGSTOP.
    started = _nodeexec("start", "--job-dir", str(tmp_path), "--rank", "0", "--", sys.executable, "-c", LAUNCHER)
    assert started.returncode == 0, started.stderr
    launcher = json.loads(started.stdout)["pid"]
    deadline = time.monotonic() + 10
    while not _children(launcher):
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    [worker] = _children(launcher)
    os.kill(worker, signal.SIGSTOP)
    while Path(f"/proc/{worker}/stat").read_text().rpartition(")")[2].split()[0] != "T":
        assert time.monotonic() < deadline, "the worker was not stopped"
        time.sleep(0.05)

    began = time.monotonic()
    stopped = _nodeexec("stop", "--job-dir", str(tmp_path), "--rank", "0", "--grace", "10")
    took = time.monotonic() - began
    assert stopped.returncode == 0, stopped.stderr
    # Well inside the 10 s grace: the worker took its SIGTERM (not the SIGKILL after the grace).
    assert took < 5, f"stop took {took:.1f} s"
    status = json.loads(_nodeexec("status", "--job-dir", str(tmp_path), "--rank", "0").stdout)
    assert (status["state"], status["exit_code"]) == ("exited", 143)
    assert not Path(f"/proc/{worker}").exists()
