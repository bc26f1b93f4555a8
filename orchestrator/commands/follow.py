"""Following a running job: merged, rank-prefixed output until every node has ended."""

from __future__ import annotations

import sys
import time

import click

from ..observe import gather_status, node_states, stop_nodes, stream_logs
from ..ssh import HostPool
from ..status import JobStatus, state_failed
from ..store import JobRecord, JobStore

POLL_S = 2.0


def follow_job(record: JobRecord, pool: HostPool, store: JobStore, *, quiet: bool = False) -> JobStatus:
    """Stream logs, stop the others when one rank fails, record and return the final status.

    The trainers' own gang watchdog stops the other nodes even with no dzctl
    attached; an attached dzctl does it at once, on the first failed poll.
    """
    write = (lambda text: (sys.stderr.write(text), sys.stderr.flush())) if quiet else None
    threads = stream_logs(record, pool, ranks=None, tail=None, follow=True, write=write)
    gang_stopped = False
    try:
        while True:
            states = node_states(record, pool)
            running = [r for r, s in states.items() if s.state in ("running", "created")]
            failed = [r for r, s in states.items() if state_failed(s.state, s.exit_code)]
            if failed and running and not gang_stopped:
                click.echo(
                    f"dzctl: rank {failed[0]} failed; stopping the other node(s): {', '.join(map(str, running))}",
                    err=True,
                )
                stop_nodes(record, pool, remove=False, ranks=running)
                gang_stopped = True
                continue
            if not running:
                break
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        click.echo(f"\ndzctl: detached; the job keeps running. Stop it with: dzctl stop {record.job_id}", err=True)
        raise SystemExit(130) from None
    for thread in threads:
        thread.join(timeout=10)  # the log streams end with their ranks
    status = gather_status(store.get(record.job_id), pool)
    store.set_state(record.job_id, status.state)
    return status
