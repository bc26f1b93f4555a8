"""Following a running job until every node has ended: a live view, plain lines, or the raw stream.

The fetching lives here (log streams, node-state polls, gang stop); what is
shown is worked out by ``watchstate`` (pure) and drawn by ``view`` (a terminal)
or ``lines`` (a pipe, CI, a file).
"""

from __future__ import annotations

import sys
import threading
import time

import click

from ..observe.evidence import stall_of
from ..observe.hosts import gather_status, node_states, stop_nodes, stream_logs
from ..observe.lines import event_line, final_lines, message_line, stall_line
from ..observe.status import JobStatus, derive_state, node_status, state_failed
from ..observe.store import JobRecord, JobStore
from ..observe.watchstate import JobWatch, NodeView
from ..transport.pool import HostPool

POLL_S = 2.0
STREAM_CHECK_S = 0.05  # how often the wait between polls looks whether a node's log stream ended
MODES = ("live", "lines", "raw")


def output_mode(raw: bool, stream=None) -> str:
    """A terminal gets the live view; a pipe or a file plain lines; ``--raw`` the ranks' own stream."""
    if raw:
        return "raw"
    stream = stream or sys.stdout
    return "live" if stream.isatty() else "lines"


def new_watch(record: JobRecord) -> JobWatch:
    nodes = [NodeView(n["node_rank"], n["host"], n["slots"]) for n in record.plan["nodes"]]
    accelerator = record.spec.get("accelerator", "gpu") if isinstance(record.spec, dict) else "gpu"
    started = record.created or time.time()
    return JobWatch(
        record.name, record.job_id, nodes, started_at=started, accelerator=accelerator, speed=record.plan.get("speed")
    )


def follow_job(
    record: JobRecord,
    pool: HostPool,
    store: JobStore,
    *,
    quiet: bool = False,
    mode: str = "raw",
    stop_gang: bool = True,
    report_failure: bool = True,
) -> JobStatus:
    """Follow the job, stop the others when one rank fails, record and return the final status.

    ``quiet`` (``--json``): whatever is shown goes to stderr, stdout is kept for the
    one JSON object. ``stop_gang``: ``launch --follow`` stops the surviving nodes
    at the first failed poll; ``status --watch`` only looks. (The trainers' own
    gang watchdog stops them too, with no dzctl attached, within its stale time.)
    ``report_failure``: the plain lines end with the first failure and its fix; ``launch``
    turns it off, since it reports the failure itself as its error (said once, last).
    """
    out = sys.stderr if quiet else sys.stdout
    watch = new_watch(record)
    lock = threading.Lock()
    live = None
    if mode == "raw":
        write = (lambda text: (out.write(text), out.flush())) if quiet else None
        threads = stream_logs(record, pool, ranks=None, tail=None, follow=True, write=write)
    else:

        def on_lines(node_rank: int, text: str) -> None:
            now = time.time()
            with lock:
                for line in text.splitlines():
                    new = watch.feed(node_rank, line, now)
                    if mode == "lines" and new is not None:
                        kind, item = new
                        shown = event_line(item, watch) if kind == "event" else message_line(item)
                        if shown:
                            out.write(shown + "\n")
                out.flush()

        threads = stream_logs(record, pool, ranks=None, tail=None, follow=True, on_lines=on_lines)
        if mode == "live":
            live = _start_live(watch, lock, quiet)
    try:
        _poll_until_ended(record, pool, watch, lock, stop_gang, threads, _stall_teller(mode, out))
        for thread in threads:
            thread.join(timeout=10)  # the log streams end with their ranks
    except KeyboardInterrupt:
        if live is not None:
            live.stop()
        click.echo(f"\ndzctl: detached; the job keeps running. Stop it with: dzctl stop {record.job_id}", err=True)
        raise SystemExit(130) from None
    status = gather_status(store.get(record.job_id), pool)
    store.set_state(record.job_id, status.state)
    # A job that had already ended (status --watch afterwards): its recorded end, not now.
    ended = store.get(record.job_id).finished or time.time()
    with lock:
        watch.state, watch.first_failure, watch.ended_at = status.state, status.first_failure, ended
        watch.set_nodes({n.node_rank: (n.state, n.exit_code) for n in status.nodes}, status.state)
    if live is not None:
        live.refresh()
        live.stop()
    elif mode == "lines":
        out.write("".join(line + "\n" for line in final_lines(watch, ended, with_failure=report_failure)))
        out.flush()
    return status


