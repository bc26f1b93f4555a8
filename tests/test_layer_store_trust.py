"""The controller's layer store (orchestrator/image/store.py) keeps to itself (issue 28 item 4).

Real parts: Debian's docker-registry serving a real folder on 127.0.0.1, and for the prune, real images
pushed by the dockerd on this machine's root namespace. Each promise here failed before the fix:
the registry outlived a dzctl killed by a signal, answered anyone, was taken for ours whenever anything
on its port said 200, streamed a damaged blob without a word, never shrank, and a folder name with
``#`` in it cut its own config short.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from orchestrator.errors import RuntimeFailure
from orchestrator.image.store import KEEP_IMAGES, LayerStore, registry_config

ROOT = Path(__file__).resolve().parents[1]
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture
def registry_binary():
    if shutil.which("docker-registry") is None:
        if os.environ.get("DZCTL_REQUIRE_INTEGRATION") == "1":
            pytest.fail("the layer store needs docker-registry (apt-get install docker-registry)")
        pytest.skip("the layer store needs docker-registry (apt-get install docker-registry)")


def _status(url: str, headers: dict | None = None) -> int:
    try:
        with _DIRECT.open(urllib.request.Request(url, headers=headers or {}), timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _gone(pid: int, port: int) -> bool:
    """The registry is no longer there: nothing listens on its port, and the process has exited."""
    import socket

    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            return False
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in state  # exited; its parent (init, as dzctl is gone) reaps it


HOLDER = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    from orchestrator.image.store import LayerStore

    # As in a terminal: a test run under nohup (or a CI runner) would pass SIGHUP on ignored.
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

    with LayerStore(Path(sys.argv[1])) as store:
        print(store.port, store.pid, flush=True)
        time.sleep(600)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL], ids=["TERM", "HUP", "KILL"])
def test_the_registry_ends_with_the_dzctl_that_started_it_whatever_the_signal(tmp_path, registry_binary, sig):
    root = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port, pid = map(int, holder.stdout.readline().split())
        holder.send_signal(sig)
        holder.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not _gone(pid, port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(pid, port), f"the registry (pid {pid}) outlived the dzctl killed by {sig.name}"
    finally:
        if holder.poll() is None:
            holder.kill()
    with LayerStore(root) as again:  # the port is free again: the daemon's memory of what it pushed holds
        assert again.port == port


def test_the_store_answers_only_with_this_run_s_credential(tmp_path, registry_binary):
    with LayerStore(tmp_path / "store") as store:
        assert _status(f"{store.url}/v2/") == 401
        assert _status(f"{store.url}/v2/_catalog") == 401
        assert _status(f"{store.url}/v2/", {"Authorization": "Basic ZHpjdGw6d3Jvbmc="}) == 401  # dzctl:wrong
        assert _status(f"{store.url}/v2/", store.auth_header) == 200
        first = store.auth_header
    with LayerStore(tmp_path / "store") as store:
        assert store.auth_header != first  # a new credential each time: an old one opens nothing
        assert _status(f"{store.url}/v2/", first) == 401
    htpasswd = tmp_path / "store" / "htpasswd"
    assert htpasswd.stat().st_mode & 0o077 == 0  # the hash is for this user only


def test_something_else_answering_on_the_port_is_not_taken_for_the_store(tmp_path, registry_binary):
    """A server that answers 200 to anyone (here: a stand-in for the registry binary) is not ours."""
    impostor = tmp_path / "impostor"
    impostor.write_text(
        textwrap.dedent(
            f"""\
            #!{sys.executable}
            import http.server, sys, yaml
            host, port = yaml.safe_load(open(sys.argv[2]))["http"]["addr"].rsplit(":", 1)
            class Yes(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    self.send_response(200)
                    self.end_headers()
            http.server.HTTPServer((host, int(port)), Yes).serve_forever()
            """
        )
    )
    impostor.chmod(0o755)
    with (
        pytest.raises(RuntimeFailure, match="not the layer store's registry"),
        LayerStore(tmp_path / "store", binary=str(impostor)),
    ):
        pass


def _upload(store: LayerStore, data: bytes) -> str:
    """Put ``data`` into the store as a blob through the registry's own API; returns its digest."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    start = urllib.request.Request(
        f"{store.url}/v2/dzctl-layers/blobs/uploads/", method="POST", headers=store.auth_header
    )
    with _DIRECT.open(start, timeout=30) as answer:
        location = answer.headers["Location"]
    if location.startswith("/"):
        location = store.url + location
    sep = "&" if "?" in location else "?"
    put = urllib.request.Request(
        f"{location}{sep}digest={digest}",
        data=data,
        method="PUT",
        headers={**store.auth_header, "Content-Type": "application/octet-stream"},
    )
    with _DIRECT.open(put, timeout=30) as answer:
        assert answer.status == 201
    return digest


