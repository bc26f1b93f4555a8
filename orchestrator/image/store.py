"""The controller's layer store: a registry on 127.0.0.1 that this machine's Docker daemon pushes to.

Why: a Docker 20.10 daemon's ``docker save`` exports every layer of an image to a temporary
folder before it streams a byte, so a stream that leaves out 99.9% of an image still costs the
export of all of it (17 s of the 41 s that a one-line change took to reach 3 nodes with the 1.73 GB
CPU image). ``docker push`` is the one daemon operation that exports only some layers: the daemon
remembers which layers it has pushed to a registry (by digest) and only checks those are still there.
So ``distribute`` pushes the image here (the first time: every layer; after a code change: the few
new ones), then builds each node's ``docker load`` tarball from the stored blobs: the image's config
(byte for byte, so the ID is the same) and the gzip blobs of the layers that node lacks.

``dzctl build`` fills the store as its last step (``fill_store``), where a user expects to wait:
the push gzips every new layer on the daemon's side (73 s for the 1.82 GB CPU image on 2 cores,
benchmarks/results/distribute-first-20261201.txt; a code change: its new layers only), and paid
during ``distribute`` it would compete with the streams for the CPU. With the store full, even a
node that holds nothing is sent the stored blobs: no ``docker save`` and no compression while the
nodes wait.

The store is a cache: a folder (default ``~/.cache/dzctl/layer-store``, ``DZCTL_LAYER_STORE``
overrides, ``off`` disables) with Debian's ``docker-registry`` (distribution 2.x) serving it on
127.0.0.1 only while a ``distribute`` or a ``build`` uses it. Docker trusts plain HTTP on
127.0.0.0/8 without any daemon setting. The port is kept in the folder: the daemon's memory of what
it pushed is keyed by ``127.0.0.1:PORT``, so the same port keeps later pushes incremental. Deleting
the folder is safe (the next distribute pushes everything again). One ``distribute`` at a time uses
it (a lock); a second one at the same time goes without it.

The store keeps to itself:
- its registry ends with the dzctl that started it, however that ends: the kernel sends it SIGTERM
  when its parent dies (``setpriv --pdeathsig``, from util-linux; where setpriv is missing only a
  clean exit stops it), so a closed terminal or a ``kill`` leaves no registry
  holding the port (the next run would have to pick another and push every layer again);
- it answers only this run: each start makes a random credential (its bcrypt hash in ``htpasswd``,
  mode 0600; the password only in this process), so no other local user or host-network container can
  pull the image or push into the cache; a server on the port that answers without it is refused;
- every blob is checked against its digest as it streams, and its last chunk is held back until the
  check passes, so a damaged store ends a node's stream short and its ``docker load`` fails;
- it keeps the last ``KEEP_IMAGES`` images pushed to it: when it closes (registry stopped, lock held)
  older images' manifests go, ``garbage-collect`` removes the blobs no kept image uses, unfinished
  uploads are removed, and ``layers.txt`` is rewritten from the kept images.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import RuntimeFailure

REPOSITORY = "dzctl-layers"
MANIFEST_V2 = "application/vnd.docker.distribution.manifest.v2+json"
CHUNK = 1 << 20
START_TIMEOUT = 20.0
KEEP_IMAGES = 3  # images kept in the store (the newest pushes); older ones' blobs go when it closes
USER = "dzctl"
REGISTRY_BINARIES = ("docker-registry", "registry")  # Debian's package name, upstream's
# Straight to 127.0.0.1: urllib would send even a loopback request through an HTTP_PROXY from the
# environment unless NO_PROXY names it.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def default_root() -> Path | None:
    """The store's folder, or None when ``DZCTL_LAYER_STORE=off``."""
    configured = os.environ.get("DZCTL_LAYER_STORE", "")
    if configured.lower() in ("off", "0", "no", "none"):
        return None
    if configured:
        return Path(configured)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "dzctl" / "layer-store"


def registry_binary() -> str | None:
    return next((path for name in REGISTRY_BINARIES if (path := shutil.which(name))), None)


def daemon_is_local(client) -> bool:
    """Whether the daemon runs here (a unix socket): only then is our 127.0.0.1 also its own."""
    # docker-py names a unix socket "http+docker://localhost" (ssh://: ".../ssh", TCP: the address).
    return str(getattr(client.api, "base_url", "")) == "http+docker://localhost"


