"""Ask the hosts about a job: node states, progress, logs; stop it. Side effects live here."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import RemoteError
from ..planning.trackers import tracker_dirs
from ..runtimes.control import (
    NodeState,
    inspect_argv,
    list_files_argv,
    logs_argv,
    parse_inspect,
    progress_argv,
    read_file_argv,
    remove_argv,
    stop_argv,
)
from ..transport.pool import HostPool
from .evidence import stall_of
from .rankfailure import (
    before_launcher_report,
    errors_in_log,
    killed_outright,
    rank_details,
    torchrun_failures,
    torchrun_root_cause,
)
from .status import (
    GANG_LINE,
    JobStatus,
    derive_state,
    error_event_on_node,
    failure_sequence,
    failure_sequence_in_log,
    first_failure,
    job_events,
    node_failed,
    node_status,
    parse_progress,
)
from .store import JobRecord

INSPECT_TIMEOUT_S = 30
STOP_TIMEOUT_S = 60


def _python(record: JobRecord) -> str:
    return record.spec.get("launch", {}).get("python", "python3")


def node_states(record: JobRecord, pool: HostPool) -> dict[int, NodeState]:
    """Every rank's state, all nodes at once; an unreachable node is a state, not an error."""
    by_host = {n["host"]: n for n in record.plan["nodes"]}

    def one(conn) -> NodeState:
        node = by_host[conn.host]
        result = conn.run(inspect_argv(record.runtime, node, _python(record)), timeout=INSPECT_TIMEOUT_S)
        try:
            return parse_inspect(record.runtime, result.exit_code, result.stdout, result.stderr)
        except (ValueError, KeyError) as exc:
            return NodeState("unreachable", error=f"unreadable state: {exc}")

    outcomes = pool.map(one, by_host)
    return {
        by_host[host]["node_rank"]: NodeState("unreachable", error=str(state))
        if isinstance(state, Exception)
        else state
        for host, state in outcomes.items()
    }


def gather_status(record: JobRecord, pool: HostPool) -> JobStatus:
    states = node_states(record, pool)
    nodes = [node_status(n["host"], n["node_rank"], states[n["node_rank"]]) for n in record.plan["nodes"]]
    rank0 = record.plan["nodes"][0]
    progress = age = None
    errors: list[dict] = []
    try:
        result = pool.connection(rank0["host"]).run(progress_argv(rank0["output_dir"]), timeout=INSPECT_TIMEOUT_S)
        if result.exit_code == 0:
            progress, age, errors = parse_progress(result.stdout, job_id=record.job_id)
    except RemoteError:
        pass  # the node states already say the host is unreachable
    reasons: dict[int, str] = {}
    slots = [n["slots"] for n in record.plan["nodes"]]
    sequence = failure_sequence(errors, slots)
    # The failed ranks' own words: who was stopped by the gang watchdog (not first), and why each ended.
    failed = {n.node_rank: n.host for n in nodes if node_failed(n)}
    logs = pool.map(lambda conn: _log_lines(record, conn, _rank_of(record, conn.host)), list(failed.values()))
    lines = {rank: logs.get(host) if isinstance(logs.get(host), list) else [] for rank, host in failed.items()}
    gang_stopped = {rank for rank, found in lines.items() if any(GANG_LINE in line for line in found)}
    for rank, found in lines.items():  # each node's own log: seen even where outputs are node-local
        seq = failure_sequence_in_log(found)
        if seq is not None:
            sequence[rank] = min(seq, sequence.get(rank, seq))
    first = first_failure(nodes, {}, sequence, gang_stopped)
    details: dict[int, dict] = {}
    if first is not None:
        rank = first["node_rank"]
        found = lines.get(rank, [])
        # The trainer's own error event says it best (rank 0's record, else the node's own log);
        # else the rank's log; else the exit code.
        logged = errors_in_log(found)
        event = error_event_on_node(errors, slots, rank) or error_event_on_node(logged, slots, rank)
        # A rank of this node killed outright comes before the reports of the peers that lost it.
        reported = {e["rank"] for e in [*errors, *logged] if isinstance(e.get("rank"), int)}
        killed = killed_outright(torchrun_failures(found), reported)
        reason = (
            killed["reason"] if killed else event["reason"] if event else _error_line(before_launcher_report(found))
        )
        if reason:
            reasons[rank] = reason
        details[rank] = killed or rank_details(event, torchrun_root_cause(found))
    state = derive_state(record.state, nodes)
    stalled = stall_of(record, pool) if state == "running" else None
    if stalled and stalled["stalled"]:
        state = "stalled"  # every rank runs, none ends a step: the culprit is named (evidence.py)
    return JobStatus(
        job=record.name,
        job_id=record.job_id,
        state=state,
        nodes=nodes,
        progress=progress,
        progress_age_s=age,
        first_failure=first_failure(nodes, reasons, sequence, gang_stopped, details),
        preflight=record.preflight,
        speed=record.plan.get("speed"),
        stall=stalled,
    )


