"""Which spare host takes a failed node's place: pure, keeping the world size.

Spares come from ``restart.spare_hosts`` first (the user's order), then from the hostfile's
lines the job does not use (those ``--include``/``--exclude``/``--num-nodes`` left out). A
spare takes the failed node's node rank and slots, so the ranks, the world size and the
checkpoint's shards line up: a resume needs the same number of data-parallel ranks. A spare
with another slot count would change the world size, which ZeRO-3's shards cannot follow
without a conversion; it is never used, and when no other spare fits, the supervisor refuses
with that conversion named.

Time and memory: linear in nodes + spares (a few dozen lines), nothing per row or per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import RuntimeFailure
from ...spec.hostfile import HostEntry, Node, parse_hostfile

WORLD_SIZE_CONVERSION = (
    "a different world size needs the ZeRO-3 checkpoint converted first: "
    "python -m deepspeed.checkpoint.ds_to_universal --input_folder CHECKPOINT/TAG --output_folder "
    "CHECKPOINT/TAG_universal, then zero.overrides: {checkpoint: {load_universal: true}} and "
    "train.resume: CHECKPOINT, launched by hand on the new nodes"
)


@dataclass(frozen=True)
class Spare:
    host: str
    slots: int | None  # None: as many as the node it replaces
    source: str  # where it was listed, for messages


@dataclass(frozen=True)
class Replacement:
    node_rank: int
    host: str  # the failed node
    spare: str  # the host now running its ranks
    source: str

    def to_dict(self) -> dict:
        return {"node_rank": self.node_rank, "host": self.host, "spare": self.spare, "source": self.source}


def spare_candidates(
    spare_lines: list[str], where: str, unused: list[HostEntry], hostfile: str = "hostfile"
) -> list[Spare]:
    """The spares in the order they are tried: the spec's list, then the hostfile's unused lines."""
    found: list[Spare] = []
    for index, line in enumerate(spare_lines):
        source = f"restart.spare_hosts[{index}] ({where})"
        has_slots = "slots=" in line
        entry = parse_hostfile(line if has_slots else f"{line.strip()} slots=1", source)[0]
        found.append(Spare(entry.host, entry.slots if has_slots else None, source))
    listed = {s.host for s in found}
    found += [Spare(e.host, e.slots, f"{hostfile} line {e.line}") for e in unused if e.host not in listed]
    return found


def unused_entries(entries: list[HostEntry], nodes: list[Node]) -> list[HostEntry]:
    """The hostfile's lines no node of the job uses."""
    used = {n.host for n in nodes}
    return [e for e in entries if e.host not in used]


def replace_failed(
    nodes: list[Node], failed_hosts: set[str], spares: list[Spare], tried: set[str]
) -> tuple[list[Node], list[Replacement]]:
    """``nodes`` with each failed host swapped for the first fitting spare not yet used or tried.

    Raises RuntimeFailure when a failed node has no spare left (naming which were tried), or
    when only spares of another slot count remain (naming the world-size conversion).
    """
    in_use = {n.host for n in nodes}
    new_nodes: list[Node] = []
    replaced: list[Replacement] = []
    for rank, node in enumerate(nodes):
        if node.host not in failed_hosts:
            new_nodes.append(node)
            continue
        free = [s for s in spares if s.host not in in_use and s.host not in tried and s.host not in failed_hosts]
        fitting = [s for s in free if s.slots in (None, node.num_slots)]
        if not fitting:
            if free:
                other = free[0]
                raise RuntimeFailure(
                    f"node {rank} ({node.host}) failed preflight and the only spare left, {other.host} "
                    f"({other.source}), has {other.slots} slot(s) where node {rank} had {node.num_slots}: "
                    "that would change the world size, so the supervisor does not restart",
                    fix=f"add a spare with slots={node.num_slots}, or {WORLD_SIZE_CONVERSION}",
                )
            listed = ", ".join(sorted(tried | {s.host for s in spares})) or "none listed"
            raise RuntimeFailure(
                f"node {rank} ({node.host}) failed preflight and no spare host is left (spares: {listed})",
                fix="repair the node, or list more in restart.spare_hosts (or unused hostfile lines), then "
                "launch the job again: it resumes from its newest complete checkpoint",
            )
        spare = fitting[0]
        in_use.add(spare.host)
        # The spare's own first slots: the failed node's GPU ids (an --include choice) name that host's GPUs.
        new_nodes.append(Node(spare.host, tuple(range(node.num_slots))))
        replaced.append(Replacement(rank, node.host, spare.host, spare.source))
    return new_nodes, replaced
