"""The supervision record: one row per supervised job, beside the job records in ``$DZCTL_HOME``.

A supervised job is a line of attempts: the launch's job, then one new job (its own job id,
containers, logs and progress lines) per restart, all with the job's name and output dir, so
each resumes from the newest complete checkpoint of the one before. ``lineage`` is the first
attempt's job id; ``current_job_id`` the newest that started. The row says what the
supervisor is doing (``state``), the restarts with their causes and the nodes replaced,
the notifications sent, and the launch's own arguments, which each restart reuses.

States: watching (an attempt runs) · backoff (waiting before the relaunch) · restarting
(preflight and start) · stopped (``dzctl stop``: nothing starts again) · succeeded ·
gave-up (a failure no restart can fix, or the limit: ``final`` says why).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from ...observe.store import dzctl_home

SCHEMA = """
CREATE TABLE IF NOT EXISTS supervision (
    lineage         TEXT PRIMARY KEY,
    name            TEXT NOT NULL,
    state           TEXT NOT NULL,
    pid             INTEGER,
    current_job_id  TEXT NOT NULL,
    attempts        TEXT NOT NULL,  -- JSON list of job ids, oldest first (one not yet started may end it)
    restarts        TEXT NOT NULL,  -- JSON list of restarts: cause, why, nodes replaced, times
    notifications   TEXT NOT NULL,  -- JSON list: event, job id, outcome (the URL is never kept)
    launch          TEXT NOT NULL,  -- JSON: the launch's arguments (job file, --set, hostfile, ssh config)
    final           TEXT,           -- why the supervisor ended
    updated         REAL NOT NULL
);
"""
ENDED = frozenset({"stopped", "succeeded", "gave-up"})


@dataclass(frozen=True)
class Supervision:
    lineage: str
    name: str
    state: str
    pid: int | None
    current_job_id: str
    attempts: list[str]
    restarts: list[dict]
    notifications: list[dict]
    launch: dict
    final: str | None
    updated: float

    def summary(self, max_restarts: int | None) -> dict:
        """``status --json``'s ``restarts`` object."""
        return {
            "count": len(self.restarts),
            "max": max_restarts,
            "supervisor": self.state,
            "pid": self.pid,
            "lineage": self.lineage,
            "attempts": self.attempts,
            "history": self.restarts,
            "final": self.final,
            "notifications": self.notifications,
        }


class SupervisionStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or dzctl_home() / "jobs.sqlite"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> SupervisionStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, lineage: str, name: str, launch: dict) -> None:
        self._db.execute(
            "INSERT INTO supervision (lineage, name, state, current_job_id, attempts, restarts, notifications,"
            " launch, updated) VALUES (?, ?, 'watching', ?, ?, '[]', '[]', ?, ?)",
            (lineage, name, lineage, json.dumps([lineage]), json.dumps(launch), time.time()),
        )

    def get(self, lineage: str) -> Supervision:
        row = self._db.execute("SELECT * FROM supervision WHERE lineage = ?", (lineage,)).fetchone()
        if row is None:
            raise KeyError(lineage)
        return _supervision(row)

    def of_job(self, job_id: str, name: str) -> Supervision | None:
        """The supervision a job id belongs to (any of its attempts), or None."""
        rows = self._db.execute("SELECT * FROM supervision WHERE name = ? ORDER BY updated DESC", (name,))
        for row in rows.fetchall():
            found = _supervision(row)
            if job_id in found.attempts:
                return found
        return None

    def _update(self, lineage: str, **values) -> None:
        columns = ", ".join(f"{k} = ?" for k in values)
        encoded = [json.dumps(v) if isinstance(v, (list, dict)) else v for v in values.values()]
        self._db.execute(
            f"UPDATE supervision SET {columns}, updated = ? WHERE lineage = ?", (*encoded, time.time(), lineage)
        )

    def set_pid(self, lineage: str, pid: int) -> None:
        self._update(lineage, pid=pid)

    def set_state(self, lineage: str, state: str, final: str | None = None) -> bool:
        """Move to ``state`` unless the row has ended (a stop wins over everything after it): True if moved."""
        cursor = self._db.execute(
            "UPDATE supervision SET state = ?, final = COALESCE(?, final), updated = ?"
            f" WHERE lineage = ? AND state NOT IN ({', '.join('?' * len(ENDED))})",
            (state, final, time.time(), lineage, *sorted(ENDED)),
        )
        return cursor.rowcount == 1

    def stop(self, lineage: str, why: str) -> None:
        """``dzctl stop``: the row ends as stopped, whatever the supervisor does next."""
        self._db.execute(
            "UPDATE supervision SET state = 'stopped', final = ?, updated = ? WHERE lineage = ?"
            " AND state NOT IN ('succeeded', 'gave-up')",
            (why, time.time(), lineage),
        )

    def add_attempt(self, lineage: str, job_id: str) -> None:
        found = self.get(lineage)
        self._update(lineage, attempts=[*found.attempts, job_id])

    def started(self, lineage: str, job_id: str, restart: dict) -> None:
        found = self.get(lineage)
        self._update(lineage, current_job_id=job_id, restarts=[*found.restarts, restart])

    def notified(self, lineage: str, outcome: dict) -> None:
        found = self.get(lineage)
        self._update(lineage, notifications=[*found.notifications, outcome])


def _supervision(row: tuple) -> Supervision:
    lineage, name, state, pid, current, attempts, restarts, notifications, launch, final, updated = row
    return Supervision(
        lineage=lineage,
        name=name,
        state=state,
        pid=pid,
        current_job_id=current,
        attempts=json.loads(attempts),
        restarts=json.loads(restarts),
        notifications=json.loads(notifications),
        launch=json.loads(launch),
        final=final,
        updated=updated,
    )
