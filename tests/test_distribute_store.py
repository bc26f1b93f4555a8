"""dzctl distribute through the controller's layer store: a code change reaches the nodes without a
``docker save`` of the whole image.

Real parts only: the image comes from the dockerd on this machine's root namespace, the store is
Debian's docker-registry on 127.0.0.1 (orchestrator/image/store.py), the nodes are test hosts with
their own sshd and dockerd (tests/testhosts.py).
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import urllib.request

import docker
import pytest
from test_distribute import build_local, host_image_id

from orchestrator.errors import RuntimeFailure
from orchestrator.image.distribute import distribute_image
from orchestrator.image.layers import layer_member, load_manifest, plan_streams, tar_stream
from orchestrator.image.store import LayerStore, daemon_is_local, fill_store, registry_config
from orchestrator.transport.pool import HostPool

# -- pure parts -----------------------------------------------------------------------------------


def test_tar_stream_is_a_tar_of_the_members_in_order():
    payload = b"x" * 1300  # not a multiple of 512: padded
    members = [("a.json", 3, [b"{", b"}\n"]), ("0/layer.tar", len(payload), [payload[:700], payload[700:]])]
    data = b"".join(tar_stream(members))
    assert len(data) % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getnames() == ["a.json", "0/layer.tar"]
        assert tar.extractfile("0/layer.tar").read() == payload
    with pytest.raises(ValueError, match=r"a\.json: 2 bytes read, 3 expected"):
        b"".join(tar_stream([("a.json", 3, [b"{}"])]))


def test_load_manifest_names_every_layer_held_ones_too():
    manifest = json.loads(load_manifest("abc.json", ["repo/x:1"], 3))
    assert manifest == [
        {"Config": "abc.json", "RepoTags": ["repo/x:1"], "Layers": ["0/layer.tar", "1/layer.tar", "2/layer.tar"]}
    ]
    assert layer_member(2) == "2/layer.tar"


def test_plan_streams_uses_the_store_only_for_layers_it_already_has():
    a, b, c = "sha256:a", "sha256:b", "sha256:c"
    # No store: today's streams.
    plan = plan_streams([a, b, c], [0, 2], None)
    assert (plan.sources, plan.push_first, plan.prime) == ({0: "save", 2: "save"}, False, False)
    # An empty store: save streams, and the store is filled meanwhile.
    plan = plan_streams([a, b, c], [0, 2], set())
    assert (plan.sources, plan.push_first, plan.prime) == ({0: "save", 2: "save"}, False, True)
    # The store has what the node holds: push first (only c is new to it), stream from the store;
    # after that push the store holds the whole image, so a node holding nothing takes its blobs too.
    plan = plan_streams([a, b, c], [0, 2], {a, b})
    assert (plan.sources, plan.push_first, plan.prime) == ({0: "store", 2: "store"}, True, False)
    # The store lacks a layer the node holds: the push would export it, so docker save it is.
    plan = plan_streams([a, b, c], [2], {a})
    assert (plan.sources, plan.push_first, plan.prime) == ({2: "save"}, False, True)
    # A fresh node and a part-filled store: the push would gzip b and c first, so docker save it is.
    plan = plan_streams([a, b, c], [0], {a})
    assert (plan.sources, plan.push_first, plan.prime) == ({0: "save"}, False, True)


def test_plan_streams_sends_a_fresh_node_the_stored_blobs_of_a_built_image():
    # dzctl build filled the store: no docker save (and no compression) while the nodes wait.
    a, b, c = "sha256:a", "sha256:b", "sha256:c"
    plan = plan_streams([a, b, c], [0], {a, b, c})
    assert (plan.sources, plan.push_first, plan.prime) == ({0: "store"}, True, False)


def test_the_store_is_used_only_with_a_daemon_on_this_machine():
    # The daemon pushes to 127.0.0.1: that is our loopback only when it runs here.
    assert daemon_is_local(docker.DockerClient(base_url="unix:///var/run/docker.sock", version="1.41"))
    assert not daemon_is_local(docker.DockerClient(base_url="tcp://10.0.0.5:2375", version="1.41"))


def test_registry_config_listens_on_loopback_only(tmp_path):
    config = registry_config(tmp_path, 5123, tmp_path / "htpasswd")
    assert "addr: 127.0.0.1:5123" in config
    assert f'rootdirectory: "{tmp_path / "registry"}"' in config


# -- real hosts -----------------------------------------------------------------------------------


def record_saves(client) -> list[str]:
    """The names ``client`` is asked to ``docker save`` from now on (every save goes through get_image)."""
    saves: list[str] = []
    real_get_image = client.api.get_image

    def counted_get_image(name, *args, **kwargs):
        saves.append(name)
        return real_get_image(name, *args, **kwargs)

    client.api.get_image = counted_get_image
    return saves


@pytest.fixture
def registry_binary():
    if shutil.which("docker-registry") is None:
        pytest.skip("the layer store needs docker-registry (apt-get install docker-registry)")


def test_the_store_keeps_its_port_and_serves_one_dzctl_at_a_time(tmp_path, registry_binary):
    # The daemon remembers what it pushed by 127.0.0.1:PORT: a new port would make it push everything.
    ports = []
    for _ in range(2):
        with LayerStore(tmp_path / "store") as store:
            ports.append(store.port)
            direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            direct.open(urllib.request.Request(f"{store.url}/v2/", headers=store.auth_header), timeout=5).close()
            with pytest.raises(RuntimeFailure, match="in use by another dzctl"), LayerStore(tmp_path / "store"):
                pass
    assert ports[0] == ports[1]


@pytest.mark.integration
def test_a_code_change_comes_from_the_store_without_a_whole_image_save(
    cluster, local_docker_url, base_image, tmp_path, registry_binary
):
    hosts = cluster(1, docker=True)
    store = tmp_path / "store"
    # v1: the base plus a small layer; v2: one more small layer (a code change); v2b: v2 relabelled.
    run = f"FROM {base_image}\nRUN echo one > /one\n"
    build_local(local_docker_url, "dzctl-test/store:v1", run, tmp_path / "v1")
    v2 = build_local(
        local_docker_url, "dzctl-test/store:v2", run + f"RUN echo {tmp_path.name} > /two\n", tmp_path / "v2"
    )
    v2b = build_local(
        local_docker_url,
        "dzctl-test/store:v2b",
        f"FROM dzctl-test/store:v2\nLABEL x={tmp_path.name}\n",
        tmp_path / "v2b",
    )
    client = docker.DockerClient(base_url=local_docker_url, version="auto", timeout=900)
    saves = record_saves(client)
    with HostPool(["node0"], ssh_config=hosts.ssh_config) as pool:
        first = distribute_image("dzctl-test/store:v1", ["node0"], pool, client=client, codec="none", layer_store=store)
        assert first.ok, first.to_dict()
        # The node held nothing: the full save stream, and the store was filled meanwhile.
        assert first.hosts["node0"].source == "save" and saves == ["dzctl-test/store:v1"]
        assert any(note.startswith("layer store filled: 2 layers pushed") for note in first.notes), first.notes
        saves.clear()

        second = distribute_image(
            "dzctl-test/store:v2", ["node0"], pool, client=client, codec="none", layer_store=store
        )
        assert second.ok, second.to_dict()
        node0 = second.hosts["node0"]
        assert (node0.source, node0.layers_held, node0.layers_total) == ("store", 2, 3)
        assert saves == [], "the whole image was exported by docker save"
        assert "layer store: 1 of 3 layers were new to it" in second.notes  # the push was incremental
        assert node0.bytes_sent < 100_000, node0.bytes_sent  # the new layer (gzip) and the config

        third = distribute_image(
            "dzctl-test/store:v2b", ["node0"], pool, client=client, codec="none", layer_store=store
        )
        assert third.ok and third.hosts["node0"].source == "store" and saves == []
        assert third.hosts["node0"].layers_held == 3 and third.hosts["node0"].bytes_sent < 50_000
    assert host_image_id(hosts, hosts.hosts[0], "dzctl-test/store:v2") == v2
    assert host_image_id(hosts, hosts.hosts[0], "dzctl-test/store:v2b") == v2b
    # The store's name for the image was a push detail: the controller's image keeps only its own.
    assert client.images.get("dzctl-test/store:v2").tags == ["dzctl-test/store:v2"]


@pytest.mark.integration
def test_a_built_image_reaches_fresh_nodes_from_the_store_without_docker_save(
    cluster, local_docker_url, base_image, tmp_path, registry_binary
):
    # dzctl build ends with fill_store: the first distribution then needs no docker save and no
    # compression on the controller, even for nodes that hold nothing.
    hosts = cluster(2, docker=True)
    store = tmp_path / "store"
    built = build_local(
        local_docker_url,
        "dzctl-test/built:v1",
        f"FROM {base_image}\nRUN echo {tmp_path.name} > /one\n",
        tmp_path / "v1",
    )
    client = docker.DockerClient(base_url=local_docker_url, version="auto", timeout=900)
    filled = fill_store(client, built, layer_store=store)
    assert filled.to_dict() | {"elapsed_s": 0} == {
        "filled": True,
        "layers_pushed": 2,
        "layers_total": 2,
        "elapsed_s": 0,
        "note": filled.note,
    }
    assert filled.note.startswith("layer store: 2 of 2 layers pushed")
    saves = record_saves(client)
    names = [host.name for host in hosts.hosts]
    with HostPool(names, ssh_config=hosts.ssh_config) as pool:
        first = distribute_image("dzctl-test/built:v1", names, pool, client=client, codec="zstd", layer_store=store)
    assert first.ok, first.to_dict()
    assert saves == [], "the whole image was exported by docker save"
    for name in names:
        outcome = first.hosts[name]
        assert (outcome.source, outcome.layers_held, outcome.layers_total) == ("store", 0, 2), outcome.to_dict()
        assert host_image_id(hosts, hosts.host(name), "dzctl-test/built:v1") == built
    assert first.codec == "none"  # the stored blobs are gzip already: no second compression
    assert "layer store: 0 of 2 layers were new to it" in first.notes, first.notes
    # Filling again is cheap and changes nothing: the daemon remembers what it pushed.
    assert fill_store(client, built, layer_store=store).stored.layers_pushed == 0


@pytest.mark.integration
def test_fill_store_says_why_when_there_is_no_store(local_docker_url, base_image):
    client = docker.DockerClient(base_url=local_docker_url, version="auto", timeout=900)
    image_id = client.images.get(base_image).id
    skipped = fill_store(client, image_id, layer_store=None)
    assert skipped.stored is None and not skipped.to_dict()["filled"]
    assert "DZCTL_LAYER_STORE=off" in skipped.note


@pytest.mark.integration
def test_without_the_store_a_code_change_is_a_filtered_save(cluster, local_docker_url, base_image, tmp_path):
    # layer_store=None: the same change still ships only the new layer, through docker save.
    hosts = cluster(1, docker=True)
    run = f"FROM {base_image}\nRUN echo one > /one\n"
    build_local(local_docker_url, "dzctl-test/nostore:v1", run, tmp_path / "v1")
    v2 = build_local(
        local_docker_url, "dzctl-test/nostore:v2", run + f"RUN echo {tmp_path.name} > /two\n", tmp_path / "v2"
    )
    client = docker.DockerClient(base_url=local_docker_url, version="auto", timeout=900)
    with HostPool(["node0"], ssh_config=hosts.ssh_config) as pool:
        assert distribute_image("dzctl-test/nostore:v1", ["node0"], pool, client=client, layer_store=None).ok
        second = distribute_image("dzctl-test/nostore:v2", ["node0"], pool, client=client, layer_store=None)
    assert second.ok and second.hosts["node0"].source == "save" and second.hosts["node0"].layers_held == 2
    assert host_image_id(hosts, hosts.hosts[0], "dzctl-test/nostore:v2") == v2
