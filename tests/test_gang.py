"""The gang watchdog's exits, with real processes and a real TCPStore (issue 13, item 7).

Each node is a process running orchestrator.train.gang's Watchdog against a store
served by another process, as torchrun's agent serves it on node 0 (tests/gangnodes.py).
Covered here: the store on node 0 disappearing (SIGKILL), a node that goes silent
without dying (SIGSTOP), and a bug inside the watchdog, which must not be reported
as a lost store. A rank's own failure mark and a killed node are covered end to end
in test_e2e.py. The seconds each detection took are measured by
benchmarks/gang_detection.py; here they are only bounded.
"""

from __future__ import annotations

import signal

import pytest
from gangnodes import STALE_S, Gang

from orchestrator.train import gang

# The watchdog notices at the first heartbeat past STALE_S (the watchers run with DZCTL_GANG_STALE_S,
# gangnodes.STALE_S); the rest is slack for a loaded machine.
BOUND_S = STALE_S + 2 * gang.HEARTBEAT_S + 10


def test_store_on_node_0_gone_stops_the_other_node():
    with Gang() as nodes:
        nodes.signal("store", signal.SIGKILL)  # node 0 lost: its agent, and with it the store
        nodes.signal("node0", signal.SIGKILL)
        code, waited, stderr = nodes.exit_of("node1", timeout=BOUND_S)
    assert code == gang.GANG_EXIT_CODE, (code, stderr)
    assert "dzctl gang: node 1 stops: lost the rendezvous store on the master node" in stderr, stderr
    assert waited >= STALE_S, waited  # not before the grace period: a slow store is not a lost one


def test_a_silent_node_stops_the_others():
    with Gang() as nodes:
        nodes.signal("node1", signal.SIGSTOP)  # alive, holding its sockets, saying nothing
        code, waited, stderr = nodes.exit_of("node0", timeout=BOUND_S)
    assert code == gang.GANG_EXIT_CODE, (code, stderr)
    assert "dzctl gang: node 0 stops: node 1 stopped answering for " in stderr, stderr
    assert waited >= STALE_S - gang.HEARTBEAT_S, waited


def test_a_node_that_starts_late_is_not_a_silent_one():
    # Nodes reach their watchdog at different times (one reads its data more slowly):
    # a counter never bumped is a node still starting, given 8 × STALE_S, not one gone quiet.
    with Gang(late=(1,)) as nodes:
        code, _, stderr = nodes.exit_of("node0", timeout=STALE_S + 3 * gang.HEARTBEAT_S)
        assert code is None, f"node 0 stopped while node 1 was still starting: exit {code}: {stderr}"
        nodes.start_node(1)
        nodes.wait_beating()
        assert nodes.procs["node0"].poll() is None


def test_a_bug_in_the_watchdog_is_not_a_lost_store():
    with Gang(bad_check=(1,)) as nodes:
        code, _, stderr = nodes.exit_of("node1", timeout=BOUND_S)
        assert code is None, f"the job was stopped over a watchdog bug: exit {code}: {stderr}"
        # Node 1 kept beating after its bug (BOUND_S > STALE_S), so node 0 did not take it for lost.
        assert nodes.procs["node0"].poll() is None, nodes.exit_of("node0", timeout=1)
        nodes.signal("node1", signal.SIGTERM)
        _, _, stderr = nodes.exit_of("node1", timeout=30)
    assert "lost the rendezvous store" not in stderr, stderr
    assert "dzctl gang: node 1: the watchdog itself failed (TypeError: check(): incompatible" in stderr, stderr
    assert "a bug in dzctl" in stderr


def test_the_grace_period_is_the_default_unless_the_variable_sets_a_workable_one():
    assert gang.stale_seconds({}) == gang.STALE_DEFAULT_S == 15.0
    assert gang.stale_seconds({"DZCTL_GANG_STALE_S": "40"}) == 40.0
    for bad in ("abc", "0", "-3", "5"):  # under three heartbeats, one late beat would look like a lost node
        with pytest.raises(ValueError, match="DZCTL_GANG_STALE_S"):
            gang.stale_seconds({"DZCTL_GANG_STALE_S": bad})
