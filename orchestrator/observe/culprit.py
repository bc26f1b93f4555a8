"""Which rank a stalled job waits for, from every rank's evidence (pure; evidence.py gathers it).

In the order a person would look:

1. a node that no longer answers (its ranks cannot be asked: the host is down or cut off);
2. a rank that is stopped (state T: SIGSTOP, a debugger, a job-control stop);
3. a rank in uninterruptible I/O (state D: a hung network filesystem, a dying disk);
4. a rank blocked reading something that is not a peer's socket (a FIFO, a file on a hung mount);
5. otherwise the ranks *not* inside the collective the others wait in (one slower code path, a
   data loader that never returns, a rank that ran out of data).

The collective is read from the waiting ranks' Python stacks: the innermost frame of
``torch/distributed/distributed_c10d.py`` in the main thread names it (``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``barrier``...). On GPU jobs the NCCL flight recorder's dump says
the same from the C++ side, with sequence numbers; it is stored beside the stacks.
"""

from __future__ import annotations

import re
from collections import Counter

_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+", re.MULTILINE)
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line \d+ in (?P<name>\S+)', re.MULTILINE)
_C10D = "torch/distributed/distributed_c10d.py"
_MAIN_MARK = "orchestrator/train/entry.py"  # the trainer's main thread runs entry.main at its bottom
# A rank's kind of trouble, from its own state: these point at its node (a spare can fix them).
NODE_FAULTS = ("unreachable", "stopped", "uninterruptible-io", "blocked-read")


def main_thread(stack: str) -> list[tuple[str, str]]:
    """(file, function) frames, most recent first, of the thread that runs the trainer's main."""
    threads = [stack[m.start() : n.start() if n else len(stack)] for m, n in _pairs(list(_THREAD.finditer(stack)))]
    frames_of = [[(f["file"], f["name"]) for f in _FRAME.finditer(thread)] for thread in threads]
    for frames in frames_of:
        if any(_MAIN_MARK in file for file, _ in frames):
            return frames
    # Not under the trainer's entry: faulthandler lists the main thread, the oldest, last.
    return frames_of[-1] if frames_of else []


def _pairs(found):
    return zip(found, [*found[1:], None], strict=True)


# ZeRO-3 issues its gathers with async_op and waits on the handle later, from its own frames: a rank
# stopped in such a wait has no distributed_c10d frame (seen in tests/test_hang_recovery.py when the stop
# landed in the forward: rank 0 waited in partition_parameters.py's AllGatherHandle.wait).
_DEEPSPEED_WAITS = {"deepspeed/runtime/zero/partition_parameters.py": "all_gather (ZeRO-3 parameter fetch)"}


def collective_of(stack: str | None) -> str | None:
    """The collective the rank's main thread waits in, from its Python stack; None when in none."""
    for file, name in main_thread(stack or ""):
        if file.endswith(_C10D) and not name.startswith("_"):
            return name
        if name == "wait":
            for suffix, collective in _DEEPSPEED_WAITS.items():
                if file.endswith(suffix):
                    return collective
    return None


def rank_fault(rank: dict) -> tuple[str, str] | None:
    """(kind, words) when a rank's own state explains a stall; None for a rank that merely waits."""
    state = rank.get("state")
    if state == "T":
        return "stopped", "stopped (state T: SIGSTOP or a debugger)"
    if state == "D":
        return "uninterruptible-io", f"in uninterruptible I/O (state D, in {rank.get('wchan') or 'the kernel'})"
    blocked = rank.get("blocked_on")
    if blocked and blocked.get("kind") not in ("socket", None):
        return "blocked-read", f"blocked in {blocked.get('syscall')} of {blocked.get('path')} ({blocked['kind']})"
    return None


def name_culprit(nodes: list[dict], step: int | None = None) -> dict | None:
    """The culprit of a stall: ``{ranks, node_rank, host, kind, why, collective, waiting_ranks, step, line}``.

    ``nodes``: evidence.py's per-node records (``node_rank``, ``host``, ``reachable``, ``ranks``
    [{rank, state, wchan, blocked_on, stack}]). None when the evidence names nobody (every rank in
    the same collective: then the network or a peer outside the job is the suspect).
    """
    ranks = [dict(r, node_rank=n["node_rank"], host=n["host"]) for n in nodes for r in n.get("ranks") or []]
    for r in ranks:
        r["collective"] = collective_of(r.get("stack"))
        r["fault"] = rank_fault(r)
    # The collective the healthy ranks wait in: a stopped rank may have been stopped inside it too,
    # but it is not waiting for anyone.
    inside = Counter(r["collective"] for r in ranks if r["collective"] and not r["fault"])
    collective = inside.most_common(1)[0][0] if inside else None
    waiting = sorted(r["rank"] for r in ranks if collective and r["collective"] == collective and not r["fault"])
    found: list[tuple[dict, str, str]] = []
    for node in nodes:
        if not node.get("reachable", True):
            found.append(({"rank": None, "node_rank": node["node_rank"], "host": node["host"]}, "unreachable",
                          f"no longer answers ({node.get('error') or 'unreachable'})"))  # fmt: skip
    for r in ranks:
        if r["fault"]:
            found.append((r, *r["fault"]))
    if not found and collective:
        found = [(r, "not-in-collective", f"is not in {collective} ({_where(r)})")
                 for r in ranks if r["collective"] != collective]  # fmt: skip
    if not found:
        return None
    first, kind, why = found[0]
    who = f"rank {first['rank']}" if first.get("rank") is not None else "its ranks"
    waits = f"; rank {', '.join(map(str, waiting))} {'waits' if len(waiting) == 1 else 'wait'} in {collective}" if (
        waiting) else ""  # fmt: skip
    at = f"; step {step + 1}" if step is not None else ""
    line = f"culprit: {who} on node {first['node_rank']} ({first['host']}) {why}{waits}{at}"
    return {
        "ranks": [f["rank"] for f, _, _ in found if f.get("rank") is not None],
        "node_rank": first["node_rank"],
        "host": first["host"],
        "kind": kind,
        "why": why,
        "collective": collective,
        "waiting_ranks": waiting,
        "step": None if step is None else step + 1,
        "suspect_hosts": sorted({f["host"] for f, k, _ in found if k in NODE_FAULTS}),
        "line": line,
    }


def _where(rank: dict) -> str:
    frames = main_thread(rank.get("stack") or "")
    if not frames:
        return "no Python stack"
    file, name = frames[0]
    return f"in {name} ({file.rsplit('/', 2)[-2:][-1]})"
