"""Node ranks and global ranks, kept apart in every command's words.

A *node* (node rank N) is one line of the hostfile: one launcher, one container. A *rank*
(global rank R) is one training process: node N runs ranks ``sum(slots before N)`` onward,
the numbers torch prints as ``[rank R]``. Users select by either: ``--node N`` is a node,
``--rank R`` is the node that runs rank R.
"""

from __future__ import annotations

import click


def ranks_by_node(plan_nodes: list[dict]) -> dict[int, range]:
    """Each node rank's global ranks, from the planned slots (node ranks in hostfile order)."""
    ranks: dict[int, range] = {}
    first = 0
    for node in sorted(plan_nodes, key=lambda n: n["node_rank"]):
        slots = int(node.get("slots") or 1)
        ranks[node["node_rank"]] = range(first, first + slots)
        first += slots
    return ranks


def span(ranks: range) -> str:
    """``4-7``, or ``4`` for one rank."""
    return str(ranks.start) if len(ranks) == 1 else f"{ranks.start}-{ranks.stop - 1}"


def selected_node(plan_nodes: list[dict], job_id: str, node: int | None, rank: int | None) -> int | None:
    """The node rank ``--node`` or ``--rank`` selects (None: every node); bad input is a usage error."""
    if node is not None and rank is not None:
        raise click.UsageError("--node and --rank: give one (a node runs several ranks; --rank picks its node)")
    by_node = ranks_by_node(plan_nodes)
    if node is not None:
        if node not in by_node:
            raise click.BadParameter(f"job {job_id} has nodes 0-{len(by_node) - 1}", param_hint="--node")
        return node
    if rank is not None:
        for node_rank, ranks in by_node.items():
            if rank in ranks:
                return node_rank
        layout = ", ".join(f"node {n}: {span(r)}" for n, r in by_node.items())
        total = sum(len(r) for r in by_node.values())
        raise click.BadParameter(f"job {job_id} has ranks 0-{total - 1} ({layout})", param_hint="--rank")
    return None
