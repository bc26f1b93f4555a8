"""Which of an image's layers a node already holds, and a ``docker save`` stream without them.

Docker identifies a layer in a daemon by its *chain ID* (the layer's content digest chained with
every layer under it), so a node holds the first ``k`` layers of an image when one of its images
starts with the same ``k`` layer digests. ``docker load`` looks each layer up by chain ID first and
reads the layer's tarball only when it is missing: a ``docker save`` stream with the held layers'
``layer.tar`` files left out loads to the very same image ID.

The legacy ``docker save`` format (Docker ≤ 24) names each layer's folder by its v1 ID, a digest of
a fixed v1 config, the layer's chain ID and the parent's v1 ID; that config is read from the stream
itself (every layer but the top one carries it), so nothing here depends on a Docker version's
field list. A name that cannot be matched is simply sent: the worst case is today's full stream.
All of this is pure; ``distribute.py`` does the I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

BLOCK = 512
EPOCH = "1970-01-01T00:00:00Z"  # the creation time docker save gives every layer but the top one


def chain_ids(diff_ids: list[str]) -> list[str]:
    """Chain IDs of a layer stack, bottom first (the OCI image spec's ChainID)."""
    chains: list[str] = []
    for diff_id in diff_ids:
        if not chains:
            chains.append(diff_id)
        else:
            chains.append("sha256:" + hashlib.sha256(f"{chains[-1]} {diff_id}".encode()).hexdigest())
    return chains


def held_prefix(image_layers: list[str], node_images: Iterable[list[str]]) -> int:
    """How many bottom layers of ``image_layers`` the node holds: the longest prefix any of its images shares."""
    best = 0
    for layers in node_images:
        shared = 0
        for mine, theirs in zip(image_layers, layers, strict=False):
            if mine != theirs:
                break
            shared += 1
        best = max(best, shared)
    return best


def _go_json(value) -> str:
    """JSON as Go's encoding/json writes it here: compact, non-ASCII and <>& escaped."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def v1_ids(template: dict, chains: list[str]) -> list[str]:
    """The v1 folder names ``docker save`` gives the layers with these chain IDs (none of them the top).

    Docker's ``v1.CreateID``: sha256 of the JSON of {template, layer_id: chain, parent: parent's
    v1 digest}, top-level keys sorted, nested objects in their own order.
    """
    found: list[str] = []
    for chain in chains:
        config = {**template, "layer_id": chain}
        if found:
            config["parent"] = f"sha256:{found[-1]}"
        body = "{" + ",".join(f"{_go_json(key)}:{_go_json(config[key])}" for key in sorted(config)) + "}"
        found.append(hashlib.sha256(body.encode()).hexdigest())
    return found


def v1_template(layer_json: dict) -> dict | None:
    """The fixed v1 config from a non-top layer's ``json`` in a save (None for the top layer's)."""
    if layer_json.get("created") != EPOCH:
        return None
    return {key: value for key, value in layer_json.items() if key not in ("id", "parent", "os")}


@dataclass
class SkipHeldLayers:
    """Decides, member by member, which ``<v1 id>/layer.tar`` of a save a node already holds."""

    chains: list[str]  # the image's chain IDs, bottom first
    held: int  # how many bottom layers the node holds
    skipped: list[str] = field(default_factory=list)
    _names: set[str] | None = None
    _top_dir: str | None = None

    def note_json(self, folder: str, content: bytes) -> None:
        try:
            layer = json.loads(content)
        except ValueError:
            return
        template = v1_template(layer)
        if template is None:
            self._top_dir = folder
        elif self._names is None:
            below_top = self.chains[: min(self.held, len(self.chains) - 1)]
            self._names = set(v1_ids(template, below_top))

    def keep(self, name: str) -> bool:
        folder, _, leaf = name.partition("/")
        if leaf != "layer.tar":
            return True
        if folder == self._top_dir:
            # The top layer's folder name also digests the image's own config: held only if the
            # node holds every layer (an image that differs from one it has by its config alone).
            drop = self.held >= len(self.chains)
        else:
            drop = self._names is not None and folder in self._names
        if drop:
            self.skipped.append(folder)
        return not drop


def _size(header: bytes) -> int:
    field_ = header[124:136]
    if field_[0] & 0x80:  # base-256, for members over 8 GiB
        return int.from_bytes(field_[1:], "big")
    text = field_.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _name(header: bytes) -> str:
    name = header[0:100].split(b"\0", 1)[0].decode("utf-8", "replace")
    prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "replace") if header[257:262] == b"ustar" else ""
    return f"{prefix}/{name}" if prefix else name


def filter_tar(
    chunks: Iterable[bytes], keep: Callable[[str], bool], on_small: Callable[[str, bytes], None] | None = None
) -> Iterator[bytes]:
    """Pass a tar stream through, leaving out the members ``keep`` refuses (streamed, never buffered whole).

    ``on_small(name, content)`` sees every ``*/json`` member before ``keep`` is asked about later
    members. Extended headers (pax, GNU long names) travel with the member they describe.
    """
    buffer = bytearray()
    source = iter(chunks)
    done = False

    def fill(count: int) -> bool:
        nonlocal done
        while len(buffer) < count and not done:
            try:
                buffer.extend(next(source))
            except StopIteration:
                done = True
        return len(buffer) >= count

    pending = bytearray()  # pax / GNU headers waiting for their member
    while fill(BLOCK):
        header = bytes(buffer[:BLOCK])
        if header == bytes(BLOCK):  # end of archive: pass the rest as is
            yield bytes(buffer)
            buffer.clear()
            yield from source
            return
        size = _size(header)
        padded = (size + BLOCK - 1) // BLOCK * BLOCK
        kind = header[156:157]
        if kind in (b"x", b"g", b"L", b"K"):
            if not fill(BLOCK + padded):
                break
            pending += buffer[: BLOCK + padded]
            del buffer[: BLOCK + padded]
            continue
        name = _name(header)
        if on_small and name.endswith("/json") and size < (1 << 20):
            fill(BLOCK + padded)
            on_small(name.rpartition("/")[0], bytes(buffer[BLOCK : BLOCK + size]))
        wanted = keep(name)
        if wanted:
            yield bytes(pending) + header
        pending.clear()
        del buffer[:BLOCK]
        remaining = padded
        while remaining:
            if not buffer and not fill(1):
                raise ValueError(f"tar stream ended inside {name}")
            take = min(remaining, len(buffer))
            if wanted:
                yield bytes(buffer[:take])
            del buffer[:take]
            remaining -= take
    if buffer or pending:
        raise ValueError("tar stream ended inside a header")


# -- a `docker load` tarball assembled from stored layer blobs ----------------------------------------


def tar_header(name: str, size: int) -> bytes:
    """One ustar header for a regular file (names here are short: ``<n>/layer.tar``, ``<hex>.json``)."""
    import tarfile

    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def tar_stream(members: Iterable[tuple[str, int, Iterable[bytes]]]) -> Iterator[bytes]:
    """A tar archive of ``(name, size, chunks)`` members, streamed; a member whose chunks do not add
    up to ``size`` is an error (the archive would be corrupt)."""
    for name, size, chunks in members:
        yield tar_header(name, size)
        written = 0
        for chunk in chunks:
            written += len(chunk)
            yield chunk
        if written != size:
            raise ValueError(f"{name}: {written} bytes read, {size} expected")
        if size % BLOCK:
            yield bytes(BLOCK - size % BLOCK)
    yield bytes(2 * BLOCK)  # end of archive


def layer_member(index: int) -> str:
    return f"{index}/layer.tar"


def load_manifest(config_name: str, repo_tags: list[str], layer_count: int) -> bytes:
    """``manifest.json`` of a ``docker load`` tarball whose layers are ``layer_member(i)``, bottom first.

    ``docker load`` looks every layer up by chain ID before it opens the layer's file, so the files
    of layers a node holds may be left out; a layer file may be gzip-compressed (load inflates it).
    """
    entry = {"Config": config_name, "RepoTags": repo_tags, "Layers": [layer_member(i) for i in range(layer_count)]}
    return json.dumps([entry]).encode()


@dataclass(frozen=True)
class StreamPlan:
    """Where each group of nodes (by how many bottom layers they hold) gets its stream from."""

    sources: dict[int, str]  # held count -> "store" (blobs the store holds) | "save" (docker save)
    push_first: bool  # push to the store before streaming (some group streams from it)
    prime: bool  # push to the store while the save streams run (so the next change is cheap)


def plan_streams(layers: list[str], held_counts: Iterable[int], store_layers: set[str] | None) -> StreamPlan:
    """Choose the source of every group's stream (pure).

    A group that holds ``k`` bottom layers streams from the store when the store already holds
    those ``k`` (the push then exports only layers that group lacks anyway). A group that holds
    nothing streams from the store when the store will hold the whole image once pushed: it held
    it already (``dzctl build`` filled it), or another group's push adds the rest. Otherwise the
    push would gzip every layer before a byte is sent, and ``docker save`` it is. A store that
    lacks some of the image's layers is filled while the save streams run (``prime``).
    """
    counts = sorted(set(held_counts))
    if store_layers is None:
        return StreamPlan(dict.fromkeys(counts, "save"), push_first=False, prime=False)

    def holds(prefix: list[str]) -> bool:
        return all(layer in store_layers for layer in prefix)

    sources = {count: "store" if count and holds(layers[:count]) else "save" for count in counts}
    push_first = "store" in sources.values()
    if 0 in sources and (push_first or holds(layers)):
        sources[0] = "store"
        push_first = True
    prime = not push_first and not holds(layers)
    return StreamPlan(sources, push_first, prime)
