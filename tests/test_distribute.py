"""dzctl distribute: same image ID on every node, skip nodes that have it, survive a node lost mid-way.

Real parts only: the image comes from a dockerd on this machine's root namespace; the nodes are
test hosts (network namespaces) each with its own sshd and dockerd (tests/testhosts.py). A transfer
cut half-way sends the local Debian base (~470 MB), big enough to cut mid-stream; the tests of what is
sent, skipped and tagged send a small real image (busybox and 24 MiB of incompressible bytes) that
docker loads in a second: loading the Debian base on each node cost them about 100 s in all.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import docker
import pytest

from orchestrator.image.distribute import codec_for, distribute_image, distribute_via_registry
from orchestrator.image.layers import SkipHeldLayers, chain_ids, filter_tar, held_prefix, v1_ids
from orchestrator.transport.pool import HostPool

# -- pure parts -----------------------------------------------------------------------------------


def test_codecs_argv():
    assert codec_for("none").local is None and codec_for("none").remote == ("docker", "load")
    # docker load decompresses gzip itself: the node needs no extra tool.
    assert codec_for("gzip").remote == ("docker", "load")
    assert codec_for("gzip").local[0] in ("pigz", "gzip")
    assert codec_for("zstd").local[0] == "zstd"
    assert codec_for("zstd").remote == ("sh", "-c", "zstd -dcq | docker load")


def test_pipe_reads_what_was_put_then_eof():
    from orchestrator.image.nodepipe import NodePipe

    pipe = NodePipe("n", depth=4)
    assert pipe.put(b"abcdef", 1) and pipe.put(b"gh", 1)
    pipe.end()
    assert pipe.read(4) == b"abcd"
    assert pipe.read(100) == b"ef"
    assert pipe.read(100) == b"gh"
    assert pipe.read(100) == b""
    assert pipe.sent == 8 and not pipe.stalled(60)


def test_pipe_stalled_reader_times_out_and_dropped_pipe_ends():
    from orchestrator.image.nodepipe import NodePipe

    pipe = NodePipe("n", depth=1)
    assert pipe.put(b"x", 0.1)
    started = time.monotonic()
    assert not pipe.put(b"y", 0.3)  # nobody reads: the tee gives up on this node
    assert time.monotonic() - started >= 0.3
    assert pipe.why_stalled == "took no data for 0.3 s"
    pipe.drop()
    assert not pipe.put(b"z", 5)  # a dropped node never blocks the tee
    assert pipe.read(10) == b""  # a dropped node's reader sees the end at once, never blocks


def test_a_pipe_is_stalled_on_what_is_queued_and_after_its_last_byte():
    from orchestrator.image.nodepipe import NodePipe

    queued = NodePipe("n", depth=32)
    assert queued.put(b"left for the node", 0.2)
    queued.end()  # the tee has sent everything: no put will ever wait on this node again
    time.sleep(0.3)
    assert queued.stalled(0.2) and queued.why_stalled == "took no data for 0.2 s"
    finished = NodePipe("n")
    assert finished.put(b"x" * 1000, 0.2)
    finished.end()
    assert finished.read(-1) == b"x" * 1000 and finished.read(-1) == b""  # it took the last byte
    time.sleep(0.3)
    assert not finished.stalled(5)  # its command may take finish_bound(5, 1000) to end
    assert finished.stalled(0.2)
    assert finished.why_stalled == "took all 0.0 MB but did not finish within 0 s of the last byte"
    waiting = NodePipe("n")
    reader = threading.Thread(target=waiting.read)
    reader.start()
    time.sleep(0.3)
    assert not waiting.stalled(0.2)  # it asks for data the tee has not got yet: not its fault
    waiting.drop()
    reader.join(5)


def test_finish_bound_grows_with_what_the_node_was_sent():
    from orchestrator.image.nodepipe import finish_bound

    assert finish_bound(300, 0) == 300
    assert finish_bound(300, 2_000_000_000) == 700  # a 2 GB image: 300 s + 1 s per 5 MB


# -- real hosts -----------------------------------------------------------------------------------


def host_image_id(cluster, host, ref: str) -> str | None:
    """The node's ID for ``ref``, asked of its own dockerd directly (not through dzctl)."""
    done = cluster.run_in(host, ["docker", "image", "inspect", "--format", "{{.Id}}", ref], check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def dzctl(args: list[str], docker_url: str, timeout: float = 900) -> subprocess.CompletedProcess:
    # This file tests the docker save streams; the layer store's are in test_distribute_store.py.
    env = {**os.environ, "DOCKER_HOST": docker_url, "DZCTL_LAYER_STORE": "off"}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def small_base(local_docker_url, tmp_path_factory) -> str:
    """A small real image on the local daemon: busybox (sh, for RUN steps) and 24 MiB of random bytes."""
    from test_preflight import _busybox_image

    tag = "dzctl-test/small-base:1"
    _busybox_image(local_docker_url, tmp_path_factory.mktemp("small-base"), tag, filler_bytes=24 << 20)
    return tag


@pytest.mark.integration
def test_distribute_to_three_hosts_then_noop(cluster, local_docker_url, small_base, tmp_path):
    hosts = cluster(3, docker=True)
    hostfile = hosts.write_hostfile(tmp_path / "hostfile", slots=1)
    local_id = docker.DockerClient(base_url=local_docker_url, version="auto").images.get(small_base).id
    # node1 already has the image, under another name only: it must be skipped (no transfer)
    # and given the name.
    node1 = hosts.hosts[1].docker_host
    seeded = subprocess.run(
        f"docker -H {local_docker_url} save {small_base} | docker -H {node1} load"
        f" && docker -H {node1} tag {small_base} other/name:1 && docker -H {node1} rmi {small_base}",
        shell=True,
        capture_output=True,
        text=True,
    )
    assert seeded.returncode == 0, seeded.stderr
    assert host_image_id(hosts, hosts.hosts[1], small_base) is None
    args = ["distribute", small_base, "--hosts", str(hostfile), "--ssh-config", str(hosts.ssh_config), "--json"]

    first = dzctl(args, local_docker_url)
    assert first.returncode == 0, first.stderr[-3000:]
    report = json.loads(first.stdout)
    assert report["ok"] and report["image_id"] == local_id
    status = {h["host"]: h["status"] for h in report["hosts"]}
    assert status == {"node0": "loaded", "node1": "present", "node2": "loaded"}
    assert report["hosts"][1]["detail"] == f"already had it; tagged {small_base}"
    for host in hosts.hosts:
        assert host_image_id(hosts, host, small_base) == local_id, host.name  # by tag, as loaded
    # Saved once and sent whole to each loading node.
    sent = {h["host"]: h["bytes_sent"] for h in report["hosts"]}
    assert sent["node0"] == sent["node2"] == report["wire_bytes"] > 0
    assert sent["node1"] == 0
    # The streams went through the system's ssh client (openssh.py), the skipped node through none.
    carriers = {h["host"]: h["ssh_client"] for h in report["hosts"]}
    assert carriers == {"node0": "openssh", "node1": "", "node2": "openssh"}

    started = time.monotonic()
    second = dzctl(args, local_docker_url)
    elapsed = time.monotonic() - started
    assert second.returncode == 0, second.stderr[-3000:]
    again = json.loads(second.stdout)
    assert {h["status"] for h in again["hosts"]} == {"present"}
    assert again["wire_bytes"] == 0
    assert elapsed < 3.0, f"a no-op distribute took {elapsed:.1f} s"


@pytest.mark.integration
@pytest.mark.parametrize("ssh_client", ["openssh", "paramiko"])
def test_connection_killed_mid_transfer_fails_that_host_only(cluster, local_docker_url, base_image, ssh_client):
    hosts = cluster(3, docker=True)
    victim = hosts.hosts[1]
    client = docker.DockerClient(base_url=local_docker_url, version="auto", timeout=900)
    local_id = client.images.get(base_image).id
    killed: list[int] = []

    def on_progress(progress):
        # Cut node1's SSH connection once it has taken 40 MB: mid-transfer, well before the end.
        if not killed and progress.sent.get(victim.name, 0) > 40_000_000:
            killed.extend(hosts.drop_connections(victim))

    with HostPool([h.name for h in hosts.hosts], ssh_config=hosts.ssh_config) as pool:
        result = distribute_image(
            base_image,
            [h.name for h in hosts.hosts],
            pool,
            client=client,
            codec="none",
            on_progress=on_progress,
            layer_store=None,  # the raw save stream: 40 MB in is mid-transfer
            ssh_client=ssh_client,
        )
    assert killed, "the victim's session was never found"
    assert {o.ssh_client for o in result.hosts.values()} == {ssh_client}
    assert not result.ok
    outcome = {name: o for name, o in result.hosts.items()}
    assert outcome["node1"].status == "failed"
    assert outcome["node1"].detail.startswith("SSH connection lost mid-transfer after ")
    assert 40_000_000 < outcome["node1"].bytes_sent < result.wire_bytes
    for name in ("node0", "node2"):
        assert outcome[name].status == "loaded", outcome[name].detail
        assert outcome[name].bytes_sent == result.wire_bytes
        assert host_image_id(hosts, hosts.host(name), base_image) == local_id
    assert host_image_id(hosts, victim, local_id) is None  # no half image on the failed node


@pytest.fixture
def registry(tmp_path):
    """A real registry (Debian's docker-registry) with TLS, factory: ``registry(address) -> "addr:port"``.

    Docker trusts a registry's CA from /etc/docker/certs.d/<addr:port>/ca.crt, read by every daemon
    on this machine (the local one and the test hosts'): that file is removed afterwards.
    """
    if shutil.which("docker-registry") is None or shutil.which("openssl") is None:
        reason = "registry test needs docker-registry and openssl (apt-get install docker-registry)"
        if os.environ.get("DZCTL_REQUIRE_INTEGRATION") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    started: list[tuple[subprocess.Popen, Path]] = []

    def start(address: str) -> str:
        with socket.socket() as probe:  # a free port on that address
            probe.bind((address, 0))
            port = probe.getsockname()[1]
        key, crt = tmp_path / "registry.key", tmp_path / "registry.crt"
        openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=dzctl-test"]
        openssl += ["-addext", f"subjectAltName=IP:{address}", "-keyout", str(key), "-out", str(crt)]
        subprocess.run(openssl, check=True, capture_output=True)
        config = tmp_path / "registry.yml"
        config.write_text(
            f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'store'}\n"
            f"http:\n  addr: {address}:{port}\n  tls:\n    certificate: {crt}\n    key: {key}\n"
        )
        trust = Path(f"/etc/docker/certs.d/{address}:{port}")
        trust.mkdir(parents=True, exist_ok=True)
        (trust / "ca.crt").write_bytes(crt.read_bytes())
        log = open(tmp_path / "registry.log", "wb")  # noqa: SIM115 - closed with the process below
        proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=log)
        started.append((proc, trust))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=0.5):
                return f"{address}:{port}"
            time.sleep(0.1)
        raise RuntimeError(f"docker-registry did not listen: {(tmp_path / 'registry.log').read_text()[-1000:]}")

    yield start
    for proc, trust in started:
        proc.terminate()
        proc.wait(timeout=20)
        shutil.rmtree(trust, ignore_errors=True)


