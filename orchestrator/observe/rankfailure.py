"""A failed rank's own account: its error event, torchrun's root cause, and the lines that show it once.

Pure. When a rank fails, three parties say so in the node's log: the trainer (its
``error`` event, then its ``error:``/``fix:`` lines or traceback, train/entry.py), the
launcher (torchrun's ``ChildFailedError`` traceback and its summary, which names the
failed local rank and its ``exitcode``), and the node's end (the container's or
process's exit code: torchrun's own 1, whatever the rank's was). The rank's words and
its exit code are what a person needs; this module finds them.
"""

from __future__ import annotations

import json
import re

PROGRESS_PREFIX = "dzctl-progress "
_RANK_PREFIX = re.compile(r"^\[(?:rank)?\d+\]:")
# torchrun's summary after ChildFailedError (torch.distributed.elastic.multiprocessing.errors):
#   Root Cause (first observed failure):
#   [0]:
#     ...
#     rank      : 0 (local_rank: 0)
#     exitcode  : 2 (pid: 1234)
_ROOT_CAUSE = "Root Cause (first observed failure):"
CHILD_FAILED = "ChildFailedError"
TRACEBACK = "Traceback (most recent call last):"
_SUMMARY_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\b")
_SUMMARY_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\b")


def error_details(event: dict) -> dict:
    """The keys of an ``error`` event a failure report uses (older trainers wrote ``reason`` and ``rank`` only)."""
    details = {"rank": event.get("rank"), "reason": str(event.get("reason") or "error")}
    for key in ("message", "fix", "exit_code", "failure_seq"):
        if event.get(key) is not None:
            details[key] = event[key]
    return details


def errors_in_log(lines: list[str]) -> list[dict]:
    """The ``error`` events a node's ranks echoed into its log, oldest first.

    The node's own log has them even where rank 0's progress.jsonl cannot be read for
    that node (node-local output disks), and before any output folder existed.
    """
    found = []
    for line in lines:
        text = _RANK_PREFIX.sub("", line.strip(), count=1).strip()
        if not text.startswith(PROGRESS_PREFIX):
            continue
        try:
            event = json.loads(text[len(PROGRESS_PREFIX) :])
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("event") == "error":
            found.append(error_details(event))
    return found


def torchrun_root_cause(lines: list[str]) -> dict | None:
    """``{"rank": global rank, "exit_code": N}`` from torchrun's last failure summary in a node's log."""
    start = max((i for i, line in enumerate(lines) if _ROOT_CAUSE in line), default=None)
    if start is None:
        return None
    cause: dict = {}
    for line in lines[start + 1 : start + 12]:
        rank, code = _SUMMARY_RANK.match(line), _SUMMARY_EXIT.match(line)
        if rank and "rank" not in cause:
            cause["rank"] = int(rank.group(1))
        if code and "exit_code" not in cause:
            cause["exit_code"] = int(code.group(1))
    return cause if "exit_code" in cause else None


def before_launcher_report(lines: list[str]) -> list[str]:
    """The lines before torchrun's own traceback: its ``ChildFailedError`` and summary only repeat the rank."""
    failed_at = next((i for i in range(len(lines) - 1, -1, -1) if CHILD_FAILED in lines[i]), None)
    if failed_at is None:
        return lines
    start = next((i for i in range(failed_at, -1, -1) if lines[i].strip().startswith(TRACEBACK)), failed_at)
    return lines[:start]


def rank_details(event: dict | None, cause: dict | None) -> dict:
    """What status.first_failure reports of the failed rank: its error event, else torchrun's root cause."""
    details = dict(event or {})
    if cause:
        details.setdefault("rank", cause.get("rank"))
        details.setdefault("exit_code", rank_exit_code(cause["exit_code"]))
    return {key: value for key, value in details.items() if value is not None}


def rank_exit_code(code: int) -> int:
    """A rank killed by a signal: torchrun reports ``-N``, a shell (and docker) ``128 + N``."""
    return 128 - code if code < 0 else code


def failure_lines(failure: dict) -> list[str]:
    """The first failure as a person reads it: where, the rank's exit code, its own message; then its fix."""
    where = f"node {failure['node_rank']} ({failure['host']})"
    if failure.get("rank") is not None:
        where += f", rank {failure['rank']}"
    message = failure.get("message") or failure.get("reason")
    lines = [f"first failure: {where}, exit {failure.get('exit_code')}: {message}"]
    if failure.get("fix"):
        lines.append(f"fix: {failure['fix']}")
    return lines