def progress_history(record: JobRecord, pool: HostPool) -> list[dict]:
    """Every progress event of this job (rank 0's whole progress.jsonl), for charts and plots."""
    rank0 = record.plan["nodes"][0]
    result = pool.connection(rank0["host"]).run(
        read_file_argv(f"{rank0['output_dir']}/progress.jsonl"), timeout=INSPECT_TIMEOUT_S
    )
    if result.exit_code != 0:
        return []  # no progress written yet (or the host is gone: status says which)
    return job_events(result.stdout, record.job_id)


def tracker_locations(record: JobRecord) -> dict[str, str]:
    """``train.report_to`` tracker -> its folder on rank 0's node."""
    report_to = record.spec.get("train", {}).get("report_to") or []
    return tracker_dirs(report_to, record.plan["nodes"][0]["output_dir"], record.job_id)


def fetch_outputs(record: JobRecord, pool: HostPool, dest: Path) -> list[Path]:
    """Copy rank 0's progress.jsonl and the trackers' files into ``dest``, keeping their layout.

    ``dest/progress.jsonl`` and ``dest/<path under output_dir>`` (e.g.
    ``dest/tensorboard/<job_id>/events.out.tfevents...``): ``tensorboard --logdir dest``
    then reads it as it would on the node.
    """
    rank0 = record.plan["nodes"][0]
    output_dir = rank0["output_dir"].rstrip("/")
    conn = pool.connection(rank0["host"])
    remote = [f"{output_dir}/progress.jsonl"]
    for folder in tracker_locations(record).values():
        listing = conn.run(list_files_argv(folder), timeout=INSPECT_TIMEOUT_S)
        if listing.exit_code == 0:
            remote += [line for line in listing.stdout.splitlines() if line.startswith(folder + "/")]
    written = []
    for path in remote:
        local = dest / path[len(output_dir) + 1 :]
        local.parent.mkdir(parents=True, exist_ok=True)
        data = conn.get(path)
        if path.endswith("progress.jsonl"):
            # Only this job's lines: the output dir's record also holds earlier runs'.
            data = "".join(json.dumps(e) + "\n" for e in job_events(data.decode("utf-8", "replace"), record.job_id))
            data = data.encode()
        local.write_bytes(data)
        written.append(local)
    return written


def _rank_of(record: JobRecord, host: str) -> int:
    return next(n["node_rank"] for n in record.plan["nodes"] if n["host"] == host)


# Enough for the rank's error event above torchrun's ChildFailedError traceback and summary
# (about 45 lines), and the other local ranks' lines in between.
LOG_TAIL_LINES = 200


def _log_lines(record: JobRecord, conn, rank: int) -> list[str]:
    """The last non-empty lines of the rank's log."""
    node = record.plan["nodes"][rank]
    result = conn.run(
        logs_argv(record.runtime, node, _python(record), tail=LOG_TAIL_LINES, follow=False),
        timeout=INSPECT_TIMEOUT_S,
    )
    return [x.strip() for x in (result.stdout + "\n" + result.stderr).splitlines() if x.strip()]


def _error_line(lines: list[str]) -> str | None:
    """The last line that reads like an error in a rank's log."""
    for line in reversed(lines):
        if any(word in line for word in ("Error", "error:", "Exception", "FAILED", "Killed", "dzctl gang")):
            return line[-400:]
    return None  # nothing in the log says why: the exit code will (e.g. 137, killed)