def registry_config(root: Path, port: int, htpasswd: Path) -> str:
    """docker-registry's config: filesystem storage in ``root``, plain HTTP on 127.0.0.1 only, one user.

    Paths are JSON strings (JSON is YAML): a folder named ``my store #2`` stays whole.
    """
    return (
        "version: 0.1\n"
        "log:\n  level: error\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {json.dumps(str(root / 'registry'))}\n"
        "  maintenance:\n    uploadpurging:\n      enabled: false\n"  # close() removes uploads itself
        f"auth:\n  htpasswd:\n    realm: dzctl-layer-store\n    path: {json.dumps(str(htpasswd))}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )


def serve_argv(binary: str, config: Path) -> list[str]:
    """The registry's command line: under ``setpriv --pdeathsig TERM`` (util-linux), so the kernel ends
    it when dzctl ends, however dzctl ends. An exec, not a ``preexec_fn``: dzctl has threads by then,
    and code run between fork and exec in a threaded process can deadlock."""
    wrapper = shutil.which("setpriv")
    prefix = [wrapper, "--pdeathsig", "TERM", "--"] if wrapper else []
    return [*prefix, binary, "serve", str(config)]


@dataclass(frozen=True)
class StoredImage:
    """An image as the store holds it: its config blob and one gzip blob per layer, bottom first."""

    config_digest: str  # sha256 of the config: the image ID every node must end with
    config_size: int
    layer_digests: tuple[str, ...]
    layer_sizes: tuple[int, ...]
    layers_pushed: int = 0  # how many layers this push exported (the rest were here already)


class LayerStore:
    """A running store (``with LayerStore(root) as store``); raises RuntimeFailure if it cannot start."""

    def __init__(self, root: Path, binary: str | None = None) -> None:
        self.root = root
        self.binary = binary or registry_binary()
        self.port = 0
        self._lock_file = None
        self._proc: subprocess.Popen | None = None
        self._password = ""

    # -- lifetime ---------------------------------------------------------------------------------

    def __enter__(self) -> LayerStore:
        if self.binary is None:
            raise RuntimeFailure("no registry binary (apt-get install docker-registry)")
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.root / "lock", "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeFailure(f"the layer store {self.root} is in use by another dzctl") from None
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
            # Under the lock with the registry stopped: nothing reads or writes the folder now.
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self._prune()
        if self._lock_file is not None:
            self._lock_file.close()  # releases the lock
            self._lock_file = None

    def _port(self) -> int:
        """The port this store used before (free again, as we hold its lock), else a new free one."""
        saved = self.root / "port"
        with contextlib.suppress(ValueError, OSError):
            port = int(saved.read_text())
            with socket.socket() as probe:
                # As Go's listener does: a port left in TIME_WAIT by the last run is free to use.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(("127.0.0.1", port))
            return port
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        saved.write_text(f"{port}\n")
        return port

    def _start(self) -> None:
        import bcrypt  # paramiko's dependency, declared in pyproject.toml for this

        self.port = self._port()
        self._password = secrets.token_urlsafe(24)
        htpasswd = self.root / "htpasswd"
        # The registry checks the hash on every request; 192 random bits need no slow hash to resist
        # guessing, so the cheapest cost keeps a push's hundreds of requests fast.
        hashed = bcrypt.hashpw(self._password.encode(), bcrypt.gensalt(rounds=4)).decode()
        fd = os.open(htpasswd, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"{USER}:{hashed}\n")
        os.chmod(htpasswd, 0o600)  # an older file kept its mode through O_TRUNC
        config = self.root / "registry.yml"
        config.write_text(registry_config(self.root, self.port, htpasswd))
        log = open(self.root / "registry.log", "ab")  # noqa: SIM115 - the child holds it; closed here
        try:
            self._proc = subprocess.Popen(serve_argv(self.binary, config), stdout=log, stderr=log)
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            with contextlib.suppress(OSError):
                if self._answers(with_credential=False) == 401 and self._answers(with_credential=True) == 200:
                    return
                if self._answers(with_credential=False) == 200:
                    raise RuntimeFailure(
                        f"127.0.0.1:{self.port} answers without the store's credential: it is not the layer"
                        " store's registry (something else holds the port, or the binary is not docker-registry)"
                    )
            time.sleep(0.05)
        tail = (self.root / "registry.log").read_text(errors="replace")[-800:]
        raise RuntimeFailure(f"the layer store's registry did not start on 127.0.0.1:{self.port}: {tail}")

    def _answers(self, with_credential: bool) -> int:
        request = urllib.request.Request(f"{self.url}/v2/", headers=self.auth_header if with_credential else {})
        try:
            with _DIRECT.open(request, timeout=1) as answer:
                return answer.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except urllib.error.URLError as exc:
            raise OSError(str(exc)) from exc

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def auth_header(self) -> dict[str, str]:
        """This run's credential, as an HTTP header (the daemon gets it as ``auth_config``)."""
        token = base64.b64encode(f"{USER}:{self._password}".encode()).decode()
        return {"Authorization": f"Basic {token}"}

    def _open(self, path: str, timeout: float, headers: dict | None = None):
        request = urllib.request.Request(f"{self.url}{path}", headers={**self.auth_header, **(headers or {})})
        return _DIRECT.open(request, timeout=timeout)

    # -- pruning ----------------------------------------------------------------------------------

    def _images(self) -> list[dict]:
        """The images pushed here, oldest first: ``{"tag", "diff_ids"}`` per push (images.jsonl)."""
        with contextlib.suppress(OSError):
            lines = (self.root / "images.jsonl").read_text().splitlines()
            return [json.loads(line) for line in lines if line.strip()]
        return []

    def _record_image(self, tag: str, diff_ids: list[str]) -> None:
        kept = [image for image in self._images() if image["tag"] != tag]
        kept.append({"tag": tag, "diff_ids": list(diff_ids)})
        _write_lines(self.root / "images.jsonl", [json.dumps(image) for image in kept])

    def _prune(self) -> None:
        """Keep the newest ``KEEP_IMAGES`` images; remove the rest's blobs and unfinished uploads."""
        repository = self.root / "registry" / "docker" / "registry" / "v2" / "repositories" / REPOSITORY
        shutil.rmtree(repository / "_uploads", ignore_errors=True)
        images = self._images()
        if len(images) <= KEEP_IMAGES:
            return
        old, kept = images[:-KEEP_IMAGES], images[-KEEP_IMAGES:]
        for image in old:
            shutil.rmtree(repository / "_manifests" / "tags" / image["tag"], ignore_errors=True)
        # With their tags gone, the old manifests are untagged: garbage-collect deletes them and every
        # blob that no kept manifest references (a layer a kept image shares stays).
        subprocess.run(
            [self.binary, "garbage-collect", "--delete-untagged", str(self.root / "registry.yml")],
            capture_output=True,
            timeout=600,
            check=True,
        )
        _write_lines(self.root / "images.jsonl", [json.dumps(image) for image in kept])
        known = dict.fromkeys(diff for image in kept for diff in image["diff_ids"])
        _write_lines(self.root / "layers.txt", list(known))

    # -- contents ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def known_layers(self) -> set[str]:
        """Diff IDs of every layer pushed here before (recorded by ``push``)."""
        with contextlib.suppress(OSError):
            return set((self.root / "layers.txt").read_text().split())
        return set()

    def push(self, client, image_id: str, diff_ids: list[str]) -> StoredImage:
        """Push ``image_id`` here (the daemon sends only layers it has not pushed here) and read it back."""
        tag = image_id.removeprefix("sha256:")[:32]
        reference = f"127.0.0.1:{self.port}/{REPOSITORY}"
        client.api.tag(image_id, reference, tag)
        pushed: set[str] = set()
        try:
            credential = {"username": USER, "password": self._password}
            for chunk in client.api.push(reference, tag, stream=True, decode=True, auth_config=credential):
                if "error" in chunk:
                    raise RuntimeFailure(f"docker push to the layer store failed: {chunk['error']}")
                if chunk.get("status") == "Pushed":
                    pushed.add(chunk.get("id", ""))
        finally:
            # Only our name goes: the image keeps its own tags (and an image with no other name
            # would be deleted by an untag, so that one keeps ours).
            with contextlib.suppress(Exception):
                if len(client.images.get(image_id).tags) > 1:
                    client.api.remove_image(f"{reference}:{tag}", noprune=True)
        stored = dataclasses.replace(self.stored(tag), layers_pushed=len(pushed))
        if stored.config_digest != image_id or len(stored.layer_digests) != len(diff_ids):
            raise RuntimeFailure(
                f"the layer store holds {stored.config_digest} with {len(stored.layer_digests)} layers"
                f" for {image_id} ({len(diff_ids)} layers)"
            )
        known = self.known_layers()
        with open(self.root / "layers.txt", "a") as record:
            record.writelines(f"{diff_id}\n" for diff_id in diff_ids if diff_id not in known)
        self._record_image(tag, diff_ids)
        return stored

    def stored(self, tag: str) -> StoredImage:
        with self._open(f"/v2/{REPOSITORY}/manifests/{tag}", 60, {"Accept": MANIFEST_V2}) as answer:
            manifest = json.load(answer)
        if manifest.get("mediaType") != MANIFEST_V2:
            raise RuntimeFailure(f"the layer store answered a {manifest.get('mediaType')} manifest")
        config = manifest["config"]
        return StoredImage(
            config_digest=config["digest"],
            config_size=int(config["size"]),
            layer_digests=tuple(layer["digest"] for layer in manifest["layers"]),
            layer_sizes=tuple(int(layer["size"]) for layer in manifest["layers"]),
        )

    def blob(self, digest: str) -> Iterator[bytes]:
        """A stored blob's bytes, streamed; the last chunk only once the whole blob matches ``digest``."""
        algorithm, _, want = digest.partition(":")
        hasher = hashlib.new(algorithm)
        held = b""
        with self._open(f"/v2/{REPOSITORY}/blobs/{digest}", 300) as answer:
            while chunk := answer.read(CHUNK):
                hasher.update(chunk)
                if held:
                    yield held
                held = chunk
        if hasher.hexdigest() != want:
            raise RuntimeFailure(
                f"the layer store's blob {digest} does not match its digest (sha256 {hasher.hexdigest()}):"
                f" the store is damaged; delete {self.root} (the next distribute fills it again)"
            )
        yield held


def _write_lines(path: Path, lines: list[str]) -> None:
    """Replace ``path`` whole (a crash leaves the old file or the new one, never half of either)."""
    part = path.with_name(path.name + ".part")
    part.write_text("".join(f"{line}\n" for line in lines))
    os.replace(part, path)


def open_store(layer_store, client, notes: list[str], cleanup: contextlib.ExitStack) -> LayerStore | None:
    """The running layer store, or None (with the reason in ``notes`` where a user can act on it).

    ``layer_store``: a folder, ``"auto"`` (``default_root()``), or None (no store).
    """
    root = default_root() if layer_store == "auto" else layer_store
    if root is None:
        return None
    if registry_binary() is None:
        notes.append(
            "no layer store (docker-registry is not installed here): after a code change docker save"
            " exports the whole image again; apt-get install docker-registry"
        )
        return None
    if not daemon_is_local(client):
        notes.append("no layer store: the Docker daemon is not on this machine")
        return None
    try:
        return cleanup.enter_context(LayerStore(Path(root)))
    except RuntimeFailure as exc:
        notes.append(f"no layer store this time: {exc}")
        return None


@dataclass(frozen=True)
class StoreFill:
    """What ``fill_store`` did: ``stored`` is None when the store was not filled (``note`` says why)."""

    stored: StoredImage | None
    layers_total: int
    elapsed_s: float
    note: str

    def to_dict(self) -> dict:
        return {
            "filled": self.stored is not None,
            "layers_pushed": self.stored.layers_pushed if self.stored else 0,
            "layers_total": self.layers_total,
            "elapsed_s": round(self.elapsed_s, 1),
            "note": self.note,
        }


def fill_store(client, image_id: str, layer_store="auto") -> StoreFill:
    """Push ``image_id`` into the layer store, so that ``distribute`` streams every node from it.

    Never raises for the store's sake: the store is an optimisation, and ``distribute`` fills it
    itself (alongside its first stream) when it was not filled here.
    """
    started = time.monotonic()
    diff_ids = list((client.images.get(image_id).attrs.get("RootFS") or {}).get("Layers") or [])
    notes: list[str] = []
    with contextlib.ExitStack() as cleanup:
        store = open_store(layer_store, client, notes, cleanup)
        if store is None:
            note = notes[0] if notes else "no layer store (DZCTL_LAYER_STORE=off)"
            return StoreFill(None, len(diff_ids), time.monotonic() - started, note)
        try:
            stored = store.push(client, image_id, diff_ids)
        except Exception as exc:  # reported: distribute falls back to docker save and fills it later
            note = f"the layer store was not filled ({exc}): distribute fills it on its first run"
            return StoreFill(None, len(diff_ids), time.monotonic() - started, note)
    elapsed = time.monotonic() - started
    note = (
        f"layer store: {stored.layers_pushed} of {len(diff_ids)} layers pushed in {elapsed:.0f} s"
        f" ({store.root}); distribute sends nodes these blobs"
    )
    return StoreFill(stored, len(diff_ids), elapsed, note)
