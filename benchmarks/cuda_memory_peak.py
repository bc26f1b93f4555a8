"""What was live on the GPU at a rank's highest allocated moment, grouped by the code that allocated it.

Input: a CUDA caching-allocator snapshot (``torch.cuda.memory._snapshot()``) whose history was recorded from
the process's start (``benchmarks/memory_trace/sitecustomize.py``). Its trace is replayed in order: each
``alloc`` adds a block, each ``free_completed`` removes it (PyTorch's allocated-bytes counter moves at the
same two events). At the highest total the live blocks are grouped by the innermost frame of their
allocation's Python stack that is not PyTorch's own (``torch/``): the library line that asked for them.
Used to find which of the memory planner's terms (``planning/memory/estimate.py``) a launch did not hold.

    python3 benchmarks/cuda_memory_peak.py SNAPSHOT.pickle      # or the sitecustomize's JSON, printed
"""

from __future__ import annotations

import json
import pickle
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

GIB = 2**30
TOP_GROUPS = 40


def _where(frames: list[dict[str, Any]] | None) -> str:
    """The allocating line outside PyTorch (innermost first in the snapshot's frames)."""
    for frame in frames or []:
        name = frame.get("filename", "")
        if "/torch/" not in name and not name.startswith("<"):
            tail = "/".join(name.split("/")[-3:])
            return f"{tail}:{frame.get('line')} {frame.get('name')}"
    return "no stack: before the trace window, or torch internals" if not frames else "torch internals"


def _group(frames: list[dict[str, Any]] | None) -> str:
    """The allocating line, and where a trainer's line led there (a preference trainer runs the policy's and the
    reference's forwards through the same model lines), that line too."""
    where = _where(frames)
    for frame in frames or []:
        name = frame.get("filename", "")
        if name.endswith("_trainer.py"):
            return f"{where} (from {name.split('/')[-1]}:{frame.get('line')})"
    return where


def _stack(frames: list[dict[str, Any]] | None, depth: int = 6) -> list[str]:
    kept = [f for f in frames or [] if "/torch/" not in f.get("filename", "")]
    return ["/".join(f["filename"].split("/")[-3:]) + f":{f.get('line')} {f.get('name')}" for f in kept[:depth]]


# The markers benchmarks/memory_trace/sitecustomize.py allocates as each Tensor.backward begins and ends: a
# frame of that name in an allocation's stack splits the trace into the backward and the rest (the forwards,
# a preference stage's reference forward, the optimizer step).
BACKWARD_BEGINS = "_backward_begins"
BACKWARD_ENDS = "_backward_ends"


def _live_at_end(snapshot: dict[str, Any], device: int) -> dict[int, int]:
    """What is live at the snapshot: its segments' allocated blocks, by address."""
    return {
        block["address"]: block["size"]
        for segment in snapshot.get("segments", [])
        if segment.get("device", device) == device
        for block in segment.get("blocks", [])
        if block.get("state") in ("active_allocated", "active_pending_free")
    }


def _totals(events: list[dict[str, Any]], live: dict[int, int]) -> tuple[list[int], dict[int, int]]:
    """The allocated total after each event, and what was live before the first. The trace is undone from the
    snapshot, so a trace whose oldest events the ring buffer dropped still gives the right totals."""
    live = dict(live)
    total = sum(live.values())
    totals = [0] * len(events)
    for index in range(len(events) - 1, -1, -1):  # total after event `index`, then undo it
        totals[index] = total
        event = events[index]
        if event["action"] == "alloc":
            total -= live.pop(event["addr"], event["size"])
        elif event["action"] == "free_completed":
            live[event["addr"]] = event["size"]
            total += event["size"]
    return totals, live


def _in_backward(events: list[dict[str, Any]]) -> list[bool]:
    """Whether each event falls between a backward-begins marker and its backward-ends marker."""
    inside, flags = False, []
    for event in events:
        names = {frame.get("name") for frame in event.get("frames") or []} if event["action"] == "alloc" else ()
        if BACKWARD_BEGINS in names:
            inside = True
        elif BACKWARD_ENDS in names:
            inside = False
        flags.append(inside)
    return flags