@pytest.mark.integration
def test_push_then_every_node_pulls_the_same_id(cluster, local_docker_url, small_base, registry):
    hosts = cluster(2, docker=True)
    # The controller's address on the hosts' bridge: the local daemon and every node reach it.
    address = registry(hosts.gateway)
    client = docker.DockerClient(base_url=local_docker_url, version="auto", timeout=900)
    local_id = client.images.get(small_base).id
    with HostPool([h.name for h in hosts.hosts], ssh_config=hosts.ssh_config) as pool:
        result = distribute_via_registry(small_base, [h.name for h in hosts.hosts], pool, address, client=client)
    assert result.ok, result.to_dict()
    assert result.codec == "registry"
    remote = f"{address}/{small_base.split('/')[-1]}"
    for host in hosts.hosts:
        assert result.hosts[host.name].status == "loaded"
        assert result.hosts[host.name].detail == f"pulled {remote}; tagged {small_base}"
        assert host_image_id(hosts, host, small_base) == local_id
        assert host_image_id(hosts, host, remote) == local_id


# -- layer-aware: ship only the layers a node lacks --------------------------------------------------


def test_chain_ids_and_held_prefix():
    a, b, c = (f"sha256:{ch * 64}" for ch in "abc")
    chains = chain_ids([a, b, c])
    assert chains[0] == a
    assert chains[1] == "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest()
    assert chains[2] == "sha256:" + hashlib.sha256(f"{chains[1]} {c}".encode()).hexdigest()
    assert held_prefix([a, b, c], [[a, b, "sha256:" + "f" * 64], [a]]) == 2
    assert held_prefix([a, b, c], [[b, a]]) == 0
    assert held_prefix([a, b], [[a, b, c]]) == 2


