"""The export's side effects on the nodes: ask what each holds, and bring a checkpoint's files here.

Each node sends its part as one ``tar`` stream over SSH (the system's ``ssh`` where it
reaches the node, else paramiko: ``transport.openssh.stream_links``, as image
distribution does), all nodes at once; the controller unpacks each stream as it
arrives (``tarfile`` with the ``data`` filter: no absolute paths, no ``..``, no
links out of the folder), then checks every file's size against the node's marker.
On shared storage that the controller itself sees (the same folder at the same
path, every planned file at its size), nothing is copied: the files are read in place.
"""

from __future__ import annotations

import contextlib
import os
import re
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import InputError, RemoteError
from ..observe.store import JobRecord
from ..transport.local import LocalConnection
from ..transport.openssh import client_from_env, stream_links
from ..transport.pool import HostPool
from .plan import ExportPlan, NodeFiles
from .survey import NodeSurvey, parse_survey, survey_argv

SURVEY_TIMEOUT_S = 120
COMMAND_NOT_FOUND = 127  # what a shell (and transport.local) answers for a missing program


def node_python(record: JobRecord) -> str:
    """The Python that answers on a node: the job's own for ``runtime: process``; the host's for docker."""
    if record.runtime == "process":
        return record.spec.get("launch", {}).get("python") or "python3"
    return "python3"


def survey_nodes(record: JobRecord, pool: HostPool | None, *, first_only: bool = False) -> list[NodeSurvey]:
    """Every node's checkpoints, in node order; ``first_only``: node 0's (shared storage: it sees them all).

    ``pool`` None: a Slurm job, its shared output dir seen from here.
    """
    nodes = record.plan["nodes"][:1] if first_only else record.plan["nodes"]
    python = node_python(record)

    def one(conn, node: dict) -> NodeSurvey:
        result = conn.run(survey_argv(python, node["output_dir"]), timeout=SURVEY_TIMEOUT_S)
        if result.exit_code == COMMAND_NOT_FOUND:
            raise RemoteError(
                f"node {node['node_rank']} ({conn.host}): no {python} there to list {node['output_dir']}",
                fix="install Python 3 on the node (apt-get install python3-minimal); with runtime: process, "
                "launch.python names the one used",
            )
        if result.exit_code != 0:
            tail = (result.stderr.strip() or result.stdout.strip() or result.how_it_ended).splitlines()[-1]
            raise RemoteError(f"node {node['node_rank']} ({conn.host}): listing {node['output_dir']} failed: {tail}")
        try:
            return parse_survey(conn.host, node["node_rank"], node["output_dir"], result.stdout)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise RemoteError(f"node {node['node_rank']} ({conn.host}): unreadable answer: {exc}") from None

    if pool is None:
        return [one(LocalConnection(), node) for node in nodes[:1]]
    by_host = {n["host"]: n for n in nodes}
    outcomes = pool.map(lambda conn: one(conn, by_host[conn.host]), list(by_host))
    failed = outcomes.failed
    if failed:
        details = "; ".join(str(exc) for exc in failed.values())
        fixes = {exc.fix for exc in failed.values() if isinstance(exc, RemoteError) and exc.fix}
        raise RemoteError(
            f"could not ask {len(failed)} node(s) about their checkpoints: {details}",
            fix="; ".join(sorted(fixes))
            or "bring the node(s) back (`dzctl status JOB` says which are unreachable), then export again",
        )
    return [outcomes[n["host"]] for n in nodes]


def local_sizes(plan: ExportPlan) -> dict[str, int | None]:
    """Node 0's planned files as this machine sees them at the same path (None: not here)."""
    sizes: dict[str, int | None] = {}
    for node in plan.nodes:
        for rel, _ in node.files:
            try:
                sizes[f"{node.folder}/{rel}"] = os.stat(f"{node.folder}/{rel}").st_size
            except OSError:
                sizes[f"{node.folder}/{rel}"] = None
    return sizes