def test_a_damaged_blob_is_refused_before_its_last_chunk_leaves(tmp_path, registry_binary):
    data = os.urandom(3 * (1 << 20) + 12345)
    with LayerStore(tmp_path / "store") as store:
        digest = _upload(store, data)
        assert b"".join(store.blob(digest)) == data
        on_disk = next((tmp_path / "store" / "registry").rglob(f"blobs/sha256/*/{digest[7:]}/data"))
        damaged = bytearray(on_disk.read_bytes())
        damaged[-1] ^= 0xFF  # same size: only the digest can tell
        on_disk.write_bytes(bytes(damaged))
        sent = []
        with pytest.raises(RuntimeFailure, match=f"{digest}.*does not match"):
            for chunk in store.blob(digest):
                sent.append(chunk)
        # What a node was sent stops short of the blob's end: its docker load fails, it never loads it.
        assert sum(map(len, sent)) < len(data)


def test_a_folder_name_with_a_hash_and_spaces_is_the_store_s_folder(tmp_path, registry_binary):
    root = tmp_path / "my store #2"
    config = yaml.safe_load(registry_config(root, 5123, root / "htpasswd"))
    assert config["storage"]["filesystem"]["rootdirectory"] == str(root / "registry")
    assert config["auth"]["htpasswd"]["path"] == str(root / "htpasswd")
    with LayerStore(root) as store:
        digest = _upload(store, b"x" * 1000)
    assert list((root / "registry").rglob(f"blobs/sha256/*/{digest[7:]}/data"))


@pytest.mark.integration
def test_the_store_keeps_the_newest_images_and_drops_the_older_ones_blobs(tmp_path, local_docker_url, registry_binary):
    """Rule: the store keeps the last KEEP_IMAGES images pushed to it; older ones' blobs, and uploads
    left unfinished, go when the store closes (its registry stopped, under its lock)."""
    import docker

    client = docker.DockerClient(base_url=local_docker_url, version="auto", timeout=300)
    (tmp_path / "shared").write_bytes(os.urandom(200_000))
    images = []
    for index in range(KEEP_IMAGES + 1):
        context = tmp_path / f"v{index}"
        context.mkdir()
        shutil.copy(tmp_path / "shared", context / "shared")
        (context / "own").write_bytes(os.urandom(100_000))
        (context / "Dockerfile").write_text("FROM scratch\nCOPY shared /shared\nCOPY own /own\n")
        image, _ = client.images.build(path=str(context), tag=f"dzctl-test/prune:{tmp_path.name}-{index}", rm=True)
        images.append(image)
    root = tmp_path / "store"
    pushed = []
    try:
        for image in images:
            with LayerStore(root) as store:
                diff_ids = image.attrs["RootFS"]["Layers"]
                pushed.append((diff_ids, store.push(client, image.id, diff_ids)))
                # An upload left unfinished (a push cut off): the next close removes it.
                stale = root / "registry" / "docker" / "registry" / "v2" / "repositories" / "dzctl-layers"
                (stale / "_uploads" / "cut-off").mkdir(parents=True, exist_ok=True)
                (stale / "_uploads" / "cut-off" / "data").write_bytes(b"partial")
    finally:
        for image in images:
            client.images.remove(image.id, force=True)
    blobs = {p.parent.name for p in (root / "registry").rglob("blobs/sha256/*/*/data")}
    oldest_diff, oldest = pushed[0]
    assert oldest.config_digest[7:] not in blobs and oldest.layer_digests[1][7:] not in blobs
    for _, kept in pushed[1:]:
        assert {d[7:] for d in (kept.config_digest, *kept.layer_digests)} <= blobs
    assert oldest.layer_digests[0] == pushed[-1][1].layer_digests[0]  # the shared layer stays
    known = (root / "layers.txt").read_text().split()
    assert oldest_diff[1] not in known and oldest_diff[0] in known
    assert all(diff in known for diffs, _ in pushed[1:] for diff in diffs)
    assert not list((root / "registry").rglob("_uploads/*"))
