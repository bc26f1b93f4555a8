"""Preflight's pure parts: parsers against real recorded outputs, and the verdicts built on them.

nvidia-smi outputs are real, recorded on two H200s (tests/fixtures/h200x2, see
its README). That machine had no Docker or NVIDIA Container Toolkit, so the
``docker info`` and ``nvidia-ctk`` samples below follow the documented formats
(Docker Engine API SystemInfo as printed by ``docker info --format '{{json .}}'``;
the toolkit CLI's ``--version`` banner) — said here as the brief asks; the
integration tests parse real ``docker info`` from the test hosts' dockerd.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from orchestrator.planning.launchplan import make_plan
from orchestrator.preflight import parsers as p
from orchestrator.preflight.checks import (
    Context,
    Facts,
    cuda_driver_check,
    gpu_inventory_check,
    infiniband_check,
    limits_check,
)
from orchestrator.preflight.model import Check, HostReport, PreflightReport
from orchestrator.preflight.runner import choose_master, same_everywhere
from orchestrator.spec.hostfile import Node
from orchestrator.spec.job import JobSpec

# Committed with the tests: a checkout without them is broken, so the tests fail rather than skip.
H200 = Path(__file__).resolve().parent / "fixtures" / "h200x2"


def _spec(**over) -> JobSpec:
    data = {"name": "t", "model": {"name_or_path": "m"}, "data": {"path": "/d.json"}, **over}
    return JobSpec.model_validate(data)


def _ctx(spec: JobSpec, slots=(0, 1), n_nodes=2) -> Context:
    nodes = [Node(f"n{i}", tuple(slots)) for i in range(n_nodes)]
    plan = make_plan(spec, nodes, "preflight")
    return Context(spec, plan, plan.nodes[0])


# -- nvidia-smi (real recordings) -------------------------------------------------
def test_gpu_query_of_two_h200():
    gpus = p.parse_gpu_query((H200 / "query-gpu.csv").read_text())
    assert [g.index for g in gpus] == [0, 1]
    assert {g.name for g in gpus} == {"NVIDIA H200"}
    assert all(g.memory_total_mib == 143771 and g.memory_used_mib == 0 for g in gpus)
    assert all(g.driver_version == "580.159.04" and g.compute_cap == "9.0" for g in gpus)
    assert [g.pci_bus_id for g in gpus] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert all(g.ecc_uncorrected == 0 for g in gpus)
    # The same count nvidia-smi -L lists.
    assert len(gpus) == len((H200 / "nvidia-smi-L.txt").read_text().strip().splitlines())


def test_smi_header_agrees_with_the_xml_report():
    driver, cuda = p.parse_smi_header((H200 / "nvidia-smi.txt").read_text())
    root = ET.parse(H200 / "nvidia-smi-q.xml").getroot()
    assert (driver, cuda) == (root.findtext("driver_version"), root.findtext("cuda_version"))
    assert (driver, cuda) == ("580.159.04", "13.0")


def test_inventory_verdicts_on_the_recorded_gpus():
    gpus = p.parse_gpu_query((H200 / "query-gpu.csv").read_text())
    good = gpu_inventory_check(gpus, (0, 1), "13.0")
    assert good.status == "ok" and "2 × NVIDIA H200 140 GiB" in good.detail and "580.159.04" in good.detail
    too_many = gpu_inventory_check(gpus, (0, 1, 2, 3), "13.0")
    assert too_many.status == "fail" and "[2, 3] do not exist" in too_many.detail and "--include" in too_many.fix
    broken = [gpus[0], p.Gpu(**{**gpus[1].__dict__, "ecc_uncorrected": 3})]
    ecc = gpu_inventory_check(broken, (0, 1), "13.0")
    assert ecc.status == "fail" and "ECC" in ecc.detail and "--exclude" in ecc.fix
    assert gpu_inventory_check(broken, (0,), "13.0").status == "ok"  # GPU 1 is not used
    busy = [p.Gpu(**{**gpus[0].__dict__, "memory_used_mib": 70000}), gpus[1]]
    assert gpu_inventory_check(busy, (0, 1), "13.0").status == "warn"
    assert gpu_inventory_check([], (0,), None).status == "fail"


def test_check_gpus_records_memory_compute_capability_and_the_gpu_name(tmp_path, monkeypatch):
    """check_gpus through a real local connection, with the recorded nvidia-smi standing in for the tool."""
    from orchestrator.preflight.checks import check_gpus
    from orchestrator.transport.local import LocalConnection

    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --query-gpu=*) exec cat {H200 / "query-gpu.csv"} ;; esac\n'
        f"exec cat {H200 / 'nvidia-smi.txt'}\n",
        encoding="utf-8",
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    facts = Facts()
    checks = check_gpus(LocalConnection(), _ctx(_spec(accelerator="gpu"), slots=(1,)), facts)
    assert [c.status for c in checks] == ["ok"], checks
    assert (facts.gpu_mem_mib, facts.gpu_compute_capability) == (143771, 9.0)
    assert facts.gpu_name == "NVIDIA H200"  # the step-time model's GPU kind at launch
    assert (facts.driver, facts.driver_cuda) == ("580.159.04", "13.0")


def test_compute_capability_as_a_number():
    row = "0, Tesla V100-SXM2-32GB, GPU-x, 535.1, 32768, 0, 0, 0:1, {cap}, 0\n"
    assert p.parse_gpu_query(row.format(cap="7.0"))[0].compute_capability == 7.0
    assert p.parse_gpu_query(row.format(cap="12.0"))[0].compute_capability == 12.0
    assert p.parse_gpu_query(row.format(cap="[N/A]"))[0].compute_capability is None


def test_gpu_query_rejects_other_shapes():
    with pytest.raises(p.ParseError, match="expected 10 fields"):
        p.parse_gpu_query("0, NVIDIA H200, 580.159.04\n")
    rows = p.parse_gpu_query("0, A100, GPU-x, 535.1, 81920, 5, [N/A], 0:1, 8.0, [N/A]\n")
    assert rows[0].utilization_pct is None and rows[0].ecc_uncorrected is None
    with pytest.raises(p.ParseError):
        p.parse_smi_header("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_infiniband_from_the_recorded_machine():
    # misc.txt: `ls /dev/infiniband` printed only rdma_cm, no uverbs devices: no usable IB.
    text = (H200 / "misc.txt").read_text()
    listing = text.split("$ ls /dev/infiniband\n", 1)[1].split("$", 1)[0].split()
    assert listing == ["rdma_cm"]
    docker_ctx = _ctx(_spec(runtime="docker"))
    assert infiniband_check(listing, docker_ctx).status == "ok"
    verbs = infiniband_check(["rdma_cm", "uverbs0", "uverbs1"], docker_ctx)
    assert verbs.status == "ok" and "launch passes /dev/infiniband" in verbs.detail
    assert infiniband_check(["uverbs0"], _ctx(_spec(runtime="process"))).status == "ok"


def test_limits_from_the_recorded_machine():
    # misc.txt: /dev/shm 256G tmpfs, ulimit -l unlimited.
    ctx = _ctx(_spec())
    shm_bytes = 256 * 2**30
    out = f"DZ_MEMLOCK unlimited\nDZ_SHM tmpfs {shm_bytes} 0 {shm_bytes} 0% /dev/shm\n"
    assert "unlimited" in (H200 / "misc.txt").read_text()
    check = limits_check(out, ctx, "in the container")
    assert check.status == "ok" and "/dev/shm 256.0 GiB, memlock unlimited" in check.detail
    small = limits_check("DZ_MEMLOCK 64\nDZ_SHM shm 67108864 0 67108864 0% /dev/shm\n", ctx, "in the container")
    assert small.status == "fail" and "--ipc host" in small.fix  # Docker's 64 MiB default
    locked = limits_check(f"DZ_MEMLOCK 64\nDZ_SHM tmpfs {shm_bytes} 0 {shm_bytes} 0% /dev/shm\n", ctx, "x")
    assert locked.status == "fail" and "memlock" in locked.fix
    cpu = limits_check(
        f"DZ_MEMLOCK 64\nDZ_SHM tmpfs {shm_bytes} 0 {shm_bytes} 0% /dev/shm\n", _ctx(_spec(accelerator="cpu")), "x"
    )
    assert cpu.status == "ok"  # gloo does not pin memory
    assert limits_check("sh: df: not found\n", ctx, "x").status == "fail"


# -- CUDA vs driver ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("image", "driver", "verdict"),
    [("13.0", "13.0", "ok"), ("12.8", "13.0", "ok"), ("13.1", "13.0", "minor"), ("14.0", "13.0", "too-old"),
     ("12.4", "12.2", "minor"), ("10.2", "10.1", "too-old")],
)  # fmt: skip
def test_cuda_compatibility(image, driver, verdict):
    assert p.cuda_compatibility(image, driver) == verdict


def test_cuda_driver_check_statuses():
    assert cuda_driver_check("13.0", "13.0", "580.159.04").status == "ok"
    assert cuda_driver_check("13.1", "13.0", "580").status == "warn"
    too_new = cuda_driver_check("14.0", "13.0", "580.159.04")
    assert too_new.status == "fail" and "upgrade the NVIDIA driver" in too_new.fix
    assert cuda_driver_check("cpu", "13.0", "580").status == "fail"
    assert cuda_driver_check(None, "13.0", "580").status == "warn"
    assert cuda_driver_check("13.0", None, None) is None


# -- docker info / nvidia-ctk (documented formats) --------------------------------------------
DOCKER_INFO_NVIDIA = {
    # Keys and shapes of the Engine API's SystemInfo (docs.docker.com/reference/api/engine, /info).
    "ID": "x",
    "Name": "gpu-node-1",
    "ServerVersion": "27.3.1",
    "CgroupDriver": "systemd",
    "CgroupVersion": "2",
    "DockerRootDir": "/var/lib/docker",
    "DefaultRuntime": "runc",
    "Runtimes": {"nvidia": {"path": "nvidia-container-runtime"}, "runc": {"path": "runc"}},
    "CDISpecDirs": ["/etc/cdi", "/var/run/cdi"],
}


def test_docker_info_documented_format():
    info = p.parse_docker_info(json.dumps(DOCKER_INFO_NVIDIA))
    assert info.server_version == "27.3.1" and info.cgroup_driver == "systemd" and info.cgroup_version == "2"
    assert info.runtimes == ("nvidia", "runc") and info.cdi_spec_dirs == ("/etc/cdi", "/var/run/cdi")
    # The CLI prints the client half and a ServerErrors list when the daemon is down.
    down = {"ServerErrors": ["Cannot connect to the Docker daemon at unix:///var/run/docker.sock."]}
    with pytest.raises(p.ParseError, match="Cannot connect"):
        p.parse_docker_info(json.dumps(down))
    with pytest.raises(p.ParseError, match="did not print JSON"):
        p.parse_docker_info("permission denied while trying to connect")


def test_nvidia_ctk_version_documented_format():
    text = "NVIDIA Container Toolkit CLI version 1.17.8\ncommit: f202b80a9b9d0db00d9b1d73c0128c8962c55f4d\n"
    assert p.parse_nvidia_ctk_version(text) == "1.17.8"
    with pytest.raises(p.ParseError):
        p.parse_nvidia_ctk_version("nvidia-ctk: command not found")


# -- network ------------------------------------------------------------------------------------
def test_route_get_forms():
    r = p.parse_route_get("10.1.0.3 dev eth0 src 10.1.0.2 uid 0 \n    cache \n")
    assert (r.destination, r.dev, r.src, r.via, r.kind) == ("10.1.0.3", "eth0", "10.1.0.2", None, "unicast")
    r = p.parse_route_get("local 10.1.0.2 dev lo src 10.1.0.2 uid 0 \n    cache <local> \n")
    assert (r.kind, r.dev) == ("local", "lo")
    r = p.parse_route_get("192.168.9.1 via 10.1.0.1 dev ib0 src 10.1.0.2 uid 0 \n    cache \n")
    assert (r.via, r.dev) == ("10.1.0.1", "ib0")
    with pytest.raises(p.ParseError):
        p.parse_route_get("")


def test_addresses_and_getent():
    text = (
        "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n"
        "2: eth0    inet 10.1.0.2/24 brd 10.1.0.255 scope global eth0\\       valid_lft forever\n"
        "3: docker0    inet 172.17.0.1/16 brd 172.17.255.255 scope global docker0\\ valid_lft forever\n"
    )
    assert p.parse_addresses(text) == [("lo", "127.0.0.1"), ("eth0", "10.1.0.2"), ("docker0", "172.17.0.1")]
    getent = "127.0.1.1       STREAM vm\n127.0.1.1       DGRAM  \n127.0.1.1       RAW    \n"
    assert p.parse_getent(getent) == ["127.0.1.1"]
    assert p.is_virtual_interface("docker0") and p.is_virtual_interface("lo") and not p.is_virtual_interface("ens5")


def test_disk_memlock_meminfo():
    text = "/var/tmp/dzctl/output/x\t/var/tmp\t/dev/vda 270000000000 25000000000 81000000000 24% /\n"
    (space,) = p.parse_disk_lines(text)
    assert (space.path, space.checked, space.avail_bytes, space.mount) == (
        "/var/tmp/dzctl/output/x",
        "/var/tmp",
        81000000000,
        "/",
    )
    assert p.parse_memlock("unlimited\n") is None and p.parse_memlock("8192\n") == 8192 * 1024
    assert p.parse_meminfo_total("MemTotal:       24567890 kB\nMemFree: 1 kB\n") == 24567890 * 1024
    assert p.parse_json_line('noise\nDZCTL_ENV {"torch": "2.13.0"}\n', "DZCTL_ENV ") == {"torch": "2.13.0"}


# -- choices across nodes -------------------------------------------------------------------------
def _facts(addresses=(), resolved=(), **env) -> Facts:
    facts = Facts(addresses=list(addresses), resolved_master=list(resolved))
    facts.env = env
    return facts


def test_master_is_node0s_ssh_address_when_it_owns_it():
    facts = {"a": _facts([("lo", "127.0.0.1"), ("eth0", "10.0.0.2")]), "b": _facts()}
    assert choose_master(_spec(), ["a", "b"], "10.0.0.2", facts)[0] == "10.0.0.2"


def test_master_never_loopback_even_when_the_name_resolves_there():
    # /etc/hosts maps node names to 127.0.1.1 (Debian's default): use node 0's real NIC address.
    facts = {
        "a": _facts([("lo", "127.0.0.1"), ("docker0", "172.17.0.1"), ("ens5", "10.0.0.2")]),
        "b": _facts(resolved=["127.0.1.1"]),
    }
    master, why = choose_master(_spec(), ["a", "b"], "gpu-a", facts)
    assert master == "10.0.0.2" and "ens5" in why
    assert choose_master(_spec(), ["a"], "gpu-a", {"a": _facts([("eth0", "10.0.0.2")])})[0] == "127.0.0.1"
    explicit = _spec(launch={"master_addr": "10.9.9.9"})
    assert choose_master(explicit, ["a", "b"], "10.9.9.9", facts) == ("10.9.9.9", "launch.master_addr")
    master, why = choose_master(_spec(), ["a", "b"], "gpu-a", {"b": _facts()})
    assert master is None and "unreachable" in why


def test_same_everywhere_names_the_odd_node():
    facts = {
        "a": _facts(torch="2.8.0", deepspeed="0.19.8"),
        "b": _facts(torch="2.8.0", deepspeed="0.19.8"),
        "c": _facts(torch="2.7.1", deepspeed="0.19.8"),
    }
    facts["a"].driver = facts["b"].driver = facts["c"].driver = "580.159.04"
    checks = same_everywhere(["a", "b", "c"], facts, _spec(runtime="process"))
    assert checks["a"].status == checks["b"].status == "ok"
    assert checks["c"].status == "fail" and "torch 2.7.1 here, 2.8.0 on a" in checks["c"].detail
    assert "driver 580.159.04" in checks["a"].detail


IMAGE_GOOD = "sha256:" + "ab" * 32
IMAGE_ODD = "sha256:" + "cd" * 32


def _skewed(odd: int, key: str) -> dict[str, Facts]:
    facts = {h: _facts(torch="2.8.0", deepspeed="0.19.8") for h in ("a", "b", "c")}
    for f in facts.values():
        f.driver, f.image_id = "580.159.04", IMAGE_GOOD
    odd_facts = facts["abc"[odd]]
    if key == "torch":
        odd_facts.env["torch"] = "2.7.1"
    else:
        odd_facts.image_id = IMAGE_ODD
    return facts


@pytest.mark.parametrize("key", ["torch", "image"])
@pytest.mark.parametrize("odd", [0, 1, 2], ids=["odd-first", "odd-middle", "odd-last"])
def test_same_everywhere_blames_the_minority_wherever_it_sits(odd, key):
    """The majority is the reference: node 0 being the odd one must not fail the two good nodes."""
    hosts = ["a", "b", "c"]
    checks = same_everywhere(hosts, _skewed(odd, key), _spec(runtime="docker"))
    odd_host = hosts[odd]
    good = [h for h in hosts if h != odd_host]
    assert [h for h in hosts if checks[h].status == "fail"] == [odd_host]
    detail = checks[odd_host].detail
    if key == "torch":
        assert f"torch 2.7.1 here, 2.8.0 on {', '.join(good)}" in detail
    else:  # both image IDs named, as docs/reliability.md promises
        assert f"image ID {IMAGE_ODD[:19]} here, {IMAGE_GOOD[:19]} on {', '.join(good)}" in detail
        assert "dzctl distribute" in checks[odd_host].fix
    for host in good:
        assert checks[host].status == "ok"


def test_same_everywhere_tie_names_every_value_and_its_nodes():
    facts = {h: _facts(torch="2.8.0") for h in ("a", "b", "c", "d")}
    for h in ("a", "b", "c", "d"):
        facts[h].image_id = IMAGE_GOOD if h in ("a", "c") else IMAGE_ODD
    checks = same_everywhere(["a", "b", "c", "d"], facts, _spec(runtime="docker"))
    expected = f"image ID differs with no majority: {IMAGE_GOOD[:19]} on a, c; {IMAGE_ODD[:19]} on b, d"
    assert all(checks[h].status == "fail" and checks[h].detail == expected for h in "abcd")
    two = same_everywhere(["a", "b"], {"a": facts["a"], "b": facts["b"]}, _spec(runtime="docker"))
    assert two["a"].status == two["b"].status == "fail"
    assert IMAGE_GOOD[:19] in two["a"].detail and IMAGE_ODD[:19] in two["a"].detail


def test_checks_and_report_shape():
    with pytest.raises(ValueError, match="without a fix"):
        Check("x", "fail", "broken")
    with pytest.raises(ValueError):
        Check("x", "maybe", "?")
    report = PreflightReport(
        hosts=[
            HostReport("a", 0, [Check("ssh", "ok", "connected")]),
            HostReport("b", 1, [Check("ssh", "fail", "down", "start sshd")]),
        ],
        elapsed_s=1.23456,
        master_addr="10.0.0.2",
        master_port=29500,
        interfaces={"a": "eth0"},
    )
    data = report.to_dict()
    assert data["ok"] is False and data["elapsed_s"] == 1.235
    assert data["hosts"][1] == {
        "host": "b",
        "ok": False,
        "checks": [{"name": "ssh", "status": "fail", "detail": "down", "fix": "start sshd"}],
    }
    assert report.failures() == [("b", report.hosts[1].checks[0])]
