"""Preflight's disk check wants the space the plan will write: checkpoints only when the job saves them.

Real ``df`` through a real local connection, on a tmpfs of a known size (so the verdict
does not depend on this machine's free space): 8 GiB is plenty for a run that saves
nothing (logs, the progress record, the data cache) and too little for a GPU job's
ZeRO-3 checkpoints.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from orchestrator.planning.launchplan import make_plan
from orchestrator.preflight.checks import Context, check_disk
from orchestrator.spec.hostfile import Node
from orchestrator.spec.job import JobSpec
from orchestrator.transport.local import LocalConnection


def _tmpfs(tmp_path, size: int):
    """A tmpfs of ``size`` bytes (it takes no memory until written: a size is only a number here)."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        reason = "mounting a tmpfs needs root"
        if os.environ.get("DZCTL_REQUIRE_INTEGRATION") == "1":
            pytest.fail(reason + " (DZCTL_REQUIRE_INTEGRATION=1)")
        pytest.skip(reason)
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.fixture
def disk_of_8_gib(tmp_path):
    yield from _tmpfs(tmp_path, 8 * 2**30)


@pytest.fixture
def disk_of_1_5_gib(tmp_path):
    yield from _tmpfs(tmp_path, 3 * 2**29)


def _context(disk, accelerator: str, save: bool) -> Context:
    spec = JobSpec.model_validate(
        {
            "name": "t",
            "accelerator": accelerator,
            "model": {"name_or_path": "m"},
            "data": {"path": "/d.json"},
            "train": {"save": save, "output_dir": str(disk / "output")},
            "launch": {"remote_dir": str(disk / "dzctl")},
        }
    )
    plan = make_plan(spec, [Node("localhost", (0,))], "preflight")
    return Context(spec, plan, plan.nodes[0])


def test_gpu_job_that_saves_nothing_is_not_asked_for_checkpoint_space(disk_of_8_gib):
    check = check_disk(LocalConnection(), _context(disk_of_8_gib, "gpu", save=False))
    assert check.status == "ok", check
    assert f"{disk_of_8_gib / 'output'}: 8.0 GiB free" in check.detail and "checkpoint" not in check.detail


def test_gpu_job_that_saves_still_wants_checkpoint_space(disk_of_8_gib):
    check = check_disk(LocalConnection(), _context(disk_of_8_gib, "gpu", save=True))
    assert check.status == "warn", check
    assert "checkpoints want ≥ 100.0 GiB" in check.detail and "train.save_total_limit" in check.fix


def test_cpu_job_that_saves_nothing_passes_on_a_small_disk(disk_of_8_gib):
    assert check_disk(LocalConnection(), _context(disk_of_8_gib, "cpu", save=False)).status == "ok"


def test_job_that_saves_nothing_is_still_warned_when_its_logs_and_data_cache_may_not_fit(disk_of_1_5_gib):
    check = check_disk(LocalConnection(), _context(disk_of_1_5_gib, "gpu", save=False))
    assert check.status == "warn", check
    assert "train.save is false: the logs and the data cache want ≥ 2.0 GiB" in check.detail
    assert check.fix.startswith(f"free space on {disk_of_1_5_gib}") and "data.cache_dir" in check.fix
