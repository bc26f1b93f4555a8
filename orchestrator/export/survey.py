"""What one node holds of a job's checkpoints: a script the node runs, and the parse of its answer (pure).

The node answers with one JSON object: every ``checkpoint-N`` folder of its output
dir with its completion marker (``dzctl-complete.json``, written by the trainer once
the node's ranks finished that save: see ``train/checkpoints.py``) and whether the
files the marker lists are all there at their recorded sizes; and the run's
``dzctl-best.json`` (``train.save_best``). The script is plain Python 3 with nothing
but the standard library: on a docker node it runs on the host, where dzctl's own
package is not installed. It reads only the small marker files and ``stat``s the
rest: the cost is one ``stat`` per checkpoint file, whatever the model's size.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

MARKER = "dzctl-complete.json"  # the trainer's name (train/checkpoints.py MARKER)
BEST = "dzctl-best.json"  # train.save_best's record: {"checkpoint": "checkpoint-N", "step": N, "eval_loss": x}
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:model|optim)_states\.pt$")

# argv[1]: the output dir. Kept to what inspect() in train/checkpoints.py judges a checkpoint by:
# the marker, and every file of its manifest at its size.
NODE_SCRIPT = r"""
import json, os, re, sys
out = sys.argv[1]
answer = {"exists": os.path.isdir(out), "checkpoints": {}, "best": None, "best_problem": None}
if answer["exists"]:
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if not (re.match(r"^checkpoint-\d+$", name) and os.path.isdir(path)):
            continue
        entry = {"marker": None, "problem": None}
        try:
            with open(os.path.join(path, "dzctl-complete.json"), encoding="utf-8") as handle:
                entry["marker"] = json.load(handle)
        except FileNotFoundError:
            entry["problem"] = "dzctl-complete.json missing: the save did not finish on this node"
        except (OSError, ValueError) as exc:
            entry["problem"] = "dzctl-complete.json unreadable: %s" % exc
        files = (entry["marker"] or {}).get("files") if isinstance(entry["marker"], dict) else None
        if entry["problem"] is None and not isinstance(files, dict):
            entry["problem"] = "dzctl-complete.json lists no files (written before dzctl kept a manifest)"
        for rel, size in (files or {}).items() if entry["problem"] is None else ():
            try:
                actual = os.stat(os.path.join(path, rel)).st_size
            except OSError:
                entry["problem"] = "%s missing (listed in dzctl-complete.json)" % rel
                break
            if actual != size:
                entry["problem"] = "%s is %d bytes, dzctl-complete.json says %d: cut short or changed" % (
                    rel, actual, size)
                break
        answer["checkpoints"][name] = entry
    try:
        with open(os.path.join(out, "dzctl-best.json"), encoding="utf-8") as handle:
            answer["best"] = json.load(handle)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        answer["best_problem"] = "dzctl-best.json unreadable: %s" % exc
print(json.dumps(answer))
"""


def survey_argv(python: str, output_dir: str) -> list[str]:
    return [python, "-c", NODE_SCRIPT, output_dir]


@dataclass(frozen=True)
class NodeCheckpoint:
    """One ``checkpoint-N`` folder on one node, as that node reported it."""

    step: int
    problem: str | None  # why it cannot be exported from this node; None when complete
    world_size: int | None = None
    ranks: tuple[int, ...] = ()  # the ranks whose shards this node's folder holds
    lineage: str | None = None
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size (the marker's manifest)

    @property
    def complete(self) -> bool:
        return self.problem is None


@dataclass(frozen=True)
class NodeSurvey:
    host: str
    node_rank: int
    output_dir: str
    exists: bool
    checkpoints: dict[int, NodeCheckpoint]  # step -> folder
    best: dict | None = None
    best_problem: str | None = None

    @property
    def where(self) -> str:
        return f"node {self.node_rank} ({self.host})"


def parse_survey(host: str, node_rank: int, output_dir: str, stdout: str) -> NodeSurvey:
    """The node script's answer; ValueError when it is not the JSON the script prints."""
    answer = json.loads(stdout.strip().splitlines()[-1])
    found = {}
    for name, entry in answer["checkpoints"].items():
        match = CHECKPOINT_DIR.match(name)
        if not match:
            continue
        found[int(match.group(1))] = _checkpoint(int(match.group(1)), entry)
    return NodeSurvey(
        host,
        node_rank,
        output_dir,
        bool(answer["exists"]),
        dict(sorted(found.items())),
        answer.get("best") if isinstance(answer.get("best"), dict) else None,
        answer.get("best_problem"),
    )


def _checkpoint(step: int, entry: dict) -> NodeCheckpoint:
    marker = entry.get("marker")
    if entry.get("problem"):
        return NodeCheckpoint(step, str(entry["problem"]))
    try:
        world = int(marker["world_size"])
        ranks = tuple(int(r) for r in marker.get("ranks", range(world)))
        files = {str(k): int(v) for k, v in marker["files"].items()}
        lineage = str(marker.get("lineage", "unrecorded"))
    except (KeyError, TypeError, ValueError):
        return NodeCheckpoint(step, f"{MARKER} unreadable")
    return NodeCheckpoint(step, None, world, ranks, lineage, files)
