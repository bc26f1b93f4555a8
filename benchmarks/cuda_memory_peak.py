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


def _stack(frames: list[dict[str, Any]] | None, depth: int = 6) -> list[str]:
    kept = [f for f in frames or [] if "/torch/" not in f.get("filename", "")]
    return ["/".join(f["filename"].split("/")[-3:]) + f":{f.get('line')} {f.get('name')}" for f in kept[:depth]]


def peak_live(snapshot: dict[str, Any], device: int = 0) -> dict[str, Any]:
    events = snapshot["device_traces"][device]
    # What is live at the snapshot: its segments' allocated blocks. The trace is undone from there, so a
    # trace whose oldest events the ring buffer dropped still gives the right totals for what it holds.
    live = {
        block["address"]: block["size"]
        for segment in snapshot.get("segments", [])
        if segment.get("device", device) == device
        for block in segment.get("blocks", [])
        if block.get("state") in ("active_allocated", "active_pending_free")
    }
    total = sum(live.values())
    peak, peak_at = total, len(events) - 1
    for index in range(len(events) - 1, -1, -1):  # total after event `index`, then undo it
        if total >= peak:
            peak, peak_at = total, index
        event = events[index]
        if event["action"] == "alloc":
            total -= live.pop(event["addr"], event["size"])
        elif event["action"] == "free_completed":
            live[event["addr"]] = event["size"]
            total += event["size"]
    at_start = dict(live)
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
        key = _where(frames)
        groups[key][0] += size
        groups[key][1] += 1
        stacks.setdefault(key, _stack(frames))
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    peak_frames = events[peak_at].get("frames") if peak_at >= 0 else []
    return {
        "events": len(events),
        "live_at_window_start_gib": round(sum(at_start.values()) / GIB, 3),
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


def lines(summary: dict[str, Any]) -> list[str]:
    out = [
        f"peak {summary['peak_gib']:.2f} GiB allocated ({summary['live_blocks']} blocks; {summary['events']} events; "
        f"{summary['live_at_window_start_gib']:.2f} GiB live when the trace starts)",
        "allocated at the peak by: " + " <- ".join(summary["peak_allocation_stack"][:4]),
        "| GiB | blocks | allocated at (innermost frame outside torch/) |",
        "|---|---|---|",
    ]
    out += [f"| {g['gib']:.3f} | {g['blocks']} | {g['where']} |" for g in summary["groups"]]
    out.append(f"| {summary['rest_gib']:.3f} | | the rest |")
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
