"""DeepSpeed hostfiles (``HOST slots=N``) and the runner's resource filters.

Parsing is strict where DeepSpeed is lenient: a missing hostfile is an error
(DeepSpeed's runner silently falls back to the local GPUs), and every bad line
is reported as ``file:line: reason``.

Filters follow DeepSpeed's ``parse_resource_filter`` (deepspeed/launcher/runner.py):
``--include``/``--exclude`` take ``NAME[:SLOT[,SLOT...]]`` joined by ``@``; node
order always follows the hostfile; slot lists are de-duplicated and sorted; a
host left with no slots is dropped; an unknown host or slot is an error; the
two are mutually exclusive. ``--num-nodes N`` keeps the first N nodes.
``--num-gpus N`` keeps the first N remaining slots of each node; DeepSpeed
instead resets every node to ``range(N)`` (ignoring an earlier slot filter),
which can hand out GPUs the user just excluded, so dzctl refuses to combine a
slot filter with a larger ``--num-gpus`` than the filter left.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import HostfileError

# RFC 1123 host names, IPv4 and bracket-less IPv6, and ssh-config aliases
# (which may also hold '_'). Anything else (spaces, '$', ';', quotes) is refused
# before it could reach a shell on any host.
HOST_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,252}$")
SLOTS_TOKEN = re.compile(r"^slots=(.*)$")
# `gpu-node-2:4`: a name without colons (so not an IPv6 address), a colon, a count.
HOST_COLON_COUNT = re.compile(r"^([^:]+):([0-9]+)$")
MAX_SLOTS = 1024  # no node has more GPUs; a typo like slots=80000 is caught here


@dataclass(frozen=True)
class HostEntry:
    """One hostfile line: a host and its slot count."""

    host: str
    slots: int
    line: int


@dataclass(frozen=True)
class Node:
    """A host chosen for the job, with the GPU/process slot ids it will use."""

    host: str
    slots: tuple[int, ...]

    @property
    def num_slots(self) -> int:
        return len(self.slots)


def read_hostfile(path: str | Path) -> list[HostEntry]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HostfileError(
            f"{path}: hostfile not found",
            fix="create it with one 'HOST slots=N' line per node (see hostfiles/2x4.txt); "
            "dzctl never falls back to local GPUs",
        ) from None
    except IsADirectoryError:
        raise HostfileError(f"{path}: is a directory, not a hostfile") from None
    except UnicodeDecodeError as exc:
        raise HostfileError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except OSError as exc:
        raise HostfileError(f"{path}: cannot read hostfile: {exc.strerror}") from None
    return parse_hostfile(text, str(path))


def parse_hostfile(text: str, source: str) -> list[HostEntry]:
    entries: list[HostEntry] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        tokens = line.split()
        host, rest = tokens[0], tokens[1:]
        if "\0" in line or not HOST_NAME.match(host):
            raise HostfileError(f"{source}:{number}: {host!r} is not a valid host name")
        if host in first_line:
            raise HostfileError(
                f"{source}:{number}: duplicate host {host!r} (first at line {first_line[host]})",
                fix="list each node once; give it all its GPUs with slots=N",
            )
        slots = _parse_slots(rest, source, number, host)
        first_line[host] = number
        entries.append(HostEntry(host=host, slots=slots, line=number))
    if not entries:
        raise HostfileError(
            f"{source}:1: the hostfile lists no hosts",
            fix="add one 'HOST slots=N' line per node",
        )
    return entries


def _parse_slots(tokens: list[str], source: str, number: int, host: str) -> int:
    where = f"{source}:{number}"
    if not tokens:
        counted = HOST_COLON_COUNT.match(host)
        if counted:
            # `HOST:N` is how --include names GPUs, not how a hostfile counts them.
            name, count = counted.groups()
            raise HostfileError(
                f"{where}: {host}: a hostfile gives a node's GPUs as slots=N, not HOST:N",
                fix=f"write '{name} slots={count}'",
            )
        raise HostfileError(f"{where}: {host}: missing slots=N", fix=f"write '{host} slots=N', N = GPUs on that node")
    slots_values = [m.group(1) for t in tokens if (m := SLOTS_TOKEN.match(t))]
    unknown = [t for t in tokens if not SLOTS_TOKEN.match(t)]
    if unknown:
        raise HostfileError(f"{where}: unknown token {unknown[0]!r}; a line is 'HOST slots=N'")
    if len(slots_values) > 1:
        raise HostfileError(f"{where}: slots given {len(slots_values)} times")
    value = slots_values[0]
    if not re.fullmatch(r"[0-9]+", value):
        raise HostfileError(f"{where}: slots={value!r} is not a whole number")
    slots = int(value)
    if slots < 1:
        raise HostfileError(f"{where}: slots={slots}: a node needs at least 1 slot", fix="remove the line instead")
    if slots > MAX_SLOTS:
        raise HostfileError(f"{where}: slots={slots} is more than any node has (max {MAX_SLOTS})")
    return slots


@dataclass(frozen=True)
class ResourceFilter:
    include: str = ""
    exclude: str = ""
    num_nodes: int | None = None
    num_gpus: int | None = None


def select_nodes(entries: list[HostEntry], flt: ResourceFilter, source: str) -> list[Node]:
    """Apply include/exclude, then num-nodes and num-gpus, keeping hostfile order."""
    pool = {e.host: list(range(e.slots)) for e in entries}
    line_of = {e.host: e.line for e in entries}
    if flt.include and flt.exclude:
        raise HostfileError("--include and --exclude are mutually exclusive", fix="use one of them")
    chosen: dict[str, list[int]]
    filtered = bool(flt.include or flt.exclude)
    if flt.include:
        chosen = {}
        for host, slots in _parse_filter(flt.include, "--include", pool, source):
            # Naming a host twice in --include unions its slots (DeepSpeed overwrites; union is what users mean).
            chosen[host] = sorted(set(chosen.get(host, [])) | set(slots if slots is not None else pool[host]))
    elif flt.exclude:
        chosen = {h: list(s) for h, s in pool.items()}
        for host, slots in _parse_filter(flt.exclude, "--exclude", pool, source):
            removed = set(pool[host] if slots is None else slots)
            chosen[host] = [s for s in chosen[host] if s not in removed]
    else:
        chosen = pool
    nodes = [Node(h, tuple(sorted(set(chosen[h])))) for h in pool if chosen.get(h)]
    if not nodes:
        raise HostfileError(f"{source}: the filters leave no hosts", fix="relax --include/--exclude")
    if flt.num_nodes is not None:
        if flt.num_nodes < 1:
            raise HostfileError(f"--num-nodes {flt.num_nodes}: must be at least 1")
        if flt.num_nodes > len(nodes):
            raise HostfileError(
                f"--num-nodes {flt.num_nodes}: only {len(nodes)} node(s) available in {source}",
                fix=f"use --num-nodes {len(nodes)} or add hosts",
            )
        nodes = nodes[: flt.num_nodes]
    if flt.num_gpus is not None:
        if flt.num_gpus < 1:
            raise HostfileError(f"--num-gpus {flt.num_gpus}: must be at least 1")
        short = [n for n in nodes if n.num_slots < flt.num_gpus]
        if short:
            node = short[0]
            where = source if filtered else f"{source}:{line_of[node.host]}"
            why = " after the filters" if filtered else ""
            raise HostfileError(
                f"{where}: --num-gpus {flt.num_gpus}: {node.host} has only {node.num_slots} slot(s){why}",
                fix=f"use --num-gpus {min(n.num_slots for n in nodes)} or fewer",
            )
        nodes = [Node(n.host, n.slots[: flt.num_gpus]) for n in nodes]
    return nodes


def _parse_filter(text: str, flag: str, pool: dict[str, list[int]], source: str):
    for spec in text.split("@"):
        if not spec:
            raise HostfileError(f"{flag} {text!r}: empty entry (two '@' in a row, or one at an end)")
        host, sep, slot_text = spec.partition(":")
        if host not in pool:
            raise HostfileError(
                f"{flag} {text!r}: host {host!r} is not in {source}",
                fix=f"hosts there: {', '.join(pool)}",
            )
        if not sep:
            yield host, None
            continue
        slots = []
        for item in slot_text.split(","):
            if not re.fullmatch(r"[0-9]+", item):
                raise HostfileError(f"{flag} {text!r}: slot {item!r} of {host} is not a whole number")
            slot = int(item)
            if slot not in pool[host]:
                raise HostfileError(
                    f"{flag} {text!r}: {host} has no slot {slot} (slots 0-{len(pool[host]) - 1} in {source})"
                )
            slots.append(slot)
        yield host, slots


def load_nodes(path: str | Path, flt: ResourceFilter | None = None) -> list[Node]:
    """Read a hostfile and apply the filters: the nodes of a job, in rank order."""
    entries = read_hostfile(path)
    return select_nodes(entries, flt or ResourceFilter(), str(path))