def stop_nodes(record: JobRecord, pool: HostPool, *, remove: bool, ranks: list[int] | None = None) -> dict:
    """Stop (and remove) every rank's container or process, all nodes at once; outcomes per host.

    A host's outcome is "stopped" only once asking the node again shows the rank gone: the exit
    codes of `docker stop`/`docker rm` alone can lie (a daemon that is down fails them while its
    container runs on), and so can a stop that timed out. Otherwise a ``RemoteError`` naming what
    failed and what the node still reports."""
    by_host = {n["host"]: n for n in record.plan["nodes"] if ranks is None or n["node_rank"] in ranks}

    def one(conn) -> str:
        node = by_host[conn.host]
        failures = []
        stop = conn.run(stop_argv(record.runtime, node, _python(record)), timeout=STOP_TIMEOUT_S)
        if not stop.ok:
            failures.append(_ended(stop))
        argv = remove_argv(record.runtime, node)
        if remove and argv:
            removed = conn.run(argv, timeout=STOP_TIMEOUT_S)
            if not removed.ok and "No such container" not in removed.stderr:
                failures.append(_ended(removed))
        seen = conn.run(inspect_argv(record.runtime, node, _python(record)), timeout=INSPECT_TIMEOUT_S)
        try:
            state = parse_inspect(record.runtime, seen.exit_code, seen.stdout, seen.stderr)
        except (ValueError, KeyError) as exc:
            state = NodeState("unreachable", error=f"unreadable state: {exc}")
        if state.state not in _gone_states(record.runtime, remove):
            why = f": {state.error}" if state.error else ""
            failures.append(f"rank {node['node_rank']} is still {state.state}{why}")
        if failures:
            raise RemoteError(f"{conn.host}: not stopped: " + "; ".join(failures))
        return "stopped"

    return dict(pool.map(one, by_host))


def _gone_states(runtime: str, removed: bool) -> frozenset[str]:
    """What `inspect` may say of a rank that is stopped: a removed container is missing; a process
    rank leaves its record behind (exited, or dead when its supervisor was killed)."""
    if runtime == "docker" and removed:
        return frozenset({"missing"})
    return frozenset({"missing", "exited", "dead"})


def _ended(result) -> str:
    tail = (result.stderr.strip() or result.stdout.strip()).splitlines()
    return f"`{' '.join(result.argv[:2])}` {result.how_it_ended}" + (f" ({tail[-1][-300:]})" if tail else "")


class LinePrefixer:
    """Turns chunks of one rank's output into whole lines prefixed with ``[rank host]``."""

    def __init__(self, prefix: str, write: Callable[[str], None], lock: threading.Lock) -> None:
        self.prefix = prefix
        self.write = write
        self.lock = lock
        self.buffer = b""

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        if lines:
            text = "".join(f"{self.prefix}{line.decode('utf-8', 'replace').rstrip(chr(13))}\n" for line in lines)
            with self.lock:
                self.write(text)

    def flush(self) -> None:
        if self.buffer:
            self.feed(b"\n")


def stream_logs(
    record: JobRecord,
    pool: HostPool,
    *,
    ranks: list[int] | None,
    tail: int | None,
    follow: bool,
    write: Callable[[str], None] | None = None,
    on_lines: Callable[[int, str], None] | None = None,
) -> list[threading.Thread]:
    """Start one thread per rank streaming its log, prefixed; returns the threads (join them).

    ``on_lines(node_rank, text)``: instead of prefixed text to ``write``, hand each
    node's whole lines, unprefixed, to this callback (the live view's feed).
    """
    write = write or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    lock = threading.Lock()
    threads = []
    for node in record.plan["nodes"]:
        if ranks is not None and node["node_rank"] not in ranks:
            continue
        if on_lines is not None:
            prefixer = LinePrefixer("", lambda text, rank=node["node_rank"]: on_lines(rank, text), lock)
        else:
            prefixer = LinePrefixer(f"[{node['node_rank']} {node['host']}] ", write, lock)

        def run(node=node, prefixer=prefixer) -> None:
            argv = logs_argv(record.runtime, node, _python(record), tail=tail, follow=follow)
            try:
                pool.connection(node["host"]).run(argv, on_stdout=prefixer.feed, on_stderr=prefixer.feed)
            except RemoteError as exc:
                prefixer.feed(f"dzctl: cannot read the log: {exc.message}\n".encode())
            prefixer.flush()

        thread = threading.Thread(target=run, daemon=True, name=f"logs-{node['node_rank']}")
        thread.start()
        threads.append(thread)
    return threads
