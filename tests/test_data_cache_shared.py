"""One data-cache folder shared by several nodes (issue 41, items 3, 5, 6 and 25).

Each node is a real process of its own (``tests/datanode.py``: the job loaded, the byte-level
tokenizer, ``train/data/prepare.py``), all on one cache folder, as nodes on shared storage
are. The bounds are lowered through their environment variables (``DZCTL_DATA_LOCK_STALE_S``,
``DZCTL_DATA_WAIT_S``) so that a silent phase of a few seconds outlasts them: here, counting the
rows of a mix whose first source has 1.2 M rows (44 MB, ~4.5 s here) while the mix takes 72 of
each, so the build after it is quick.

The silent-phase test keeps its bounds at 2 s (the heartbeat every 0.5 s) and counts that source
twice (~9 s of silence): at 1 s bounds it failed in two suite runs of 2026-12-06 (the waiting rank
saw no new word for 1 s) and never alone. The heartbeat's writes are small file writes that the
kernel stalls under the suite's writeback (its docker tests write gigabytes): beside a 10 GB write
here, the largest gap between two of its notes grew from 0.43 s to 0.64 s at a 0.25 s interval.
At production bounds (5 s beats, 300 s bounds) such a stall is far inside the margin.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_data_cache import SAMPLE, _job

from orchestrator.train.data import cache

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIG_ROWS = 1_200_000


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("big") / "big.jsonl"
    path.write_text((json.dumps({"instruction": "q", "output": "a"}) + "\n") * BIG_ROWS, encoding="utf-8")
    return path


def _mix_job(tmp_path: Path, big: Path, big_sources: int = 1) -> Path:
    mix = [{"path": str(big)}] * big_sources + [{"path": str(SAMPLE)}]
    loaded = _job(tmp_path, {"sources": mix})
    return loaded.path


def _node(job: Path, cache_dir: Path, local_rank: int, node: str, **env: str) -> subprocess.Popen:
    """One rank's data preparation; ``node`` names its launch (ranks of one node share it)."""
    environ = {**os.environ, "DZCTL_JOB_ID": node, "PYTHONPATH": str(ROOT), **env}
    argv = [sys.executable, str(HERE / "datanode.py"), str(job), str(cache_dir), str(local_rank)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _result(out: str) -> dict:
    return json.loads(out.split("result ", 1)[1].splitlines()[0])


def _waited(out: str) -> float:
    """How long the rank spent in prepare(): from its ``preparing at`` line to its ``ended at`` one."""
    started = float(out.split("preparing at ", 1)[1].split()[0])
    return float(out.split("ended at ", 1)[1].split()[0]) - started


def _wait_for(pattern: str, folder: Path, timeout: float = 60) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(folder.glob(pattern)) if folder.is_dir() else []
        if found:
            return found[0]
        time.sleep(0.02)
    pytest.fail(f"no {pattern} in {folder} after {timeout:g} s")


def test_a_silent_phase_longer_than_both_bounds_keeps_the_lock_and_the_waiting_rank(tmp_path, big):
    """Node A counts its mix for seconds with both bounds at 2 s: node B waits for it, A's other rank too."""
    job, folder = _mix_job(tmp_path, big, big_sources=2), tmp_path / "cache"
    bounds = {"DZCTL_DATA_LOCK_STALE_S": "2", "DZCTL_DATA_WAIT_S": "2"}
    builder = _node(job, folder, 0, "node-a", **bounds)
    _wait_for("*.lock", folder)
    waiter = _node(job, folder, 1, "node-a", **bounds)
    other = _node(job, folder, 0, "node-b", **bounds)
    results = [_finish(p) for p in (builder, waiter, other)]
    for code, out in results:
        assert code == 0, out
    (_, built), (_, waited), (_, second) = results
    # Proof that the silence outlasted the bounds: the waiting rank waited longer than its own.
    assert _waited(waited) > 3, f"waited {_waited(waited):.1f} s: not past the 2 s bound, the test proves nothing"
    assert "data: building cache" in built and "data: building cache" not in second, second
    assert "is building cache" in second and "data: cached: mapped" in second, second
    assert len({_result(out)["key"] for _, out in results}) == 1
    assert _result(waited)["examples"] == _result(built)["examples"] == 216  # 72 of each source
    assert not list(folder.glob("*.lock*")) and not list(folder.glob("building-*"))


def test_a_builder_killed_mid_build_is_taken_over_once_its_lock_is_stale(tmp_path, big):
    job, folder = _mix_job(tmp_path, big), tmp_path / "cache"
    bounds = {"DZCTL_DATA_LOCK_STALE_S": "1"}
    killed = _node(job, folder, 0, "node-a", **bounds)
    lock = _wait_for("*.lock", folder)
    _wait_for("building-*", folder)
    killed.kill()
    killed.wait()
    assert lock.exists()  # its holder is gone: nobody touches it any more
    code, out = _finish(_node(job, folder, 0, "node-b", **bounds))
    assert code == 0, out
    assert "data: building cache" in out and _result(out)["examples"] == 144
    assert not lock.exists()
    # The dead build's folder stays until the prune rule's day has passed.
    assert [p.name.split("-")[1] for p in folder.glob("building-*")] == [_result(out)["key"]]


def test_a_stalled_builder_uses_the_cache_built_meanwhile_and_leaves_the_next_lock_alone(tmp_path, big):
    """A builder stopped past the lock bound (a frozen VM, a storage stall) comes back after another built."""
    job, folder = _mix_job(tmp_path, big), tmp_path / "cache"
    bounds = {"DZCTL_DATA_LOCK_STALE_S": "1"}
    stalled = _node(job, folder, 0, "node-a", **bounds)
    _wait_for("*.lock", folder)
    _wait_for("building-*", folder)
    stalled.send_signal(signal.SIGSTOP)
    try:
        code, out = _finish(_node(job, folder, 0, "node-b", **bounds))
        assert code == 0, out
        assert "data: building cache" in out
        key = _result(out)["key"]
        # A third node holds the key's lock now (its own relaunch, say): nobody else may remove it.
        third = cache.KeyLock(folder, key)
        assert third.try_take()
    finally:
        stalled.send_signal(signal.SIGCONT)
    code, out = _finish(stalled)
    assert code == 0, out
    assert f"another node finished cache {key} first: using it" in out and _result(out)["key"] == key
    assert third.mine(), "the stalled builder's release removed the third node's lock"
    third.release()


def test_nodes_pruning_one_folder_at_once_never_crash(tmp_path):
    """Six processes apply the prune rule to one folder at once, as six nodes ending their build do."""
    folder = tmp_path / "cache"
    for index in range(60):
        old = time.time() - 3 * 86400 - index  # k001 is the most recently used after k000 (the current one)
        for kind in (f"k{index:03d}", f"building-b{index:03d}-node-1"):
            (folder / kind).mkdir(parents=True)
            for part in range(20):
                (folder / kind / f"{part}.bin").write_bytes(b"x")
            if kind.startswith("k"):  # a whole cache; a dead build has no manifest
                (folder / kind / cache.MANIFEST).write_text("{}")
                (folder / kind / cache.LAST_USED).write_text("")
            for path in (folder / kind).iterdir():
                os.utime(path, (old, old))
            os.utime(folder / kind, (old, old))
    (folder / "runs").mkdir()
    for index in range(60):
        note = folder / "runs" / f"n{index}.json"
        note.write_text("{}")
        os.utime(note, (old, old))
    go = tmp_path / "go"
    script = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from orchestrator.train.data import cache\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.001)\n"
        "for _ in range(5): cache.prune(Path(sys.argv[1]), current='k000')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", script, str(folder), str(go)]
    procs = [subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True) for _ in range(6)]
    time.sleep(1.0)  # every process imported and waiting at the line
    go.touch()
    errors = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, "\n".join(errors)
    left = sorted(p.name for p in folder.iterdir() if p.name != "runs")
    assert left == ["k000", "k001", "k002"] and not list((folder / "runs").iterdir())