def fetch(plan: ExportPlan, pool: HostPool, dest: Path, on_bytes: Callable[[int], None]) -> dict[str, str]:
    """Every node's files of ``plan`` into ``dest`` (one folder: ``latest``, ``global_step<N>/``, ...).

    Returns which client carried each node's stream. RemoteError naming each node whose
    stream failed or whose files came short; what did arrive is left for the caller to remove.
    """
    dest.mkdir(parents=True, exist_ok=True)
    hosts = [n.host for n in plan.nodes]
    links, carriers, _ = stream_links(pool, hosts, client_from_env())
    lock = threading.Lock()

    def counted(n: int) -> None:
        with lock:
            on_bytes(n)

    def one(conn) -> None:
        node = next(n for n in plan.nodes if n.host == conn.host)
        _stream(links.get(conn.host, conn), node, dest, counted)

    outcomes = pool.map(one, hosts)
    failed = outcomes.failed
    if failed:
        details = "; ".join(f"{host}: {exc}" for host, exc in failed.items())
        raise RemoteError(
            f"gathering {plan.checkpoint} failed on {len(failed)} node(s): {details}",
            fix="check the node's disk and link, then export again (nothing was written to --out)",
        )
    for node in plan.nodes:
        for rel, size in node.files:
            local = dest / rel
            actual = local.stat().st_size if local.is_file() else None
            if actual != size:
                raise RemoteError(
                    f"node {node.node_rank} ({node.host}): {node.folder}/{rel} arrived with {actual} bytes, "
                    f"its marker says {size}",
                    fix="export again; if it repeats, the checkpoint changed on the node after it was saved",
                )
    return carriers


def _stream(conn, node: NodeFiles, dest: Path, on_bytes: Callable[[int], None]) -> None:
    """One node's files as one tar stream, unpacked here as it arrives."""
    read_fd, write_fd = os.pipe()
    failure: list[BaseException] = []

    def unpack() -> None:
        try:
            with os.fdopen(read_fd, "rb") as source, tarfile.open(fileobj=source, mode="r|") as archive:
                archive.extractall(dest, filter="data")
        except BaseException as exc:  # reported below, with the node's name
            failure.append(exc)

    reader = threading.Thread(target=unpack, daemon=True, name=f"export-untar-{node.host}")
    reader.start()
    sink = os.fdopen(write_fd, "wb")

    def feed(chunk: bytes) -> None:
        on_bytes(len(chunk))
        if failure:
            return  # the unpacking stopped: the reason is reported once the stream ends
        # A closed pipe: the reader is done (the archive's end, or a failure it recorded).
        with contextlib.suppress(BrokenPipeError):
            sink.write(chunk)

    argv = ["tar", "-C", node.folder, "-cf", "-", "--", *[rel for rel, _ in node.files]]
    try:
        result = conn.run(argv, on_stdout=feed)
    finally:
        with contextlib.suppress(BrokenPipeError):
            sink.close()
        reader.join()
    if result.exit_code != 0:
        tail = (result.stderr.strip() or result.how_it_ended).splitlines()[-1]
        raise RemoteError(f"tar of {node.folder} failed: {tail}")
    if failure:
        raise RemoteError(f"unpacking {node.folder}'s stream failed: {failure[0]}")


# The files of a Hugging Face model folder that from_pretrained reads (weights, index, configs).
BASE_FILES = re.compile(r"^(?:config\.json|generation_config\.json|.*\.safetensors|model\.safetensors\.index\.json)$")


def base_model(plan: ExportPlan, pool: HostPool | None, dest: Path, on_bytes: Callable[[int], None]) -> str | None:
    """Where the LoRA base loads from here: its folder as this machine sees it, else a copy from node 0.

    A hub name (no ``/`` at the start) is left to ``from_pretrained`` and this machine's cache.
    """
    base = plan.base
    if base is None or not base.startswith("/"):
        return base
    if (Path(base) / "config.json").is_file() or pool is None:
        return base
    node = plan.nodes[0]
    conn = pool.connection(node.host)
    argv = ["find", base, "-maxdepth", "1", "-type", "f", "-printf", "%f\\t%s\\n"]
    listing = conn.run(argv, timeout=SURVEY_TIMEOUT_S)
    files = []
    for line in listing.stdout.splitlines() if listing.exit_code == 0 else ():
        name, _, size = line.partition("\t")
        if BASE_FILES.match(name) and size.isdigit():
            files.append((name, int(size)))
    if not any(name == "config.json" for name, _ in files):
        raise InputError(
            f"the base model the adapter was trained on, {base}, is neither here nor on node "
            f"{node.node_rank} ({node.host})",
            fix="a random base (model.init: random) is written when its run ends: export once the run has ended; "
            f"else copy {base} to this machine at that path",
        )
    _stream(conn, NodeFiles(node.host, node.node_rank, base, tuple(files)), dest, on_bytes)
    return str(dest)
