"""A launched job's record keeps the collective check's figures, and `dzctl status` shows them."""

from __future__ import annotations

import sqlite3

from orchestrator.commands.jobs import render_status
from orchestrator.observe.status import JobStatus, NodeStatus
from orchestrator.observe.store import JobStore

FIGURES = {
    "ran": True, "ok": True, "backend": "nccl", "world_size": 16, "bytes": 256 * 2**20, "iters": 5,
    "busbw_gbs": 301.7, "algbw_gbs": 161.0, "form_s": 2.4, "elapsed_s": 11.2,
    "transports": {"within_node": ["P2P/CUMEM"], "between_nodes": ["NET/IB"], "network": "IB",
                   "intra_node_path": "NVL"},
}  # fmt: skip
OLD_SCHEMA = """CREATE TABLE jobs (job_id TEXT PRIMARY KEY, name TEXT NOT NULL, state TEXT NOT NULL,
runtime TEXT NOT NULL, image TEXT, hosts TEXT NOT NULL, spec TEXT NOT NULL, plan TEXT NOT NULL,
ssh_config TEXT, created REAL NOT NULL, finished REAL, reason TEXT)"""


def test_a_record_from_before_the_check_still_reads_and_takes_the_figures(tmp_path):
    path = tmp_path / "jobs.sqlite"
    with sqlite3.connect(path) as db:
        db.execute(OLD_SCHEMA)
        db.execute(
            "INSERT INTO jobs VALUES ('j1', 'j', 'running', 'docker', NULL, '[]', '{}', '{}', NULL, 1.0, NULL, NULL)"
        )
    with JobStore(path) as store:
        assert store.get("j1").preflight is None
        store.set_preflight("j1", {"collective": FIGURES})
    with JobStore(path) as store:
        assert store.get("j1").preflight == {"collective": FIGURES}


def test_status_shows_the_figures_and_keeps_its_keys():
    status = JobStatus(
        job="j", job_id="j1", state="running", nodes=[NodeStatus("h0", 0, "running", None, False, None)],
        progress=None, progress_age_s=None, first_failure=None, preflight={"collective": FIGURES},
    )  # fmt: skip
    data = status.to_dict()
    assert {"job", "job_id", "state", "nodes", "progress", "first_failure"} <= set(data)
    assert data["preflight"]["collective"]["busbw_gbs"] == 301.7
    text = render_status(status)
    assert "collective check: all-reduce 256 MiB × 5 over 16 rank(s), nccl: busbw 301.7 GB/s" in text
    assert "P2P/CUMEM within nodes, NET/IB between nodes; path NVLink" in text