def _summary(events: list[dict[str, Any]], at_start: dict[int, int], peak: int, peak_at: int) -> dict[str, Any]:
    """What was live after event ``peak_at``, grouped by the code that allocated it."""
    blocks: dict[int, tuple[int, list]] = {addr: (size, []) for addr, size in at_start.items()}
    for event in events[: peak_at + 1]:  # forward from the window's start to the peak, with each stack
        if event["action"] == "alloc":
            blocks[event["addr"]] = (event["size"], event.get("frames") or [])
        elif event["action"] == "free_completed":
            blocks.pop(event["addr"], None)
    before = sum(size for size, frames in blocks.values() if not frames)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    stacks: dict[str, list[str]] = {}
    for size, frames in blocks.values():
        key = _group(frames)
        groups[key][0] += size
        groups[key][1] += 1
        stacks.setdefault(key, _stack(frames))
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    peak_frames = events[peak_at].get("frames") if peak_at >= 0 else []
    return {
        "live_at_peak_from_before_window_gib": round(before / GIB, 3),
        "peak_bytes": peak,
        "peak_gib": round(peak / GIB, 3),
        "peak_event_index": peak_at,
        "peak_allocation_stack": _stack(peak_frames, depth=12),
        "live_blocks": len(blocks),
        "groups": [
            {"where": key, "gib": round(size / GIB, 3), "blocks": count, "stack": stacks[key]}
            for key, (size, count) in ranked[:TOP_GROUPS]
        ],
        "rest_gib": round(sum(size for _, (size, _) in ranked[TOP_GROUPS:]) / GIB, 3),
    }


def _highest(totals: list[int], indices) -> int:
    """The first of the indices with the highest total (-1 where there are none)."""
    return max(indices, key=lambda i: (totals[i], -i), default=-1)


def peak_live(snapshot: dict[str, Any], device: int = 0) -> dict[str, Any]:
    """The highest allocated moment and what was live there; where the trace holds backward markers, also the
    highest moment inside a backward and the highest outside one (``phases``)."""
    events = snapshot["device_traces"][device]
    totals, at_start = _totals(events, _live_at_end(snapshot, device))
    peak_at = _highest(totals, range(len(events)))
    peak = totals[peak_at] if events else sum(at_start.values())
    summary = {"events": len(events), "live_at_window_start_gib": round(sum(at_start.values()) / GIB, 3)}
    summary.update(_summary(events, at_start, peak, peak_at))
    flags = _in_backward(events)
    if any(flags):
        summary["phases"] = {}
        for phase, wanted in (("backward", True), ("outside backward", False)):
            indices = [i for i, flag in enumerate(flags) if flag is wanted]
            at = _highest(totals, indices)
            summary["phases"][phase] = _summary(events, at_start, totals[at], at)
    return summary


def lines(summary: dict[str, Any]) -> list[str]:
    out = [
        f"peak {summary['peak_gib']:.2f} GiB allocated ({summary['live_blocks']} blocks; {summary['events']} events; "
        f"{summary['live_at_window_start_gib']:.2f} GiB live when the trace starts)",
        *lines_of_groups(summary),
    ]
    for phase, part in summary.get("phases", {}).items():
        out += ["", f"### the highest moment {phase}: {part['peak_gib']:.2f} GiB", *lines_of_groups(part)]
    return out


def lines_of_groups(part: dict[str, Any]) -> list[str]:
    out = [
        "allocated at the peak by: " + " <- ".join(part["peak_allocation_stack"][:4]),
        "| GiB | blocks | allocated at (innermost frame outside torch/) |",
        "|---|---|---|",
    ]
    out += [f"| {g['gib']:.3f} | {g['blocks']} | {g['where']} |" for g in part["groups"]]
    out.append(f"| {part['rest_gib']:.3f} | | the rest |")
    return out


def main(argv: list[str]) -> int:
    for name in argv:
        path = Path(name)
        if path.suffix == ".json":
            summary = json.loads(path.read_text(encoding="utf-8"))
        else:
            with path.open("rb") as handle:
                summary = peak_live(pickle.load(handle))
        print(f"## {path}")
        print("\n".join(lines(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