def legacy_save(tmp_path, diff_ids: list[str], payloads: list[bytes]) -> tuple[bytes, list[str]]:
    """A tarball laid out as docker save (legacy format) lays one out: folders named by v1 ID,
    written in name order, with pax headers on the top layer (as large or odd members get)."""
    template = {"created": "1970-01-01T00:00:00Z", "container_config": {"Hostname": "", "Env": None}}
    ids = [*v1_ids(template, chain_ids(diff_ids)[:-1]), "f" * 64]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for index in sorted(range(len(ids)), key=lambda i: ids[i]):
            top = index == len(ids) - 1
            layer_json = {"id": ids[index], **template, "os": "linux"}
            if index:
                layer_json["parent"] = ids[index - 1]
            if top:
                layer_json["created"] = "2026-11-30T00:00:00Z"
            for leaf, body in (
                ("VERSION", b"1.0"),
                ("json", json.dumps(layer_json).encode()),
                ("layer.tar", payloads[index]),
            ):
                info = tarfile.TarInfo(f"{ids[index]}/{leaf}")
                info.size = len(body)
                if top:
                    info.pax_headers = {"comment": "x" * 300}
                tar.addfile(info, io.BytesIO(body))
        manifest = json.dumps([{"Layers": [f"{i}/layer.tar" for i in ids]}]).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(manifest)
        tar.addfile(info, io.BytesIO(manifest))
    return buffer.getvalue(), ids


