"""Putting one image on every node, by image ID: version skew between nodes is a classic NCCL hang.

``distribute_image`` asks every node (in parallel, over the SSH layer) whether it already has the
image's ID; nodes that do are skipped. For the others, ``docker save`` runs ONCE here and its one
stream, compressed once if asked, is teed to every needing node's ``docker load`` at the same time.
Afterwards each node's image ID is checked against ours.

Layer-aware: the same round trip also lists the layers each needing node holds (``layers.py``).
Nodes that hold the image's bottom layers (the OS, torch, the dependencies: everything under the
project's code) are sent the save stream with those layers' tarballs left out; ``docker load``
finds them by chain ID and ends with the same image ID. Nodes are grouped by how many layers they
hold, one stream per group; a node that holds none gets today's full stream, and a node whose
partial load fails is sent the full stream once more.

With the controller's layer store (``store.py``) a group's stream comes from there instead:
the daemon pushes only the layers it has not pushed to the store before, and the node gets the
config and the gzip blobs of what it lacks. That skips ``docker save``, which on Docker 20.10
exports every layer of the image even when the stream leaves 99.9% of it out. ``dzctl build`` fills
the store, so even nodes that hold nothing get the stored blobs: no ``docker save`` and no
compression here while they wait. Where the store lacks the image (built elsewhere, or the build
could not fill it), nodes that hold nothing get the save stream and the store is filled alongside
(``plan_streams`` in ``layers.py`` decides, purely).

A node that fails mid-transfer (connection lost, ``docker load`` error, a stalled reader) is
dropped from the tee and reported failed; the others go on and finish intact. A stalled node is one
that leaves data untaken for ``stall_timeout``, or does not finish in time after its last byte
(``nodepipe.py``): its link is closed, at any stream size and in any phase, so no node can hang a
run. Every node's outcome is returned as data (``DistributeResult``); nothing is raised for a
partial failure.

Each stream goes through the system's OpenSSH client where it reaches the node, else through the
pool's paramiko connection (``transport/openssh.py``, ``ssh_client=``): it costs the controller less than
half paramiko's CPU per byte, which is what a controller feeding many nodes runs out of.

Wire codecs (``codec=``, save streams only: the store's blobs are gzip already): ``none``; ``gzip``
(``docker load`` reads gzip itself, so nodes need no extra tool); ``zstd`` (nodes need the
``zstd`` binary; checked first, else gzip). ``auto`` picks zstd when every needing node has it,
else gzip: measured when paramiko carried every stream, shrinking the stream beat the CPU the
codec costs (not measured again with the OpenSSH client).
Measured on one 2-core machine, the 1.82 GB CPU image to 3 fresh test hosts on that same machine,
medians of 2 interleaved rounds (benchmarks/distribute_first.py,
benchmarks/results/distribute-first-20261201.txt): from the filled store 147 s; the code before
layer-aware distribution (one save, zstd) 167 s; three parallel `docker save | ssh docker load`
pipes (OpenSSH) 171 s; and three `docker load -i` of a file already on the disk, with no transfer
at all, 105 s. Every method there shares two cores and one disk with the three nodes' loads, so
that floor (0.61x the pipes) bounds them all. With the OpenSSH client, 3 rounds
(distribute-first-20261201-openssh.txt): from the store 124.6 s, the same through paramiko 115.4 s,
the pipes 179.7 s, the floor 103.1 s: on one machine the three nodes' loads, not the transfer,
decide, and the two clients do not differ beyond this machine's noise. With the OpenSSH client
against the code before, 3 rounds (distribute-first-20261201-before-openssh.txt): from the store
141.4 s, the code before 173.3 s, the pipes 186.2 s, the floor 127.1 s (0.68x the pipes); the
store flow beat the code before in all 6 rounds of the 3 runs that had it (0.77x to 0.91x).
Codecs alone (benchmarks/distribute.py --codecs, store off, distribute-quiet-20261201.txt): zstd
121 s and 130 s (596 MB on the wire), gzip 140 s, none 147 s. zstd is chosen for sending a third of
the bytes, which is what a controller's one uplink to many nodes carries (not measured here: the test
hosts share no link).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, RemoteError, RuntimeFailure
from ..transport.openssh import stream_links
from .layers import (
    SkipHeldLayers,
    chain_ids,
    filter_tar,
    held_prefix,
    layer_member,
    load_manifest,
    plan_streams,
    tar_stream,
)
from .nodepipe import NodePipe
from .store import LayerStore, StoredImage, open_store

CHUNK = 1 << 20
# How long one node may refuse to take data while the others wait on it. `docker load` pauses
# between layers to write them out; minutes of silence means something is wrong with that node.
# After the last byte its load gets longer to finish (nodepipe.finish_bound).
DEFAULT_STALL_TIMEOUT = 300.0
WATCH_INTERVAL = 0.5  # how often a stalled node is looked for once the tee has sent everything
INSPECT_TIMEOUT = 60.0


@dataclass(frozen=True)
class Codec:
    name: str
    local: tuple[str, ...] | None  # compressor argv reading stdin, writing stdout; None: raw
    remote: tuple[str, ...]  # what the node runs with the stream on its stdin


def codec_for(name: str) -> Codec:
    """The argv pair for a codec name (pure but for looking up pigz)."""
    if name == "none":
        return Codec("none", None, ("docker", "load"))
    if name == "gzip":
        # pigz: the same format on every core; docker load detects gzip and decompresses itself.
        tool = "pigz" if shutil.which("pigz") else "gzip"
        return Codec("gzip", (tool, "-1", "-c"), ("docker", "load"))
    if name == "zstd":
        # Level 1 with all cores: on 2 cores it keeps ahead of what the SSH layer can carry.
        # The node's pipeline exits with docker load's status; a truncated stream fails there.
        return Codec("zstd", ("zstd", "-1", "-T0", "-q", "-c"), ("sh", "-c", "zstd -dcq | docker load"))
    raise InputError(f"unknown codec '{name}'", fix="use one of: auto, zstd, gzip, none")


@dataclass
class HostOutcome:
    host: str
    status: str  # present (skipped) | loaded | failed
    detail: str = ""
    image_id: str | None = None
    bytes_sent: int = 0
    elapsed_s: float = 0.0
    layers_held: int = 0  # bottom layers the node already had (not sent)
    layers_total: int = 0
    source: str = ""  # where its stream came from: save (docker save) | store (the layer store)
    ssh_client: str = ""  # what carried the stream: openssh | paramiko | local (transport/openssh.py)

    @property
    def ok(self) -> bool:
        return self.status in ("present", "loaded")

    def to_dict(self) -> dict:
        return {
            "host": self.host,
            "status": self.status,
            "ok": self.ok,
            "image_id": self.image_id,
            "bytes_sent": self.bytes_sent,
            "elapsed_s": round(self.elapsed_s, 2),
            "layers_held": self.layers_held,
            "layers_total": self.layers_total,
            "source": self.source,
            "ssh_client": self.ssh_client,
            "detail": self.detail,
        }


@dataclass
class DistributeResult:
    image: str
    image_id: str
    codec: str | None
    hosts: dict[str, HostOutcome]
    raw_bytes: int = 0
    wire_bytes: int = 0
    elapsed_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step, in order
    notes: list[str] = field(default_factory=list)  # what the run chose or went without, and why

    @property
    def ok(self) -> bool:
        return all(outcome.ok for outcome in self.hosts.values())

    @property
    def failed(self) -> dict[str, HostOutcome]:
        return {host: outcome for host, outcome in self.hosts.items() if not outcome.ok}

    def to_dict(self) -> dict:
        return {
            "ok": self.ok,
            "image": self.image,
            "image_id": self.image_id,
            "codec": self.codec,
            "raw_bytes": self.raw_bytes,
            "wire_bytes": self.wire_bytes,
            "elapsed_s": round(self.elapsed_s, 2),
            "phases": {name: round(seconds, 2) for name, seconds in self.phases.items()},
            "notes": self.notes,
            "hosts": [outcome.to_dict() for outcome in self.hosts.values()],
        }

    def raise_on_failure(self) -> DistributeResult:
        if self.failed:
            lines = [f"{host}: {outcome.detail}" for host, outcome in self.failed.items()]
            raise RemoteError(
                f"image {self.image} ({self.image_id[:19]}) did not reach {len(lines)} node(s):\n" + "\n".join(lines),
                fix="fix the node(s) named, then rerun: nodes that have the image are skipped",
            )
        return self


@dataclass
class Progress:
    """Live numbers for a view: bytes each node has taken, the raw bytes saved, elapsed."""

    expected_raw: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    sent: dict[str, int] = field(default_factory=dict)
    state: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


ProgressCallback = Callable[[Progress], None]


class _Source:
    """``docker save`` of the image through the SDK (less the layers ``skip`` drops), compressed by a
    local codec process if any."""

    def __init__(self, client, name: str, codec: Codec, skip: SkipHeldLayers | None = None) -> None:
        self.raw_bytes = 0
        self._saved = client.api.get_image(name, chunk_size=CHUNK)
        self._stream = self._saved if skip is None else filter_tar(self._saved, skip.keep, skip.note_json)
        self._proc = None
        self._error: BaseException | None = None
        self._pump = None
        if codec.local:
            self._proc = subprocess.Popen(list(codec.local), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self._pump = threading.Thread(target=self._feed, daemon=True)
            self._pump.start()

    def _feed(self) -> None:
        try:
            for chunk in self._stream:
                self.raw_bytes += len(chunk)
                self._proc.stdin.write(chunk)
        except BaseException as exc:  # re-raised in chunks()
            self._error = exc
        finally:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()

    def chunks(self) -> Iterable[bytes]:
        if self._proc is None:
            for chunk in self._stream:
                self.raw_bytes += len(chunk)
                yield chunk
            return
        while True:
            chunk = self._proc.stdout.read1(CHUNK)
            if not chunk:
                break
            yield chunk
        code = self._proc.wait()
        if self._error is not None:
            raise RuntimeFailure(f"docker save failed: {self._error}")
        if code != 0:
            raise RuntimeFailure(f"the local compressor {self._proc.args[0]} exited {code}")

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        with contextlib.suppress(Exception):
            self._saved.close()


class _StoreSource:
    """A ``docker load`` tarball made from the layer store: the image's config (byte for byte), the
    gzip blobs of the layers from ``held`` up, and a manifest naming every layer (held ones too)."""

    def __init__(self, store: LayerStore, stored: StoredImage, repo_tags: list[str], held: int) -> None:
        self.raw_bytes = 0
        config_name = stored.config_digest.removeprefix("sha256:") + ".json"
        manifest = load_manifest(config_name, repo_tags, len(stored.layer_digests))
        members = [(config_name, stored.config_size, store.blob(stored.config_digest))]
        for index, (digest, size) in enumerate(zip(stored.layer_digests, stored.layer_sizes, strict=True)):
            if index >= held:
                members.append((layer_member(index), size, store.blob(digest)))
        members.append(("manifest.json", len(manifest), [manifest]))
        self._stream = tar_stream(members)

    def chunks(self) -> Iterable[bytes]:
        for chunk in self._stream:
            self.raw_bytes += len(chunk)
            yield chunk

    def close(self) -> None:
        self._stream.close()


def local_image(client, image: str):
    import docker.errors

    try:
        return client.images.get(image)
    except docker.errors.ImageNotFound:
        raise InputError(
            f"image {image} is not in the local Docker daemon",
            fix="build it first (dzctl build --tag ...) or docker pull it here",
        ) from None


def _save_name(image: str, found) -> str:
    """Save by name when we can: the tarball then carries the tag, so nodes get it too."""
    if image in (found.tags or []):
        return image
    return found.tags[0] if found.tags else found.id


def _no_such_image(result) -> bool:
    return "no such image" in (result.stderr + result.stdout).lower()


def check_hosts(pool, hosts: list[str], image_id: str) -> dict[str, tuple[str, list[str]] | Exception]:
    """Per host: (its ID for ``image_id``, "" when absent; the tags it has on that ID), or the error."""
    # One round trip answers both "has it?" and "under our name?": a no-op run stays fast.
    argv = ["docker", "image", "inspect", "--format", "{{.Id}} {{json .RepoTags}}", image_id]
    found: dict[str, tuple[str, list[str]] | Exception] = {}
    for host, outcome in pool.run_all(argv, timeout=INSPECT_TIMEOUT, hosts=hosts).items():
        if isinstance(outcome, BaseException):
            found[host] = outcome
        elif outcome.ok:
            got_id, _, tags = outcome.stdout.strip().partition(" ")
            found[host] = (got_id, json.loads(tags or "[]") or [])
        elif _no_such_image(outcome):
            found[host] = ("", [])
        else:
            tail = (outcome.stderr or outcome.stdout).strip()[-500:]
            found[host] = RemoteError(f"{host}: docker image inspect failed ({outcome.exit_code}): {tail}")
    return found


def _full_name(image: str) -> str | None:
    """``repo:tag`` as docker lists it in RepoTags; None for an ID or a digest reference."""
    if image.startswith("sha256:") or "@" in image:
        return None
    return image if ":" in image.rsplit("/", 1)[-1] else f"{image}:latest"


def choose_codec(requested: str, pool, hosts: list[str]) -> Codec:
    """``auto``: zstd if this machine and every receiving node have it, else gzip (no node tool needed)."""
    if requested != "auto":
        codec = codec_for(requested)
    elif shutil.which("zstd") is None:
        codec = codec_for("gzip")
    else:
        has = pool.run_all(["sh", "-c", "command -v zstd"], timeout=INSPECT_TIMEOUT, hosts=hosts)
        every = all(not isinstance(v, BaseException) and v.ok for v in has.values())
        codec = codec_for("zstd" if every else "gzip")
    if codec.local and shutil.which(codec.local[0]) is None:
        raise InputError(
            f"codec {codec.name} needs `{codec.local[0]}` on this machine", fix="install it or --codec none"
        )
    return codec


def distribute_image(
    image: str,
    nodes: Iterable,
    pool,
    *,
    client=None,
    codec: str = "auto",
    on_progress: ProgressCallback | None = None,
    stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    layer_store: Path | str | None = "auto",
    ssh_client: str = "auto",
) -> DistributeResult:
    """Make every node hold ``image`` under the same ID; return each node's outcome.

    ``nodes``: hostfile ``Node`` objects or host names. ``pool``: an ``transport.pool.HostPool`` over them.
    ``client``: a local docker SDK client (default: from the environment). ``layer_store``: the
    controller's layer store folder (``auto``: ``store.default_root()``; None: none).
    ``ssh_client``: what carries the streams (``transport.openssh.stream_links``: auto, openssh, paramiko).
    """
    from .build import docker_client

    started = time.monotonic()
    hosts = list(dict.fromkeys(getattr(node, "host", node) for node in nodes))
    client = client or docker_client()
    found_image = local_image(client, image)
    image_id = found_image.id
    outcomes: dict[str, HostOutcome] = {}
    needing: list[str] = []
    untagged: list[str] = []
    name = _full_name(image)
    phases: dict[str, float] = {"local image": time.monotonic() - started}
    for host, state in check_hosts(pool, hosts, image_id).items():
        if isinstance(state, BaseException):
            outcomes[host] = HostOutcome(host, "failed", str(state))
        elif state[0] == image_id:
            outcomes[host] = HostOutcome(host, "present", "already had it", image_id)
            if name and name not in state[1]:
                untagged.append(host)
        else:
            needing.append(host)
    _tag_on(pool, untagged, image, image_id, outcomes)
    phases["ask the nodes"] = time.monotonic() - started - phases["local image"]
    if not needing:
        ordered = {host: outcomes[host] for host in hosts}
        return DistributeResult(image, image_id, None, ordered, elapsed_s=time.monotonic() - started, phases=phases)

    progress = Progress(expected_raw=int(found_image.attrs.get("Size") or 0))
    layers = list((found_image.attrs.get("RootFS") or {}).get("Layers") or [])
    held = held_layers(pool, needing, layers)
    phases["held"] = time.monotonic() - started - sum(phases.values())
    links, carriers, link_notes = stream_links(pool, needing, ssh_client)
    phases["probe the stream links"] = time.monotonic() - started - sum(phases.values())
    save_name = _save_name(image, found_image)
    repo_tags = [name] if name else []
    sent: dict[str, int] = {}
    wire = raw = 0
    codecs: dict[str, Codec] = {}
    notes: list[str] = list(link_notes)

    def save_codec() -> Codec:  # asked of the nodes only when a save stream is sent
        if "save" not in codecs:
            codecs["save"] = choose_codec(codec, pool, needing)
        return codecs["save"]

    def send(group: list[str], count: int, stored: StoredImage | None = None) -> None:
        nonlocal wire, raw
        step = time.monotonic()
        if stored is not None:
            chosen, source = codec_for("none"), _StoreSource(store, stored, repo_tags, count)
        else:
            skip = SkipHeldLayers(chain_ids(layers), count) if count else None
            chosen = save_codec()
            source = _Source(client, save_name, chosen, skip)
        group_sent, group_wire, group_raw = _stream_to(
            chosen, pool, group, progress, on_progress, stall_timeout, outcomes, source, links
        )
        sent.update(group_sent)
        wire, raw = wire + group_wire, raw + group_raw
        for host in group:
            outcome = outcomes[host]
            outcome.layers_held, outcome.layers_total = count, len(layers)
            outcome.source = "store" if stored is not None else "save"
            outcome.ssh_client = carriers[host]
        label = f"stream from the {'store' if stored is not None else 'save'}, {count}/{len(layers)} held"
        phases[label] = phases.get(label, 0.0) + time.monotonic() - step

    with contextlib.ExitStack() as cleanup:
        store = open_store(layer_store, client, notes, cleanup)
        plan = plan_streams(layers, [held[host] for host in needing], store.known_layers() if store else None)
        stored = None
        if plan.push_first:
            step = time.monotonic()
            try:
                stored = store.push(client, image_id, layers)
                notes.append(f"layer store: {stored.layers_pushed} of {len(layers)} layers were new to it")
            except Exception as exc:  # the store is an optimisation: docker save still works
                notes.append(f"the layer store failed ({exc}): docker save instead")
            phases["push to the layer store"] = time.monotonic() - step
        primer = _Primer(store, client, image_id, layers) if plan.prime else None
        # Nodes that hold some bottom layers first (small streams), grouped by how many; then the
        # rest, with any node whose partial load failed (today's full stream is the fallback).
        full = [host for host in needing if not held[host]]
        for count in sorted({held[host] for host in needing if held[host]}, reverse=True):
            group = [host for host in needing if held[host] == count]
            send(group, count, stored if plan.sources[count] == "store" else None)
            for host in group:
                if outcomes[host].status == "failed":
                    progress.state[host] = "retrying whole"
                    full.append(host)
        if full:
            # Nodes that hold nothing stream from the store when the plan says so (it holds the
            # whole image once pushed); retried nodes alone keep docker save as the fallback.
            send(full, 0, stored if plan.sources.get(0) == "store" else None)
        if primer is not None:
            step = time.monotonic()
            primer.wait(notes)
            phases["filling the layer store (after the streams)"] = time.monotonic() - step
    step = time.monotonic()
    loaded = [h for h in needing if outcomes[h].status == "loaded"]
    for host, state in check_hosts(pool, loaded, image_id).items():
        outcome = outcomes[host]
        if isinstance(state, BaseException):
            outcome.status, outcome.detail = "failed", f"loaded, but the check afterwards failed: {state}"
        elif state[0] != image_id:
            outcome.status = "failed"
            outcome.detail = f"after docker load the node has {state[0] or 'no image'} for {image}, not {image_id}"
        else:
            outcome.image_id = state[0]
    for host in needing:
        outcomes[host].bytes_sent = sent[host]
    phases["check afterwards"] = time.monotonic() - step
    ordered = {host: outcomes[host] for host in hosts}
    used = codecs["save"].name if "save" in codecs else "none"
    elapsed = time.monotonic() - started
    return DistributeResult(image, image_id, used, ordered, raw, wire, elapsed, phases, notes)


class _Primer:
    """Pushes the image to the layer store while the save streams run, so the next change is cheap."""

    def __init__(self, store: LayerStore, client, image_id: str, layers: list[str]) -> None:
        self.error: BaseException | None = None
        self.stored: StoredImage | None = None
        self._thread = threading.Thread(
            target=self._push, args=(store, client, image_id, layers), name="dzctl-store", daemon=True
        )
        self._thread.start()

    def _push(self, store, client, image_id, layers) -> None:
        try:
            self.stored = store.push(client, image_id, layers)
        except BaseException as exc:  # reported in the notes; the nodes are not affected
            self.error = exc

    def wait(self, notes: list[str]) -> None:
        self._thread.join()
        if self.error is not None:
            notes.append(f"the layer store was not filled ({self.error}): the next change is sent by docker save")
        elif self.stored is not None:
            notes.append(f"layer store filled: {self.stored.layers_pushed} layers pushed, for the next change")


def _tag_on(
    pool, hosts: list[str], image: str, image_id: str, outcomes: dict[str, HostOutcome], how: str = "already had it"
) -> None:
    """Nodes holding the ID under other names get this name too (cheap; no transfer)."""
    if not hosts:
        return
    for host, result in pool.run_all(["docker", "tag", image_id, image], timeout=INSPECT_TIMEOUT, hosts=hosts).items():
        if isinstance(result, BaseException) or not result.ok:
            detail = result if isinstance(result, BaseException) else result.stderr.strip()[-300:]
            outcomes[host].status, outcomes[host].detail = "failed", f"has the image but `docker tag` failed: {detail}"
        else:
            outcomes[host].detail = f"{how}; tagged {image}"


def held_layers(pool, hosts: list[str], layers: list[str]) -> dict[str, int]:
    """Per host, how many of ``layers`` (bottom first) it holds already; 0 where it cannot say."""
    if not hosts or not layers:
        return dict.fromkeys(hosts, 0)
    # Every image's layer list in one round trip; -a: intermediate images of builds on the node too.
    script = (
        'docker image ls -aq --no-trunc | sort -u | xargs -r docker image inspect --format "{{json .RootFS.Layers}}"'
    )
    held: dict[str, int] = {}
    for host, result in pool.run_all(["sh", "-c", script], timeout=INSPECT_TIMEOUT, hosts=hosts).items():
        if isinstance(result, BaseException) or not result.ok:
            held[host] = 0  # no listing: send everything, as before
            continue
        images = []
        for line in result.stdout.splitlines():
            with contextlib.suppress(ValueError):
                images.append(json.loads(line) or [])
        held[host] = held_prefix(layers, images)
    return held


def _stream_to(codec, pool, hosts, progress, on_progress, stall_timeout, outcomes, source, links):
    """Tee ``source``'s one stream to every host's load, through ``links[host]`` where there is one
    (else the pool's connection); fill ``outcomes`` for ``hosts``; return bytes per host, wire, raw.

    A node that stalls (``nodepipe``) has its link closed, whenever that happens: while the tee
    sends, after it has sent everything, or after the node took the last byte.
    """
    pipes = {host: NodePipe(host) for host in hosts}
    connections = {}
    for host in hosts:
        progress.state[host] = "sending"
        progress.sent[host] = 0

    def load(host: str):
        started = time.monotonic()
        try:
            connections[host] = conn = links.get(host) or pool.connection(host)
            result = conn.run(list(codec.remote), stdin=pipes[host])
        except Exception as exc:  # every host's failure is data
            return host, exc, time.monotonic() - started
        finally:
            pipes[host].drop()
        return host, result, time.monotonic() - started

    wire = 0
    failure: BaseException | None = None
    with ThreadPoolExecutor(max_workers=len(hosts), thread_name_prefix="dzctl-load") as executor:
        futures = {executor.submit(load, host): host for host in hosts}
        live = dict(pipes)
        try:
            for chunk in source.chunks():
                wire += len(chunk)
                for host, pipe in list(live.items()):
                    if not pipe.put(chunk, stall_timeout):
                        _drop(host, pipe, live, connections, progress)
                if not live:
                    break  # every node failed: stop saving
                _report(progress, pipes, source, wire, on_progress)
        except Exception as exc:  # docker save or the compressor failed: every node fails
            failure = exc
        finally:
            for pipe in live.values():
                if failure is None:
                    pipe.end()
                else:
                    pipe.drop()
            source.close()
        # The tee is done; a node may still sit on what is queued for it, or hang after its last byte.
        waiting = set(futures)
        while waiting:
            _, waiting = wait(waiting, timeout=WATCH_INTERVAL, return_when=FIRST_COMPLETED)
            for future in waiting:
                host = futures[future]
                if host in live and live[host].stalled(stall_timeout):
                    _drop(host, live[host], live, connections, progress)
        results = [future.result() for future in futures]
    for host, result, elapsed in results:
        outcome = outcomes[host] = HostOutcome(host, "loaded", "", None, pipes[host].sent, elapsed)
        if failure is not None:
            outcome.status, outcome.detail = "failed", f"the local image stream failed: {failure}"
        elif pipes[host].why_stalled:  # its link was closed for it: that is the cause
            outcome.status, outcome.detail = "failed", pipes[host].why_stalled
        elif isinstance(result, BaseException) or result.exit_code == -1:
            # -1 is paramiko's status for a channel closed without an exit status. Either way, ask
            # the connection whether it still works, to tell a lost link from a failed command.
            outcome.status = "failed"
            after = f"after {pipes[host].sent / 1e6:,.0f} MB"
            if not _alive(connections.get(host)):
                said = "" if isinstance(result, BaseException) else result.stderr.strip()
                outcome.detail = f"SSH connection lost mid-transfer {after}" + (
                    f": {said.splitlines()[-1]}" if said else ""
                )
            else:
                outcome.detail = (
                    f"transfer failed {after}: {result if isinstance(result, BaseException) else 'no exit status'}"
                )
        elif not result.ok:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            outcome.status = "failed"
            outcome.detail = f"`{' '.join(codec.remote)}` exited {result.exit_code}: {' / '.join(tail)}"
        else:
            outcome.detail = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "loaded"
        progress.state[host] = outcome.status
    _report(progress, pipes, source, wire, on_progress)
    return {host: pipe.sent for host, pipe in pipes.items()}, wire, source.raw_bytes


def _alive(conn) -> bool:
    """Whether the connection that carried the transfer still works.

    Asked of the link itself first: a command run on a closed one would dial again
    (see SSHConnection) and answer for a new link, not the one that failed.
    """
    if conn is None or not conn.connected:
        return False
    try:
        return conn.run(["true"], timeout=INSPECT_TIMEOUT).ok
    except Exception:  # any failure to run a no-op means the link is gone
        return False


def _drop(host, pipe, live, connections, progress) -> None:
    del live[host]
    if pipe.why_stalled:
        # It stopped taking data (or finishing) without failing: close its link so its run ends.
        progress.state[host] = "stalled"
        conn = connections.get(host)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
    pipe.drop()


def _report(progress: Progress, pipes, source, wire: int, on_progress) -> None:
    progress.raw_bytes = source.raw_bytes
    progress.wire_bytes = wire
    for host, pipe in pipes.items():
        progress.sent[host] = pipe.sent
        if pipe.dead.is_set() and progress.state.get(host) == "sending":
            progress.state[host] = "ended"
    if on_progress:
        on_progress(progress)


def distribute_via_registry(image: str, nodes: Iterable, pool, registry: str, *, client=None) -> DistributeResult:
    """The alternative where a registry exists: push once here, every node pulls, IDs checked."""
    from .build import docker_client, push_reference

    started = time.monotonic()
    hosts = list(dict.fromkeys(getattr(node, "host", node) for node in nodes))
    client = client or docker_client()
    found = local_image(client, image)
    remote, _ = push_reference(client, _save_name(image, found), registry)
    outcomes: dict[str, HostOutcome] = {}
    pulled = pool.run_all(["docker", "pull", remote], hosts=hosts)
    for host, result in pulled.items():
        if isinstance(result, BaseException):
            outcomes[host] = HostOutcome(host, "failed", str(result))
        elif not result.ok:
            outcomes[host] = HostOutcome(host, "failed", f"docker pull {remote}: {result.stderr.strip()[-300:]}")
        else:
            outcomes[host] = HostOutcome(host, "loaded", f"pulled {remote}")
    ok_hosts = [h for h, o in outcomes.items() if o.ok]
    for host, state in check_hosts(pool, ok_hosts, found.id).items():
        got = state if isinstance(state, BaseException) else state[0]
        if got != found.id:
            outcomes[host].status = "failed"
            outcomes[host].detail = f"pulled {remote} but its ID is {got or 'missing'}, not {found.id}"
        else:
            outcomes[host].image_id = got
    _tag_on(pool, [h for h, o in outcomes.items() if o.ok], image, found.id, outcomes, how=f"pulled {remote}")
    return DistributeResult(image, found.id, "registry", outcomes, elapsed_s=time.monotonic() - started)
