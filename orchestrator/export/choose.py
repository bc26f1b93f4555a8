"""Which checkpoint ``--checkpoint N|latest|best`` names, and whether it may be exported (pure).

Only a complete checkpoint is exported: marked complete (``dzctl-complete.json``,
every file of its manifest at its size) on every node that holds a part of it. On
node-local storage that is every node, each with its own ranks' shards; on shared
storage node 0's folder holds them all. The nodes' parts must make one checkpoint:
one world size, one lineage (the run line its markers name), every rank's shards
once. ``latest`` is the newest such checkpoint of the job's lineage: the lineage of
the newest complete checkpoint on node 0 (the trainer refuses to start where another
lineage's complete checkpoints lie, so an output dir holds one line). ``best`` is the
one ``dzctl-best.json`` names (``train.save_best``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from .survey import BEST, NodeCheckpoint, NodeSurvey


class NoSuchCheckpoint(InputError):
    """The checkpoint asked for is not there, or not complete on a node that holds a part of it."""


@dataclass(frozen=True)
class Chosen:
    step: int
    world_size: int
    lineage: str | None
    parts: dict[int, NodeCheckpoint]  # node rank -> its folder's record (the nodes that hold a part)


def holders(surveys: list[NodeSurvey], storage: str) -> list[NodeSurvey]:
    """The nodes whose folders hold a part of a checkpoint: all on node-local storage, node 0 on shared."""
    return list(surveys) if storage == "node-local" else list(surveys[:1])


def parse_which(text: str) -> int | str:
    """``N``, ``latest`` or ``best``; InputError otherwise."""
    value = text.strip()
    if value in ("latest", "best"):
        return value
    name = value.removeprefix("checkpoint-")
    if name.isdigit():
        return int(name)
    raise InputError(
        f"--checkpoint {text!r}: not a step number, latest or best",
        fix="give a step (--checkpoint 200, or checkpoint-200), latest, or best",
    )


def choose(which: int | str, surveys: list[NodeSurvey], storage: str, job_id: str) -> Chosen:
    """The checkpoint ``which`` names, checked complete on every node that holds a part; NoSuchCheckpoint else."""
    nodes = holders(surveys, storage)
    if which == "best":
        return whole(best_step(surveys[0], job_id), nodes, job_id)
    if which == "latest":
        return latest(nodes, job_id)
    return whole(int(which), nodes, job_id)


def whole(step: int, nodes: list[NodeSurvey], job_id: str) -> Chosen:
    """Checkpoint ``step`` if complete on every node of ``nodes`` and its parts make one checkpoint."""
    parts: dict[int, NodeCheckpoint] = {}
    for node in nodes:
        found = node.checkpoints.get(step)
        if found is None:
            raise NoSuchCheckpoint(
                f"checkpoint-{step} is not on {node.where}: {node.output_dir} has no checkpoint-{step}"
                + _missing_dir(node),
                fix=_fix(nodes, job_id),
            )
        if not found.complete:
            raise NoSuchCheckpoint(
                f"checkpoint-{step} is not complete on {node.where}: {found.problem}",
                fix=_fix(nodes, job_id),
            )
        parts[node.node_rank] = found
    problem = _disagreement(parts, nodes)
    if problem:
        raise NoSuchCheckpoint(f"checkpoint-{step}: {problem}", fix=_fix(nodes, job_id))
    first = parts[nodes[0].node_rank]
    return Chosen(step, first.world_size or 0, first.lineage, parts)


def latest(nodes: list[NodeSurvey], job_id: str) -> Chosen:
    """The newest checkpoint complete on every holder, of the lineage of node 0's newest complete one."""
    mine = [c for c in nodes[0].checkpoints.values() if c.complete]
    if not mine:
        raise NoSuchCheckpoint(
            f"job {job_id} has no complete checkpoint on {nodes[0].where} in {nodes[0].output_dir}"
            + _missing_dir(nodes[0]),
            fix="train until a checkpoint is saved (train.save_steps), or name the job that wrote it",
        )
    lineage = mine[-1].lineage
    for step in sorted((c.step for c in mine if c.lineage == lineage), reverse=True):
        if _problem_of(step, nodes) is None:
            return whole(step, nodes, job_id)
    steps = sorted(c.step for c in mine)
    raise NoSuchCheckpoint(
        f"job {job_id}: no checkpoint is complete on every node; {nodes[0].where} holds {_steps(steps)}, but "
        + _problem_of(steps[-1], nodes),
        fix=_fix(nodes, job_id),
    )


def best_step(node0: NodeSurvey, job_id: str) -> int:
    """The step ``dzctl-best.json`` names in node 0's output dir; NoSuchCheckpoint when there is none."""
    if node0.best_problem:
        raise NoSuchCheckpoint(
            f"{node0.output_dir}/{BEST} on {node0.where}: {node0.best_problem}",
            fix="export a step (--checkpoint N) or --checkpoint latest",
        )
    if node0.best is None:
        raise NoSuchCheckpoint(
            f"job {job_id} kept no best checkpoint: {node0.output_dir} on {node0.where} has no {BEST}",
            fix="export a step (--checkpoint N) or --checkpoint latest; to keep the best one, train with "
            "train.save_best: true and evaluation data (data.eval_split or data.eval)",
        )
    try:
        return int(node0.best["step"])
    except (KeyError, TypeError, ValueError):
        raise NoSuchCheckpoint(
            f"{node0.output_dir}/{BEST} on {node0.where} names no step: {node0.best}",
            fix="export a step (--checkpoint N) or --checkpoint latest",
        ) from None


def _problem_of(step: int, nodes: list[NodeSurvey]) -> str | None:
    try:
        whole(step, nodes, "")
    except NoSuchCheckpoint as exc:
        return exc.message
    return None


def _disagreement(parts: dict[int, NodeCheckpoint], nodes: list[NodeSurvey]) -> str | None:
    worlds = {p.world_size for p in parts.values()}
    if len(worlds) > 1:
        return f"the nodes' markers name different world sizes ({sorted(worlds)}): parts of different runs"
    lineages = {p.lineage for p in parts.values()}
    if len(lineages) > 1:
        return f"the nodes' markers name different runs ({sorted(map(str, lineages))})"
    world = worlds.pop() or 0
    seen: dict[int, int] = {}
    for node_rank, part in sorted(parts.items()):
        for rank in part.ranks:
            if rank in seen:
                return f"rank {rank}'s shards are on node {seen[rank]} and node {node_rank}"
            seen[rank] = node_rank
    lacking = sorted(set(range(world)) - set(seen))
    if lacking:
        return f"no node holds the shards of ranks {lacking} of its {world}"
    return None


def _missing_dir(node: NodeSurvey) -> str:
    return "" if node.exists else " (the output dir itself is missing on that node)"


def _steps(steps: list[int]) -> str:
    return ", ".join(f"checkpoint-{s}" for s in steps) if steps else "none"


def _fix(nodes: list[NodeSurvey], job_id: str) -> str:
    """Name the checkpoints that are whole, or say there are none."""
    good = [s for s in sorted(nodes[0].checkpoints) if nodes[0].checkpoints[s].complete and _ok(s, nodes)]
    if good:
        return f"export one complete on every node: {_steps(good)} (or --checkpoint latest)"
    return (
        f"no checkpoint of job {job_id} is complete on every node: restore the node's output dir, "
        "or train on until the next save"
    )


def _ok(step: int, nodes: list[NodeSurvey]) -> bool:
    return all(step in n.checkpoints and n.checkpoints[step].complete for n in nodes)