def test_filter_leaves_out_exactly_the_held_layers(tmp_path):
    diff_ids = [f"sha256:{ch * 64}" for ch in "123"]
    payloads = [b"A" * 5000, b"B" * 700, b"C" * 1300]
    saved, ids = legacy_save(tmp_path, diff_ids, payloads)
    for held, dropped in ((0, []), (1, [ids[0]]), (2, ids[:2]), (3, ids)):
        skip = SkipHeldLayers(chain_ids(diff_ids), held)
        # Odd chunk sizes: headers and members split across chunks.
        chunks = [saved[i : i + 777] for i in range(0, len(saved), 777)]
        out = b"".join(filter_tar(chunks, skip.keep, skip.note_json))
        with tarfile.open(fileobj=io.BytesIO(out)) as tar:
            names = tar.getnames()
            kept = {name: tar.extractfile(name).read() for name in names if name.endswith("/layer.tar")}
        assert sorted(skip.skipped) == sorted(dropped), held
        assert sorted(kept) == sorted(f"{i}/layer.tar" for i in ids if i not in dropped)
        for index, folder in enumerate(ids):
            if folder not in dropped:
                assert kept[f"{folder}/layer.tar"] == payloads[index]
        assert "manifest.json" in names and all(f"{i}/json" in names for i in ids)