def test_simultaneous_saves_of_fingerprints_never_collide(tmp_path):
    """Writers with one pid (threads here; nodes' containers in the field) each use a temporary name of their own."""
    errors: list[BaseException] = []

    def save(index: int) -> None:
        prints = cache.Fingerprints(tmp_path)
        for round_ in range(25):
            prints.known = {f"/data/{index}-{round_}.jsonl": [1, 2, 3, 4, 5.0, "hash"]}
            prints.changed = True
            try:
                prints.save()
            except BaseException as exc:  # every failure is the finding
                errors.append(exc)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, f"{len(errors)} of 200 saves failed: {errors[0]!r}"
    assert len(json.loads((tmp_path / "fingerprints.json").read_text())) == 1
    assert not list(tmp_path.glob(".fingerprints.json.*"))


def test_a_release_removes_only_its_own_lock(tmp_path):
    """A holder whose lock was broken (it went silent past the bound) must not remove the next holder's."""
    first, second = cache.KeyLock(tmp_path, "k"), cache.KeyLock(tmp_path, "k")
    assert first.try_take() and not second.try_take()
    past = time.time() - cache.LOCK_STALE_S - 10
    os.utime(first.path, (past, past))  # first went silent for longer than the bound
    assert second.try_take()
    first.refresh()
    first.release()
    assert second.path.exists() and second.mine()
    assert not second.stale()
    second.release()
    assert not second.path.exists()
