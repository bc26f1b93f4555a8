"""Preflight on real test hosts: real sshd, real dockerd, real commands (no GPU here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.preflight import render_report, run_preflight
from orchestrator.spec.hostfile import load_nodes
from orchestrator.spec.job import load_job
from orchestrator.transport.pool import HostPool

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
GPU_JOB = REPO / "jobs" / "qwen3-8b.yaml"
CPU_JOB = REPO / "jobs" / "tiny-cpu.yaml"
GPU_CHECKS = ("nvidia-smi", "nvidia-toolkit")


def _cpu_process_job(port: int = 29511):
    # The test hosts share this machine's filesystem, so this venv's Python (torch + deepspeed) is on every host.
    return load_job(CPU_JOB, [f"launch.python={sys.executable}", f"launch.master_port={port}"], "process")


def _dzctl(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )


def test_gpu_job_reaches_every_host_and_fails_gpu_checks_with_fixes(cluster, tmp_path):
    hosts = cluster(4, docker=True)
    hostfile = hosts.write_hostfile(tmp_path / "hostfile", slots=2)
    options = ["--hosts", str(hostfile), "--ssh-config", str(hosts.ssh_config)]
    result = _dzctl("preflight", str(GPU_JOB), *options, "--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert report["ok"] is False and report["elapsed_s"] > 0
    assert [h["host"] for h in report["hosts"]] == [h.name for h in hosts.hosts]
    for host in report["hosts"]:
        checks = {c["name"]: c for c in host["checks"]}
        assert set(checks["ssh"]) == {"name", "status", "detail", "fix"}
        assert checks["ssh"]["status"] == "ok"
        assert checks["docker"]["status"] == "ok", checks["docker"]
        assert "cgroup driver cgroupfs" in checks["docker"]["detail"]
        for name in GPU_CHECKS:
            assert checks[name]["status"] == "fail" and checks[name]["fix"], checks[name]
        assert "install the NVIDIA driver" in checks["nvidia-smi"]["fix"]
        assert "nvidia-ctk runtime configure" in checks["nvidia-toolkit"]["fix"]
        assert checks["image"]["status"] == "fail" and "dzctl distribute" in checks["image"]["fix"]
        assert checks["route"]["status"] == "ok" and checks["master-port"]["status"] == "ok"
        assert host["ok"] is False
    assert report["master_addr"] == hosts.hosts[0].address
    assert report["interfaces"] == {h.name: "eth0" for h in hosts.hosts}
    assert "preflight failed on 4 of 4 node(s)" in result.stderr

    # The table for people names every failure with its fix.
    table = _dzctl("preflight", str(GPU_JOB), *options)
    assert table.returncode == 1
    assert "nvidia-smi not found" in table.stdout and "fix: install the NVIDIA driver" in table.stdout
    assert all(h.name in table.stdout for h in hosts.hosts)


def test_cpu_job_passes_and_finds_master_and_interfaces(cluster, tmp_path):
    hosts = cluster(4)
    hostfile = hosts.write_hostfile(tmp_path / "hostfile", slots=2)
    nodes = load_nodes(hostfile)
    with HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config) as pool:
        report = run_preflight(_cpu_process_job(), nodes, pool)
    assert report.ok, render_report(report)
    assert report.master_addr == hosts.hosts[0].address
    assert report.interfaces == {h.name: "eth0" for h in hosts.hosts}
    assert all(v > 1 for v in report.host_mem_gib.values()) and report.gpu_mem_gib == {}
    for host in report.hosts:
        names = [c.name for c in host.checks]
        assert not set(names) & {"nvidia-smi", "nvidia-toolkit", "docker", "image"}  # CPU + process runtime
        assert host.check("python-env").status == "ok" and "torch" in host.check("python-env").detail
        assert host.check("same-everywhere").status == "ok"
        assert host.check("hostname").detail.startswith(host.host)  # each host's own UTS name
    assert "3 worker(s) connected" in report.host(hosts.hosts[0].name).check("master-port").detail


def test_master_port_taken(cluster, tmp_path):
    hosts = cluster(2)
    hostfile = hosts.write_hostfile(tmp_path / "hostfile", slots=1)
    nodes = load_nodes(hostfile)
    port = 29533
    # Something already listens on the master port on node 0.
    listen = f"import socket,time; s=socket.socket(); s.bind(('', {port})); s.listen(); print('up', flush=True)"
    listen += "; time.sleep(60)"
    netns = f"--net={hosts.hosts[0].netns_path}"
    holder = subprocess.Popen(["nsenter", netns, sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        # The system python3 (no torch): python-env fails, but only the port matters here, and this skips
        # importing torch and deepspeed on every host.
        job = load_job(CPU_JOB, ["launch.python=python3", f"launch.master_port={port}"], "process")
        with HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config) as pool:
            report = run_preflight(job, nodes, pool)
    finally:
        holder.kill()
        holder.wait()
    master = report.host(hosts.hosts[0].name).check("master-port")
    assert master.status == "fail" and "taken" in master.detail and "launch.master_port" in master.fix
    worker = report.host(hosts.hosts[1].name).check("master-port")
    assert worker.status == "fail" and "not tested" in worker.detail
    assert not report.ok


def test_stopped_sshd_and_silent_host_reported_within_connect_timeout(cluster, tmp_path):
    hosts = cluster(4, docker=True)
    down = hosts.hosts[2]
    hosts.stop_sshd(down)
    # A fifth name whose address answers nothing at all (no RST): only the timeout ends the wait.
    silent = str(hosts.network.network_address + 250)
    config = tmp_path / "ssh_config"
    config.write_text(hosts.ssh_config.read_text() + f"\nHost ghost\n  HostName {silent}\n  User root\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h.name} slots=1\n" for h in hosts.hosts) + "ghost slots=1\n")
    nodes = load_nodes(hostfile)
    connect_timeout = 3.0
    with HostPool([n.host for n in nodes], ssh_config=config, connect_timeout=connect_timeout) as pool:
        started = time.monotonic()
        report = run_preflight(load_job(GPU_JOB), nodes, pool)
        elapsed = time.monotonic() - started
    for name, words in ((down.name, "Connection refused"), ("ghost", f"within {connect_timeout:g} s")):
        ssh = report.host(name).check("ssh")
        assert ssh.status == "fail" and "unreachable" in ssh.detail and words in ssh.detail, ssh
        assert ssh.fix
        assert [c.name for c in report.host(name).checks] == ["ssh"]
    assert connect_timeout - 0.2 <= pool.connect_seconds["ghost"] <= connect_timeout + 0.5
    for host in (hosts.hosts[0], hosts.hosts[1], hosts.hosts[3]):
        checks = report.host(host.name)
        assert checks.check("ssh").status == "ok"
        assert checks.check("docker").status == "ok"  # still checked
        assert checks.check("nvidia-smi").status == "fail"
    # The unreachable hosts cost one connect timeout, not one per check.
    assert elapsed < connect_timeout + 25


def test_host_keys_unknown_refused_trusted_with_flag_changed_refused(cluster, tmp_path):
    hosts = cluster(2)
    hostfile = hosts.write_hostfile(tmp_path / "hostfile", slots=1)
    base = ["preflight", str(CPU_JOB), "--hosts", str(hostfile), "--runtime", "process", "--json"]
    # System python3 (no torch): python-env fails, which keeps this test quick; only the ssh checks matter.
    base += ["--set", "launch.python=python3", "--set", "launch.master_port=29522"]
    env = {"DZCTL_SSH_CONFIG": str(hosts.ssh_config)}  # the env var instead of --ssh-config

    hosts.known_hosts.write_text("")
    refused = _dzctl(*base, env_extra=env)
    assert refused.returncode == 1
    for host in json.loads(refused.stdout)["hosts"]:
        ssh = host["checks"][0]
        assert ssh["name"] == "ssh" and ssh["status"] == "fail" and "not in known_hosts" in ssh["detail"]
        assert "--trust-new-hosts" in ssh["fix"] and "ssh-keyscan" in ssh["fix"]
    assert hosts.known_hosts.read_text() == ""

    trusted = _dzctl(*base, "--trust-new-hosts", env_extra=env)
    for host in json.loads(trusted.stdout)["hosts"]:
        assert host["checks"][0]["name"] == "ssh" and host["checks"][0]["status"] == "ok", trusted.stderr
        assert {c["name"] for c in host["checks"]} >= {"route", "master-port", "disk"}  # checked past ssh
    assert sorted(hosts.known_hosts.read_text().splitlines()) == sorted(hosts.known_hosts_line(h) for h in hosts.hosts)

    hosts.rotate_host_key(hosts.hosts[1])
    changed = _dzctl(*base, "--trust-new-hosts", env_extra=env)
    assert changed.returncode == 1
    report = {h["host"]: h for h in json.loads(changed.stdout)["hosts"]}
    ssh = report[hosts.hosts[1].name]["checks"][0]
    assert ssh["status"] == "fail" and "HOST KEY CHANGED" in ssh["detail"] and "ssh-keygen -R" in ssh["fix"]
    assert report[hosts.hosts[0].name]["checks"][0]["status"] == "ok"


def _busybox_image(host_docker: str, workdir: Path, tag: str, filler_bytes: int = 0) -> str:
    """A tiny real image (busybox: sh, df, ls; no Python) imported into one daemon; returns its ID.

    ``filler_bytes``: a file of that many seeded random bytes (incompressible), for a layer of some size.
    """
    root = workdir / "rootfs"
    (root / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(shutil.which("busybox"), root / "bin" / "busybox")
    for applet in ("sh", "df", "ls", "cat", "echo", "printf", "tail"):
        link = root / "bin" / applet
        if not link.exists():
            link.symlink_to("busybox")
    for d in ("dev", "proc", "sys", "tmp", "etc"):
        (root / d).mkdir(exist_ok=True)
    if filler_bytes:
        import random

        (root / "filler").write_bytes(random.Random(0).randbytes(filler_bytes))
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(
        ["docker", "-H", host_docker, "import", "--change", "ENV PATH=/bin", "-", tag],
        stdin=tar.stdout, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    tar.wait()
    assert imported.returncode == 0, imported.stderr
    return imported.stdout.strip()


@pytest.mark.skipif(shutil.which("busybox") is None, reason="needs busybox (apt-get install busybox-static)")
def test_docker_runtime_image_checks_on_real_daemons(cluster, tmp_path):
    hosts = cluster(2, docker=True)
    first, second = hosts.hosts
    tag = "dzctl-test/busybox:1"
    image_id = _busybox_image(first.docker_host, tmp_path, tag)
    hostfile = hosts.write_hostfile(tmp_path / "hostfile", slots=1)
    nodes = load_nodes(hostfile)
    cpu_job = load_job(CPU_JOB, [f"image={tag}", "launch.master_port=29544"], "docker")
    gpu_job = load_job(GPU_JOB, [f"image={tag}", "launch.master_port=29545"])
    with HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config) as pool:
        # Only node0 has the image: missing on node1 (a warning when launch will distribute it).
        report = run_preflight(cpu_job, nodes, pool)
        assert report.host(first.name).check("image").status == "ok"
        assert image_id[:19] in report.host(first.name).check("image").detail
        assert report.host(second.name).check("image").status == "fail"
        lenient = run_preflight(cpu_job, nodes, pool, image_missing_ok=True)
        assert lenient.host(second.name).check("image").status == "warn"

        # Ship it by ID through the SSH layer (docker save | docker load), as distribution does.
        save = subprocess.Popen(["docker", "-H", first.docker_host, "save", tag], stdout=subprocess.PIPE)
        pool.connection(second.name).run(["docker", "load"], stdin=save.stdout, timeout=120, check=True)
        assert save.wait() == 0
        report = run_preflight(cpu_job, nodes, pool)
        gpu_report = run_preflight(gpu_job, nodes, pool)

    for host in hosts.hosts:
        checks = report.host(host.name)
        assert checks.check("image").status == "ok"
        runtime = checks.check("image-runtime")
        limits = checks.check("shm-memlock")
        # Measured inside a real container started with the launch's flags (--ipc host; a CPU job asks for
        # no memlock, which these test daemons could not grant: this sandbox lacks CAP_SYS_RESOURCE).
        assert limits.status == "ok" and "in the container: /dev/shm" in limits.detail, render_report(report)
        assert runtime.status == "fail" and "not found" in runtime.detail  # busybox has no Python/torch
        assert "dzctl build" in runtime.fix
        assert checks.check("same-everywhere").status == "ok" and "image ID" in checks.check("same-everywhere").detail
        gpu = gpu_report.host(host.name)
        assert gpu.check("image-runtime"), render_report(gpu_report)
        assert gpu.check("image-runtime").status == "fail"  # `docker run --gpus` cannot work without the toolkit
        assert "NVIDIA Container Toolkit" in gpu.check("image-runtime").fix
    assert not report.ok


@pytest.mark.skipif(shutil.which("busybox") is None, reason="needs busybox (apt-get install busybox-static)")
def test_different_image_ids_are_caught(cluster, tmp_path):
    hosts = cluster(2, docker=True)
    tag = "dzctl-test/busybox:1"
    # Two separate imports of the same files: same tag, different IDs (creation times differ).
    ids = [_busybox_image(h.docker_host, tmp_path / h.name, tag) for h in hosts.hosts]
    if ids[0] == ids[1]:
        time.sleep(1.1)
        ids[1] = _busybox_image(hosts.hosts[1].docker_host, tmp_path / "again", tag)
    assert ids[0] != ids[1]
    hostfile = hosts.write_hostfile(tmp_path / "hostfile", slots=1)
    nodes = load_nodes(hostfile)
    with HostPool([n.host for n in nodes], ssh_config=hosts.ssh_config) as pool:
        report = run_preflight(load_job(CPU_JOB, [f"image={tag}", "launch.master_port=29546"], "docker"), nodes, pool)
    # Two nodes, two IDs: no majority, so both fail and each message names both IDs with their nodes.
    for host in hosts.hosts:
        skew = report.host(host.name).check("same-everywhere")
        assert skew.status == "fail" and "dzctl distribute" in skew.fix
        for other, image_id in zip(hosts.hosts, ids, strict=True):
            assert f"{image_id[:19]} on {other.name}" in skew.detail, skew.detail
