"""Preflight's NVMe checks (zero.nvme_path) on real test hosts over real SSH, and their verdicts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.preflight import render_report, run_preflight
from orchestrator.preflight.nvme import LIBAIO_FIX, NvmeProbe, async_io_check, nvme_check
from orchestrator.spec.hostfile import load_nodes
from orchestrator.spec.job import load_job
from orchestrator.transport.pool import HostPool

REPO = Path(__file__).resolve().parents[1]
CPU_JOB = REPO / "jobs" / "tiny-cpu.yaml"


def _job(path: Path, *extra: str, port: int = 29581):
    sets = [f"launch.python={sys.executable}", f"launch.master_port={port}", f"zero.nvme_path={path}", *extra]
    return load_job(CPU_JOB, sets, "process")


@pytest.mark.integration
def test_nvme_path_checked_on_every_host(cluster, tmp_path):
    hosts = cluster(2)
    nodes = load_nodes(hosts.write_hostfile(tmp_path / "hostfile", slots=1))
    good = tmp_path / "nvme"
    good.mkdir()
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    # Root may write anywhere chmod forbids; an immutable folder (ext4 attribute) refuses even root.
    subprocess.run(["chattr", "+i", str(frozen)], check=True)
    # The tiny job with a vocabulary of 4 M and hidden 16,384: ~130 B parameters, ~2.6 TB of NVMe states.
    huge = ["zero.offload=nvme", "model.config.vocab_size=4000000", "model.config.hidden_size=16384"]
    try:
        with HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config) as pool:
            usable = run_preflight(_job(good, "zero.offload=nvme"), nodes, pool)
            not_writable = run_preflight(_job(frozen, port=29582), nodes, pool)
            missing = run_preflight(_job(tmp_path / "absent", port=29583), nodes, pool)
            too_small = run_preflight(_job(good, *huge, port=29584), nodes, pool)
    finally:
        subprocess.run(["chattr", "-i", str(frozen)], check=False)
    assert usable.ok, render_report(usable)
    for host in usable.hosts:
        check = host.check("nvme")
        assert check.status in ("ok", "warn"), check
        assert str(good) in check.detail and "GiB free" in check.detail
        assert "direct I/O write" in check.detail and "MiB/s" in check.detail
        assert host.check("nvme-aio").status == "ok"  # this venv's DeepSpeed builds async_io (libaio present)
    assert set(usable.nvme) == {h.name for h in hosts.hosts}
    for reading in usable.nvme.values():
        assert reading["free_bytes"] > 0 and reading["read_bytes_per_s"] > 0 and reading["write_bytes_per_s"] > 0
    assert not list(good.iterdir())  # the probe file is gone
    for host in not_writable.hosts:
        check = host.check("nvme")
        assert check.status == "fail" and "is not writable" in check.detail and "chown/chmod" in check.fix
    assert not not_writable.nvme
    for host in missing.hosts:
        assert host.check("nvme").status == "fail" and "does not exist" in host.check("nvme").detail
        assert "mkdir -p" in host.check("nvme").fix
    for host in too_small.hosts:
        check = host.check("nvme")
        # The planner's NVMe bytes for this model do not fit this machine's disk.
        assert check.status == "fail" and "offload to NVMe needs" in check.detail, check
        assert check.detail.endswith("GiB per node") and "free space" in check.fix


def test_verdicts_on_probe_answers():
    fast = NvmeProbe("/nvme", None, free_bytes=2**40, read_bytes_per_s=3e9, write_bytes_per_s=2e9)
    assert nvme_check(fast, need_bytes=2**39).status == "ok"
    assert nvme_check(fast, need_bytes=2**41).status == "fail"
    slow = NvmeProbe("/nvme", None, free_bytes=2**40, read_bytes_per_s=50 * 2**20, write_bytes_per_s=2e9)
    assert nvme_check(slow, need_bytes=None).status == "warn"
    no_direct = NvmeProbe("/nvme", "no direct I/O", error="Invalid argument")
    assert "O_DIRECT" in nvme_check(no_direct, None).detail
    missing_aio = async_io_check({"async_io": False}, "in the image")
    assert missing_aio.status == "fail" and missing_aio.fix == LIBAIO_FIX and "libaio-dev" in LIBAIO_FIX
    old_deepspeed = async_io_check({"async_io_error": "ImportError: no AsyncIOBuilder"}, "python3 on the node")
    assert old_deepspeed.status == "fail" and "ImportError" in old_deepspeed.detail
