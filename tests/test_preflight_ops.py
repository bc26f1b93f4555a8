"""Preflight's ``deepspeed-ops`` check: the ops a plan loads must load where the job runs.

On real test hosts over real SSH, ``runtime: process`` with this venv's real DeepSpeed. The
compiler is "removed" as the job would see it: the job's ``launch.env.PATH`` is a folder with
ninja and a shell but no C++ compiler, and ``TORCH_EXTENSIONS_DIR`` is a fresh folder, so no op
was built earlier. That is how DeepSpeed decides: ``CPUAdamBuilder().is_compatible()`` says True
without a compiler, and ``DeepSpeedCPUAdam`` then fails with "the cpu_adam op, which failed to
build/load" (checked by hand with this venv, ``CXX=/nonexistent/c++``). The last integration test
does the same with the CPU image itself on real docker hosts, its compilers deleted.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from orchestrator.errors import RuntimeFailure
from orchestrator.preflight import render_report, run_preflight
from orchestrator.preflight.model import PreflightReport
from orchestrator.spec.hostfile import load_nodes
from orchestrator.spec.job import load_job
from orchestrator.transport.pool import HostPool

REPO = Path(__file__).resolve().parents[1]
CPU_JOB = REPO / "jobs" / "tiny-cpu.yaml"
NO_CC = "no C++ compiler: c++ ($CXX, else c++) is not on PATH"


def _job(port: int, *sets: str):
    return load_job(CPU_JOB, [f"launch.python={sys.executable}", f"launch.master_port={port}", *sets], "process")


def _path_without_compiler(folder: Path) -> Path:
    folder.mkdir()
    for tool in ("ninja", "sh", "bash"):
        (folder / tool).symlink_to(shutil.which(tool))
    assert not any(shutil.which(cc, path=str(folder)) for cc in ("c++", "g++", "gcc", "cc"))
    return folder


@pytest.mark.integration
def test_offload_plan_fails_before_anything_starts_where_no_compiler_can_build_cpu_adam(cluster, tmp_path):
    hosts = cluster(2)
    nodes = load_nodes(hosts.write_hostfile(tmp_path / "hostfile", slots=1))
    fresh = [f"launch.env.TORCH_EXTENSIONS_DIR={tmp_path / 'extensions'}"]
    no_compiler = [*fresh, f"launch.env.PATH={_path_without_compiler(tmp_path / 'bin')}"]
    with HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config) as pool:
        offload = run_preflight(_job(29641, *no_compiler, "zero.offload=optimizer"), nodes, pool)
        plain = run_preflight(_job(29642, *no_compiler, "zero.offload=none"), nodes, pool)
        with_compiler = run_preflight(_job(29643, *fresh, "zero.offload=optimizer"), nodes, pool)
    for host in offload.hosts:
        check = host.check("deepspeed-ops")
        assert check is not None and check.status == "fail", render_report(offload)
        assert f"cpu_adam (optimizer offload) is not prebuilt and cannot be JIT-built: {NO_CC}" in check.detail
        assert f"deepspeed_shm_comm (DeepSpeed's CPU collectives) is not prebuilt and cannot be JIT-built: {NO_CC}" in (
            check.detail
        )
        assert check.detail.endswith("the run would die at its first step")
        assert check.fix.startswith("install a C++ compiler and ninja where the job runs")
    assert not offload.ok
    for host in plain.hosts:  # no offload: only the op every CPU run loads
        check = host.check("deepspeed-ops")
        assert check.status == "fail" and "deepspeed_shm_comm" in check.detail and "cpu_adam" not in check.detail
    assert with_compiler.ok, render_report(with_compiler)
    for host in with_compiler.hosts:
        check = host.check("deepspeed-ops")
        assert check.status == "ok", check
        compiler = shutil.which("c++")
        assert f"cpu_adam JIT-buildable ({compiler}, ninja)" in check.detail
        assert f"deepspeed_shm_comm JIT-buildable ({compiler}, ninja)" in check.detail
    assert set(with_compiler.deepspeed_ops) == {h.name for h in hosts.hosts}
    assert not (tmp_path / "extensions").exists()  # the probe builds nothing


# The probe's answers as the test above records them (the Python probe in preflight/checks.py).
BUILT = {"op": "deepspeed_shm_comm", "how": "built", "dir": "/opt/venv/torch-extensions/deepspeed_shm_comm"}
NOT_BUILDABLE = {"op": "cpu_adam", "how": "jit", "tools": "c++, ninja", "missing": [NO_CC]}
SHM_COMM, CPU_ADAM = "ShareMemCommBuilder", "CPUAdamBuilder"


def test_which_ops_each_plan_loads():
    from orchestrator.preflight.loading.ops import ops_check, ops_to_probe

    assert ops_to_probe("cpu", False, False) == ([SHM_COMM], [])
    assert ops_to_probe("cpu", True, False) == ([SHM_COMM, CPU_ADAM], [])
    assert ops_to_probe("gpu", False, False) == ([], [])  # torch's fused AdamW: no DeepSpeed op
    assert ops_to_probe("gpu", True, True) == ([CPU_ADAM, "AsyncIOBuilder"], [])
    assert ops_to_probe("gpu", None, False) == ([], [CPU_ADAM])  # zero.offload: auto, decided after preflight
    assert ops_check({}, [], [], "in the image") is None


def test_offload_auto_warns_at_preflight_and_launch_refuses_a_plan_that_offloads():
    from orchestrator.preflight.loading.ops import ops_check, require_ops

    env = {"ops": {SHM_COMM: BUILT, CPU_ADAM: NOT_BUILDABLE}}
    check = ops_check(env, [SHM_COMM], [CPU_ADAM], "in the image")
    assert check.status == "warn" and "zero.offload is auto" in check.detail and "zero.offload: none" in check.fix
    assert ops_check({"ops": {SHM_COMM: BUILT}}, [SHM_COMM], [], "in the image").detail == (
        "in the image: deepspeed_shm_comm built earlier in /opt/venv/torch-extensions/deepspeed_shm_comm"
    )
    report = PreflightReport([], 0.0, None, 29500, {}, deepspeed_ops={"node-1": env["ops"]})
    no_offload = {"zero_optimization": {"stage": 3}}
    require_ops(report, no_offload, "cpu")  # the plan did not offload: nothing is missing
    offloaded = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(RuntimeFailure, match=rf"node-1: cpu_adam \(optimizer offload\) .*{re.escape(NO_CC)}.*nothing"):
        require_ops(report, offloaded, "cpu")


def test_an_unanswered_probe_fails_with_the_fix():
    from orchestrator.preflight.loading.ops import BUILD_FIX, ops_check

    check = ops_check({"ops_error": "ImportError: no deepspeed.accelerator"}, [CPU_ADAM], [], "python3 on the node")
    assert check.status == "fail" and "ImportError" in check.detail and check.fix == BUILD_FIX


@pytest.mark.integration
def test_cpu_image_without_its_compiler_fails_an_offload_plan_and_still_takes_the_tiny_job(
    docker_pair, cpu_image_tag, tmp_path
):
    """The CPU image with its compiler removed, on real docker hosts: the shm op it built at `dzctl build`
    still loads (the tiny job's plan passes), cpu_adam could only be JIT-built (an offload plan fails)."""
    import subprocess

    hosts = docker_pair
    derived = "dzctl-test/cpu-no-compiler:1"
    compilers = "$(command -v g++ c++ gcc cc) /usr/bin/*-linux-gnu-g++* /usr/bin/*-linux-gnu-gcc*"
    dockerfile = f"FROM {cpu_image_tag}\nRUN rm -f {compilers}\n"
    try:
        for host in hosts.hosts:
            built = subprocess.run(
                ["docker", "-H", host.docker_host, "build", "--network", "host", "-t", derived, "-"],
                input=dockerfile,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert built.returncode == 0, built.stderr[-2000:]
        nodes = load_nodes(hosts.write_hostfile(tmp_path / "hostfile", slots=1))
        sets = [f"image={derived}", f"launch.remote_dir=/var/tmp/dzctl-ops-{hosts.cid}"]
        with HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config) as pool:
            offloading = load_job(CPU_JOB, [*sets, "zero.offload=optimizer", "launch.master_port=29644"], "docker")
            offload = run_preflight(offloading, nodes, pool)
            tiny = run_preflight(load_job(CPU_JOB, [*sets, "launch.master_port=29645"], "docker"), nodes, pool)
    finally:
        for host in hosts.hosts:
            subprocess.run(
                ["docker", "-H", host.docker_host, "rmi", "--force", derived], capture_output=True, check=False
            )
    for host in offload.hosts:
        check = host.check("deepspeed-ops")
        assert check is not None and check.status == "fail", render_report(offload)
        assert check.detail.startswith(
            f"in the image: cpu_adam (optimizer offload) is not prebuilt and cannot be JIT-built: {NO_CC}"
        )
        assert "deepspeed_shm_comm" not in check.detail  # built into the image by dzctl build
    for host in tiny.hosts:
        check = host.check("deepspeed-ops")
        assert check.status == "ok", render_report(tiny)
        assert (
            check.detail
            == "in the image: deepspeed_shm_comm built earlier in /opt/venv/torch-extensions/deepspeed_shm_comm"
        )
