"""`dzctl status` names the first failure by what the nodes say, not by their clocks (real test hosts).

Two process-runtime ranks started by the real `nodeexec start`: node 1 is killed outright; node 0
ends as the gang watchdog ends a node (its line in the log, then SIGKILL). Node 0's clock is made to
run 60 s behind by rewriting the end time its supervisor recorded, the one value of a node's clock
that status reads; by end times node 0 would then have failed first.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_stop import _record, _status

pytestmark = [pytest.mark.integration]

GANG_STOP = (
    'echo "dzctl gang: node 0 stops: node 1 stopped answering for 16 s (killed or lost)" >&2; sleep 1; kill -9 $$'
)


def test_status_names_the_killed_node_first_though_the_other_nodes_clock_is_behind(cluster, tmp_path):
    hosts = cluster(2)
    job_id = "ffjob-20261130-000000-cccc"
    remote = f"/var/tmp/dzctl-ff-{hosts.cid}"
    home = tmp_path / "home"
    _record(home, hosts, "process", job_id, sys.executable, remote)
    commands = [["sh", "-c", GANG_STOP], ["sh", "-c", "kill -9 $$"]]
    for rank, host in reversed(list(enumerate(hosts.hosts))):  # node 1 first: it is the one killed first
        job_dir = f"{remote}/{host.name}/jobs/{job_id}"
        argv = [sys.executable, "-m", "orchestrator.runtimes.process", "start", "--job-dir", job_dir,
                "--rank", str(rank), "--", *commands[rank]]  # fmt: skip
        started = subprocess.run(hosts.ssh_argv(host, [shlex.join(argv)]), capture_output=True, text=True, timeout=60)
        assert started.returncode == 0, started.stderr
    records = [Path(f"{remote}/{h.name}/jobs/{job_id}/rank-{r}.json") for r, h in enumerate(hosts.hosts)]
    deadline = time.monotonic() + 30
    while not all(json.loads(p.read_text()).get("finished") for p in records):
        assert time.monotonic() < deadline, "the ranks did not end"
        time.sleep(0.2)
    node0 = json.loads(records[0].read_text())
    node1 = json.loads(records[1].read_text())
    assert node0["finished"] > node1["finished"]  # in truth node 1 ended first
    node0["finished"] = node1["finished"] - 60.0  # node 0's clock runs a minute behind
    records[0].write_text(json.dumps(node0))

    status = _status(home)
    assert [n["exit_code"] for n in status["nodes"]] == [137, 137]
    assert status["state"] == "failed"
    assert status["first_failure"]["node_rank"] == 1, status["first_failure"]
    assert status["first_failure"]["host"] == hosts.hosts[1].name
