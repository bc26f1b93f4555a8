"""The local job record: SQLite under ``$DZCTL_HOME`` (default ``~/.dzctl``).

The record says what was launched where; the truth about a running job comes
from the hosts (containers by label, rank states, progress.jsonl). Secrets are
never stored: the spec kept here is the secret-free one, and plans mask values.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id      TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    state       TEXT NOT NULL,
    runtime     TEXT NOT NULL,
    image       TEXT,
    hosts       TEXT NOT NULL,  -- JSON list, rank order
    spec        TEXT NOT NULL,  -- JSON, secret-free
    plan        TEXT NOT NULL,  -- JSON, secret values masked
    ssh_config  TEXT,
    created     REAL NOT NULL,
    finished    REAL,
    reason      TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_name ON jobs (name, created);
"""
# Columns added after the first release: added to an older file when it is opened.
ADDED_COLUMNS = {"preflight": "TEXT"}  # JSON: what the launch's checks measured (the collective check)

FINAL_STATES = frozenset({"succeeded", "failed", "stopped"})


def dzctl_home() -> Path:
    return Path(os.environ.get("DZCTL_HOME") or Path.home() / ".dzctl")


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    name: str
    state: str
    runtime: str
    image: str | None
    hosts: list[str]
    spec: dict
    plan: dict
    ssh_config: str | None
    created: float
    finished: float | None
    reason: str | None
    preflight: dict | None = None


class JobStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or dzctl_home() / "jobs.sqlite"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit, a short busy timeout: several dzctl processes may share the file.
        self._db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        self._db.executescript(SCHEMA)
        have = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for column, kind in ADDED_COLUMNS.items():
            if column not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add(self, *, job_id, name, runtime, image, hosts, spec, plan, ssh_config) -> None:
        self._db.execute(
            "INSERT INTO jobs (job_id, name, state, runtime, image, hosts, spec, plan, ssh_config, created)"
            " VALUES (?, ?, 'starting', ?, ?, ?, ?, ?, ?, ?)",
            (job_id, name, runtime, image, json.dumps(hosts), json.dumps(spec), json.dumps(plan), ssh_config,
             time.time()),
        )  # fmt: skip

    def set_state(self, job_id: str, state: str, reason: str | None = None) -> None:
        finished = time.time() if state in FINAL_STATES else None
        self._db.execute(
            "UPDATE jobs SET state = ?, reason = COALESCE(?, reason), finished = COALESCE(finished, ?)"
            " WHERE job_id = ?",
            (state, reason, finished, job_id),
        )

    def set_preflight(self, job_id: str, figures: dict) -> None:
        self._db.execute("UPDATE jobs SET preflight = ? WHERE job_id = ?", (json.dumps(figures), job_id))

    def get(self, ref: str) -> JobRecord:
        """A job by id, or the newest job of that name."""
        row = self._db.execute("SELECT * FROM jobs WHERE job_id = ?", (ref,)).fetchone()
        if row is None:
            row = self._db.execute("SELECT * FROM jobs WHERE name = ? ORDER BY created DESC LIMIT 1", (ref,)).fetchone()
        if row is None:
            raise InputError(f"no job named or with id {ref!r} in {self.path}", fix="`dzctl status` lists the jobs")
        return _record(row)

    def active_with_name(self, name: str) -> list[JobRecord]:
        rows = self._db.execute(
            "SELECT * FROM jobs WHERE name = ? AND state NOT IN ('succeeded', 'failed', 'stopped')"
            " ORDER BY created DESC",
            (name,),
        ).fetchall()
        return [_record(r) for r in rows]

    def all(self, limit: int = 50) -> list[JobRecord]:
        rows = self._db.execute("SELECT * FROM jobs ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
        return [_record(r) for r in rows]


def _record(row: tuple) -> JobRecord:
    job_id, name, state, runtime, image, hosts, spec, plan, ssh_config, created, finished, reason = row[:12]
    preflight = row[12] if len(row) > 12 else None
    return JobRecord(
        job_id=job_id,
        name=name,
        state=state,
        runtime=runtime,
        image=image,
        hosts=json.loads(hosts),
        spec=json.loads(spec),
        plan=json.loads(plan),
        ssh_config=ssh_config,
        created=created,
        finished=finished,
        reason=reason,
        preflight=json.loads(preflight) if preflight else None,
    )
