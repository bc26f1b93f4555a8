"""Pure parsers of what the collective check's ranks print: progress lines and NCCL's INFO lines.

Progress lines come from ``orchestrator.train.collective`` (``dzctl-collective {json}``).
NCCL lines are what ``NCCL_DEBUG=INFO`` prints, ``HOST:PID:TID [DEV] NCCL INFO ...``.
The transport lines parsed here, as NCCL's source writes them (``src/transport/*.cc``,
``src/init.cc``, ``src/graph/search.cc``; the same from 2.18 to 2.28):

- ``Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read`` (also ``P2P/IPC``, ``P2P/direct pointer``):
  GPU to GPU within a node, over NVLink or PCIe;
- ``Channel 00 : 0[0] -> 1[1] via SHM/direct/direct``: within a node through host memory;
- ``Channel 00/0 : 0[0] -> 2[0] [send] via NET/IB/0/GDRDMA`` (or ``NET/Socket/0``): between nodes;
- ``Using network IB`` (or ``Socket``): the network plugin NCCL loaded;
- ``Pattern 4, crossNic 0, nChannels 16, bw 40.000000/40.000000, type NVL/PIX, sameChannels 1``
  (NCCL_DEBUG_SUBSYS=GRAPH): the path type within a node (``NVL`` = NVLink; ``PIX``, ``PXB``,
  ``PHB``, ``SYS`` = PCIe through a switch, several switches, the CPU, or across sockets).

tests/test_nccl_lines.py checks these against lines recorded on the H200 machine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

PROGRESS_MARK = "dzctl-collective "
_NCCL = re.compile(r"\bNCCL INFO (?P<msg>.*)$")
_CHANNEL = re.compile(r"^Channel \d+(?:/\d+)? : \d+\[\d+\] -> \d+\[\d+\](?: \[(?:send|receive)\])? via (?P<via>\S+)")
_NETWORK = re.compile(r"^Using network (?P<net>\S+)")
_PATTERN = re.compile(r"^Pattern \d+, crossNic \d+, nChannels \d+, .*\btype (?P<intra>[A-Z]+)/(?P<inter>[A-Z]+)")
# How a rank's store connection fails, in the words of torch's TCPStore client (c10d). Not
# "cannot be retrieved": c10d says that of its own hostname's reverse lookup, harmlessly.
STORE_FAILURES = (
    "failed to connect to",
    "has timed out after",
    "Connection refused",
    "No route to host",
)
PATH_NAMES = {
    "NVL": "NVLink",
    "NVB": "NVLink via another GPU",
    "C2C": "NVLink-C2C",
    "PIX": "PCIe switch",
    "PXB": "PCIe switches",
    "PXN": "PCIe via NVLink",
    "PHB": "PCIe via the CPU",
    "SYS": "PCIe across CPU sockets",
    "LOC": "same device",
    "NET": "network",
}


_DECODER = json.JSONDecoder()


def parse_progress(line: str) -> dict | None:
    """The first ``dzctl-collective`` record in a line, or None for any other line (or a damaged one)."""
    records = parse_progress_all(line)
    return records[0] if records else None


def parse_progress_all(line: str) -> list[dict]:
    """Every record in a line: two ranks' records can arrive glued into one line (recorded on the
    H200 machine when ranks wrote their text and newline apart); each is read on its own."""
    records = []
    at = line.find(PROGRESS_MARK)
    while at >= 0:
        start = at + len(PROGRESS_MARK)
        try:
            record, _ = _DECODER.raw_decode(line, start)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and "event" in record and "rank" in record:
            records.append(record)
        at = line.find(PROGRESS_MARK, start)
    return records


def transport_of(via: str) -> tuple[str, str]:
    """``("within", "P2P/CUMEM")`` or ``("between", "NET/IB")`` for a channel's ``via`` field."""
    parts = via.split("/")
    kind = parts[0]
    if kind == "NET":
        return "between", "/".join(parts[:2])
    if kind == "P2P":
        # P2P/CUMEM/read, P2P/IPC, P2P/direct pointer: the mechanism is the second part.
        return "within", "/".join(parts[:2])
    return "within", kind  # SHM, COLLNET, ...


@dataclass
class Transports:
    """What NCCL chose on one node, from its INFO lines."""

    within: set[str] = field(default_factory=set)  # P2P/CUMEM, P2P/IPC, SHM
    between: set[str] = field(default_factory=set)  # NET/IB, NET/Socket
    network: str | None = None  # the plugin NCCL loaded: IB or Socket
    intra_path: str | None = None  # NVL, PIX, ... (GRAPH subsystem)

    def feed(self, line: str) -> bool:
        """Take one output line; True if it was an NCCL INFO line this understood."""
        found = _NCCL.search(line)
        if not found:
            return False
        msg = found.group("msg").strip()
        if channel := _CHANNEL.match(msg):
            side, name = transport_of(channel.group("via"))
            (self.within if side == "within" else self.between).add(name)
            return True
        if network := _NETWORK.match(msg):
            self.network = network.group("net")
            return True
        if pattern := _PATTERN.match(msg):
            # The best path type seen (NVLink over PCIe): ring and tree graphs may differ.
            path = pattern.group("intra")
            if self.intra_path is None or _rank_path(path) < _rank_path(self.intra_path):
                self.intra_path = path
            return True
        return False

    def merge(self, other: Transports) -> None:
        self.within |= other.within
        self.between |= other.between
        self.network = self.network or other.network
        if other.intra_path and (self.intra_path is None or _rank_path(other.intra_path) < _rank_path(self.intra_path)):
            self.intra_path = other.intra_path

    def to_dict(self) -> dict:
        return {
            "within_node": sorted(self.within),
            "between_nodes": sorted(self.between),
            "network": self.network,
            "intra_node_path": self.intra_path,
        }

    def describe(self) -> str:
        parts = []
        if self.within:
            link = f" over {PATH_NAMES.get(self.intra_path, self.intra_path)}" if self.intra_path else ""
            parts.append(f"within the node {', '.join(sorted(self.within))}{link}")
        if self.between:
            parts.append(f"between nodes {', '.join(sorted(self.between))}")
        return "; ".join(parts)


_PATH_ORDER = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "PXN", "PHB", "SYS", "NET", "DIS")


def _rank_path(path: str) -> int:
    return _PATH_ORDER.index(path) if path in _PATH_ORDER else len(_PATH_ORDER)


def store_failure(line: str) -> bool:
    """A launcher or rank line saying it could not reach the master's store."""
    return any(text in line for text in STORE_FAILURES)