def build_local(docker_url: str, tag: str, dockerfile: str, workdir) -> str:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "Dockerfile").write_text(dockerfile)
    done = subprocess.run(
        ["docker", "-H", docker_url, "build", "-q", "--network", "host", "-t", tag, str(workdir)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return docker.DockerClient(base_url=docker_url, version="auto").images.get(tag).id


@pytest.mark.integration
def test_only_missing_layers_travel_and_ids_match(cluster, local_docker_url, small_base, tmp_path):
    hosts = cluster(2, docker=True)
    names = [h.name for h in hosts.hosts]
    # v1: the base plus a small layer; v2: one more small layer (a code change); v2b: v2 relabelled.
    run = f"FROM {small_base}\nRUN echo one > /one\n"
    build_local(local_docker_url, "dzctl-test/layers:v1", run, tmp_path / "v1")
    v2 = build_local(
        local_docker_url, "dzctl-test/layers:v2", run + f"RUN echo {tmp_path.name} > /two\n", tmp_path / "v2"
    )
    v2b = build_local(
        local_docker_url,
        "dzctl-test/layers:v2b",
        f"FROM dzctl-test/layers:v2\nLABEL x={tmp_path.name}\n",
        tmp_path / "v2b",
    )
    client = docker.DockerClient(base_url=local_docker_url, version="auto", timeout=900)
    base_bytes = client.images.get(small_base).attrs["Size"]
    with HostPool(names, ssh_config=hosts.ssh_config) as pool:
        first = distribute_image("dzctl-test/layers:v1", ["node0"], pool, client=client, codec="none", layer_store=None)
        assert first.ok and first.hosts["node0"].layers_held == 0  # nothing in common: the full stream
        assert first.hosts["node0"].bytes_sent > base_bytes * 0.9
        second = distribute_image("dzctl-test/layers:v2", names, pool, client=client, codec="none", layer_store=None)
        assert second.ok, second.to_dict()
        node0, node1 = second.hosts["node0"], second.hosts["node1"]
        assert (node0.layers_held, node0.layers_total) == (2, 3)
        assert node0.bytes_sent < 100_000, node0.bytes_sent  # the one new layer, a few KB
        assert node1.layers_held == 0 and node1.bytes_sent > base_bytes * 0.9  # fallback: whole
        third = distribute_image(
            "dzctl-test/layers:v2b", ["node0"], pool, client=client, codec="none", layer_store=None
        )
        assert third.ok and third.hosts["node0"].layers_held == 3
        assert third.hosts["node0"].bytes_sent < 50_000  # the config alone
    for host in hosts.hosts:
        assert host_image_id(hosts, host, "dzctl-test/layers:v2") == v2
    assert host_image_id(hosts, hosts.hosts[0], "dzctl-test/layers:v2b") == v2b


@pytest.mark.integration
def test_a_node_that_lost_its_layers_gets_the_whole_image(cluster, local_docker_url, small_base, tmp_path, monkeypatch):
    # The listing says node0 holds the base layer, but it does not (it was pruned between the
    # listing and the load): its partial load fails, and it is sent the full stream instead.
    hosts = cluster(1, docker=True)
    tag = "dzctl-test/layers:lost"
    image_id = build_local(local_docker_url, tag, f"FROM {small_base}\nRUN echo lost > /lost\n", tmp_path / "img")
    import orchestrator.image.distribute as distribute

    monkeypatch.setattr(distribute, "held_layers", lambda pool, hosts, layers: dict.fromkeys(hosts, 1))
    client = docker.DockerClient(base_url=local_docker_url, version="auto", timeout=900)
    with HostPool(["node0"], ssh_config=hosts.ssh_config) as pool:
        result = distribute_image(tag, ["node0"], pool, client=client, codec="none", layer_store=None)
    assert result.ok, result.to_dict()
    assert result.hosts["node0"].layers_held == 0  # the last attempt: whole
    assert result.hosts["node0"].bytes_sent > 24 << 20  # the base's random bytes too
    assert host_image_id(hosts, hosts.hosts[0], tag) == image_id


# -- a node that stalls, at every stream size and after its last byte (issue 28) --------------------
class LocalBytes:
    """A stream of ``size`` bytes in 1 MiB chunks: what docker save's stream is to the tee."""

    def __init__(self, size: int) -> None:
        self.size, self.raw_bytes = size, 0

    def chunks(self):
        while self.raw_bytes < self.size:
            chunk = b"\0" * min(1 << 20, self.size - self.raw_bytes)
            self.raw_bytes += len(chunk)
            yield chunk

    def close(self) -> None:
        pass


STALLS = {
    # node0 takes one byte and stops reading: its rest lies in the pipe, ssh's buffers, the tee's queue
    "reads one byte": "head -c 1 >/dev/null; sleep 1000",
    # node0 takes every byte, then never ends: a `docker load` that hangs after the transfer
    "hangs after the last byte": "cat >/dev/null; sleep 1000",
}


@pytest.mark.integration
@pytest.mark.parametrize("ssh_client", ["openssh", "paramiko"])
@pytest.mark.parametrize(
    ("size", "stall", "expected"),
    [
        # a code change's few KB: all of it fits in the pipes and buffers on the way
        (4_000, "reads one byte", "took all 0.0 MB but did not finish within 1 s of the last byte"),
        (20 << 20, "reads one byte", "took no data for 1 s"),  # less than the tee's queue holds
        (40 << 20, "reads one byte", "took no data for 1 s"),  # more than it holds
        (40 << 20, "hangs after the last byte", "took all 41.9 MB but did not finish within 9 s of the last byte"),
    ],
    ids=["4KB", "20MiB", "40MiB", "40MiB-after-last-byte"],
)
def test_a_node_that_stalls_is_cut_off_within_the_bound_whatever_the_size(cluster, ssh_client, size, stall, expected):
    from orchestrator.image.distribute import Codec, Progress, _stream_to
    from orchestrator.transport.openssh import stream_links

    hosts = cluster(2)
    names = [h.name for h in hosts.hosts]
    # node0 stalls; node1 takes the stream and ends, as a healthy node's load does.
    remote = f'if [ "$(hostname)" = node0 ]; then {STALLS[stall]}; else cat >/dev/null; fi'
    codec = Codec("test", None, ("sh", "-c", remote))
    outcomes: dict = {}
    ended = threading.Event()
    with HostPool(names, ssh_config=hosts.ssh_config) as pool:
        links, carriers, _ = stream_links(pool, names, ssh_client)
        assert set(carriers.values()) == {ssh_client}

        def distribute() -> None:
            _stream_to(codec, pool, names, Progress(), None, 1.0, outcomes, LocalBytes(size), links)
            ended.set()

        runner = threading.Thread(target=distribute, daemon=True)
        started = time.monotonic()
        runner.start()
        # The documented bounds (image/nodepipe.py): no data taken for the stall bound (1 s here), or,
        # after the last byte, the stall bound plus 1 s per 5 MB sent; and a second for the checks.
        bound = 1.0 + size / 5e6 + 1.0
        try:
            assert ended.wait(bound + 20), f"still streaming {time.monotonic() - started:.0f} s later"
            elapsed = time.monotonic() - started
        finally:
            for link in links.values():  # on failure: end what still runs, so the test process can exit
                link.close()
            for name in names:
                with contextlib.suppress(Exception):
                    pool.connection(name).close()
    assert outcomes["node0"].status == "failed" and outcomes["node0"].detail == expected
    assert elapsed < bound + 5, f"cut off after {elapsed:.1f} s, the bound is {bound:.1f} s"
    assert outcomes["node1"].status == "loaded", outcomes["node1"].detail
    assert outcomes["node1"].bytes_sent == size