def _stall_teller(mode: str, out):
    """Where a new stall's one line goes: the plain lines; beside the raw stream, as dzctl's own note
    (the gang stop's too); nowhere in the live view, which draws it from the watch."""
    if mode == "live":
        return None
    if mode == "raw":
        return lambda text: click.echo(f"dzctl: {text}", err=True)

    def tell(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    return tell


def _start_live(watch: JobWatch, lock: threading.Lock, quiet: bool):
    from rich.console import Console
    from rich.live import Live

    from ..observe.view import render

    console = Console(stderr=quiet)

    class _View:
        # Live asks for the renderable on each refresh (its own thread): render under the feed's lock.
        def __rich__(self):
            with lock:
                return render(watch, time.time(), console.width)

    live = Live(_View(), console=console, refresh_per_second=4, transient=False)
    live.start()
    return live


def _poll_until_ended(
    record: JobRecord,
    pool: HostPool,
    watch: JobWatch,
    lock: threading.Lock,
    stop_gang: bool,
    streams: list[threading.Thread],
    say_stall=None,
):
    """Poll the node states until none runs; a running job's stall is checked at each poll too.

    ``say_stall(line)``: where a new stall is said once, in one line (plain lines, raw); the live
    view draws it from the watch.
    """
    gang_stopped = False
    while True:
        alive = _alive(streams)  # before the poll: a stream that ends during it wakes the wait below at once
        states = node_states(record, pool)
        nodes = [node_status(n["host"], n["node_rank"], states[n["node_rank"]]) for n in record.plan["nodes"]]
        job_state = derive_state(record.state, nodes)
        # Rank 0's pulse, one small read; once stalled, every rank's evidence is taken once and kept
        # (evidence.py), so status, the supervisor and this view name the same culprit.
        stall = stall_of(record, pool) if job_state == "running" else None
        with lock:
            watch.set_nodes({r: (s.state, s.exit_code) for r, s in states.items()}, job_state)
            new_stall = watch.set_stall(stall)
        if new_stall and say_stall is not None:
            say_stall(stall_line(new_stall, record.job_id))
        running = [r for r, s in states.items() if s.state in ("running", "created")]
        failed = [r for r, s in states.items() if state_failed(s.state, s.exit_code)]
        if stop_gang and failed and running and not gang_stopped:
            click.echo(
                f"dzctl: node {failed[0]} failed; stopping the other node(s): {', '.join(map(str, running))}",
                err=True,
            )
            stop_nodes(record, pool, remove=False, ranks=running)
            gang_stopped = True
            continue
        if not running:
            return
        wait_for_a_stream_to_end(streams, POLL_S, alive)


def wait_for_a_stream_to_end(streams: list[threading.Thread], timeout: float, alive: int) -> bool:
    """Sleep until the next poll, or until fewer than ``alive`` log streams run, whichever comes first.

    A node's log stream ends with its ranks, so the poll that sees the node ended comes at once,
    not up to ``POLL_S`` later (``launch --follow`` returned 1 s late on average). True when a stream ended.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _alive(streams) < alive:
            return True
        time.sleep(min(STREAM_CHECK_S, max(0.0, deadline - time.monotonic())))
    return False


def _alive(streams: list[threading.Thread]) -> int:
    return sum(t.is_alive() for t in streams)
