"""``dzctl logs`` for a Slurm job (issue 28, item 8): the ranks' logs are read from the shared job
directory by byte offset, so a CRLF line end or a byte that is not UTF-8 neither repeats nor skips
output while following.

A real log file grows while ``stream_logs`` follows it. Whether the Slurm job has ended is the one
thing asked of Slurm here; the test sets it (the byte offsets are the subject, not Slurm).
"""

from __future__ import annotations

import threading
import time

from orchestrator.backends.slurm import backend
from orchestrator.observe.store import JobRecord


def _record(job_dir) -> JobRecord:
    plan = {"nodes": [{"node_rank": 0, "host": "node0", "job_dir": str(job_dir)}], "slurm": {"job_id": "7"}}
    return JobRecord("j-1", "j", "running", "process", None, ["node0"], {}, plan, None, 0.0, None, None)


def _wait_for(predicate, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_follow_prints_each_line_once_across_crlf_invalid_utf8_and_a_growing_file(tmp_path, monkeypatch):
    slurm = {"state": "running"}
    monkeypatch.setattr(backend, "slurm_state", lambda record: slurm["state"])
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"step 1\r\nstep 2\r\nstep 3\r\nbad \xff\xfe byte\nstep 4 half")
    shown: list[str] = []
    follower = threading.Thread(
        target=backend.stream_logs, args=(_record(tmp_path),),
        kwargs={"ranks": None, "tail": None, "follow": True, "write": shown.append}, daemon=True,
    )  # fmt: skip
    follower.start()
    _wait_for(lambda: "byte" in "".join(shown), "the first lines")
    time.sleep(1.5)  # at least one more read of the file as it stands
    with open(log, "ab") as handle:
        handle.write(b" done\r\nstep 5 \xe2\x82")  # a UTF-8 character cut in two by the writer
        handle.flush()
        time.sleep(1.5)
        handle.write(b"\xac euro\r\n")
    _wait_for(lambda: "euro" in "".join(shown), "the grown lines")
    slurm["state"] = "succeeded"
    follower.join(timeout=10)
    assert not follower.is_alive()
    assert "".join(shown).splitlines() == [
        "[0 node0] step 1",
        "[0 node0] step 2",
        "[0 node0] step 3",
        "[0 node0] bad \ufffd\ufffd byte",
        "[0 node0] step 4 half done",
        "[0 node0] step 5 \u20ac euro",
    ]


def test_tail_counts_lines_of_the_bytes_and_follow_ends_with_the_last_partial_line(tmp_path, monkeypatch):
    monkeypatch.setattr(backend, "slurm_state", lambda record: "failed")
    (tmp_path / "rank-0.log").write_bytes(b"a\r\nb \xff\r\nc\r\nlast words")
    shown: list[str] = []
    backend.stream_logs(_record(tmp_path), ranks=[0], tail=2, follow=False, write=shown.append)
    assert "".join(shown).splitlines() == ["[0 node0] c", "[0 node0] last words"]
    shown.clear()
    # The job has ended: following prints what there is, the unfinished last line too, once.
    backend.stream_logs(_record(tmp_path), ranks=[0], tail=None, follow=True, write=shown.append)
    assert "".join(shown).splitlines() == ["[0 node0] a", "[0 node0] b \ufffd", "[0 node0] c", "[0 node0] last words"]
