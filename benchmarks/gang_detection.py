"""How long the gang watchdog takes to stop a node after another fails: measured, not assumed.

    .venv/bin/python benchmarks/gang_detection.py [--repeat 3]

Real processes and a real TCPStore on 127.0.0.1 (tests/gangnodes.py): a store
process (torchrun's agent on node 0 serves it) and one watchdog process per node,
each running orchestrator.train.gang.Watchdog as a node's local rank 0 does.
Scenarios, timed from the fault to the watching node's process exit:

- ``store lost``: SIGKILL the store and node 0 (node 0 gone); node 1 stops.
- ``silent node``: SIGSTOP node 1 (alive, sockets open, saying nothing); node 0 stops.

This is the watchdog's own detection. On a real job the node's ranks and launcher
end right after (gang.end_node kills the launcher); tests/test_e2e.py bounds the
whole path, kill to every node ended, with real training on test hosts.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from gangnodes import Gang  # noqa: E402

from orchestrator.train import gang  # noqa: E402

LIMIT_S = 120


def store_lost() -> float:
    with Gang() as nodes:
        nodes.signal("store", signal.SIGKILL)
        nodes.signal("node0", signal.SIGKILL)
        code, waited, stderr = nodes.exit_of("node1", timeout=LIMIT_S)
    assert code == gang.GANG_EXIT_CODE and "lost the rendezvous store" in stderr, (code, stderr)
    return waited


def silent_node() -> float:
    with Gang() as nodes:
        nodes.signal("node1", signal.SIGSTOP)
        code, waited, stderr = nodes.exit_of("node0", timeout=LIMIT_S)
    assert code == gang.GANG_EXIT_CODE and "node 1 stopped answering" in stderr, (code, stderr)
    return waited


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"gang watchdog: HEARTBEAT_S {gang.HEARTBEAT_S:g}, STALE_S {gang.STALE_S:g}; {args.repeat} runs each")
    for name, scenario in (("store lost", store_lost), ("silent node", silent_node)):
        times = [scenario() for _ in range(args.repeat)]
        runs = ", ".join(f"{t:.1f}" for t in times)
        print(f"{name:12} fault to stop: median {statistics.median(times):.1f} s, max {max(times):.1f} s ({runs})")


if __name__ == "__main__":
    main()
