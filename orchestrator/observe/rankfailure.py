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


_SUMMARY_ENTRY = re.compile(r"^\s*\[\d+\]:\s*$")
_SUMMARY_RULE = re.compile(r"^\s*={10,}\s*$")
# torchrun's closing signal to the ranks still running once one failed (its --start-method's
# processes get SIGTERM, then SIGKILL after a grace): a rank it ended did not fail by itself.
TORCHRUN_STOP_SIGNAL = 15
SIGNAL_NAMES = {6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}


def torchrun_failures(lines: list[str]) -> list[dict]:
    """Every rank torchrun's last failure summary lists: ``{"rank", "exitcode", "root"}``, in its order.

    ``exitcode`` is torchrun's (``-N`` for a death by signal N); ``root`` marks its "Root Cause",
    which is only the earliest by one-second timestamps: a rank killed outright and the rank whose
    collective then failed often share the second, and the tie goes to the lower rank.
    """
    root_at = max((i for i, line in enumerate(lines) if _ROOT_CAUSE in line), default=None)
    if root_at is None:
        return []
    start = max((i for i in range(root_at) if _SUMMARY_RULE.match(lines[i])), default=0)
    end = next((i for i in range(root_at + 1, len(lines)) if _SUMMARY_RULE.match(lines[i])), len(lines))
    failures: list[dict] = []
    for i in range(start, end):
        if _SUMMARY_ENTRY.match(lines[i]):
            failures.append({"root": i > root_at})
        elif failures and (rank := _SUMMARY_RANK.match(lines[i])):
            failures[-1].setdefault("rank", int(rank.group(1)))
        elif failures and (code := _SUMMARY_EXIT.match(lines[i])):
            failures[-1].setdefault("exitcode", int(code.group(1)))
    return [f for f in failures if "rank" in f and "exitcode" in f]


def killed_outright(failures: list[dict], reported_ranks: set[int]) -> dict | None:
    """The node's rank that died first by its own death, where that is a signal and not an error it raised.

    When one rank of a node is killed (SIGKILL: the OOM killer, a kill), its peers' collectives
    fail after it ("Connection reset by peer") and they report that error: the rank that raised
    reports, the killed one cannot. So a rank that torchrun saw die by a signal, that wrote no error
    event of its own (``reported_ranks``), and that torchrun did not stop itself (its SIGTERM to the
    survivors), failed before the ranks that reported, whatever torchrun's one-second root cause
    says. Returns what first_failure reports of it (``rank``, ``exit_code`` as a shell says it,
    ``reason``, ``message``), or None when no such rank is listed.
    """
    killed = [
        f
        for f in failures
        if f["exitcode"] < 0 and -f["exitcode"] != TORCHRUN_STOP_SIGNAL and f["rank"] not in reported_ranks
    ]
    if not killed:
        return None
    first = min(killed, key=lambda f: (not f["root"], f["rank"]))
    number = -first["exitcode"]
    name = SIGNAL_NAMES.get(number, f"signal {number}")
    text = (
        f"killed by signal {number} ({name}) without an error of its own (the kernel's OOM killer, "
        "a kill, or a lost node); the other ranks' errors followed it"
    )
    return {"rank": first["rank"], "exit_code": rank_exit_code(first["exitcode"]), "reason": text, "message": text}


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
