"""The tokenized-data cache on a node: its key, its files, their check, who builds, who waits.

Layout under ``data.cache_dir`` (default ``<output_dir>/data-cache``)::

    fingerprints.json        path -> [size, mtime_ns, content hash]: the fast path of the key
    <key>/manifest.json      written last: every file's dtype, length, bytes and xxh3 hash
    <key>/*.bin              token ids (trained flag in the top bit), offsets, packed rows
    <key>/last_used          touched at every use (the prune rule reads it)
    <key>.lock               the builder holding the key (any node, on shared storage)
    runs/<launch>.json       this launch's builder telling the node's other ranks how it goes

**Key**: a SHA-256 of everything that changes the content: each source's files' bytes
(xxh3-128 of each; size and mtime find a known hash without reading the file again), its
format, columns, weight and max_rows; ``on_error``; the tokenizer's whole serialization and
chat template; ``max_seq_len``, packing and its window, and ``train.seed``. A relaunch or
resume with the same inputs finds the same key and maps the cache; any change builds anew.

**Check**: before a cache is used in a launch, its builder compares every file's size and
xxh3 hash with the manifest; a truncated or corrupted file (or a missing manifest: a build
that died) sends it to be rebuilt, never used.

**Prune rule**: after each build or use, the three most recently used caches in the folder
stay (the current one among them); an older one is removed once unused for an hour, so a
job that started minutes ago on it is not pulled from under. Builds that died leave
``building-*`` folders, removed once their lock is gone and they are a day old.

**Who builds**: local rank 0 of each node, the one process per node (see ``prepare.py``).
On storage shared between nodes, ``<key>.lock`` (made with ``O_EXCL``) lets one node build
while the others wait for its manifest. A lock whose holder stopped touching it for
``LOCK_STALE_S`` is broken and taken over.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

# Bump when the files' layout or the encoding changes: old caches then miss the key.
# 2: labels aligned by tokens, one example per re-rendered assistant turn (train/data/chat.py).
CACHE_LAYOUT = 2
MANIFEST = "manifest.json"
LAST_USED = "last_used"
KEEP = 3
UNUSED_BEFORE_PRUNE_S = 3600
LOCK_STALE_S = 120.0
BLOCK = 1 << 24


def file_hash(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with path.open("rb") as handle:
        while block := handle.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


class Fingerprints:
    """Content hashes of source files, reused while a file's size and mtime are unchanged."""

    def __init__(self, cache_dir: Path) -> None:
        self.path = cache_dir / "fingerprints.json"
        try:
            self.known: dict[str, list[Any]] = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.known = {}
        self.changed = False

    def of(self, path: Path) -> str:
        stat = path.stat()
        key = str(path.resolve())
        entry = self.known.get(key)
        if entry and entry[0] == stat.st_size and entry[1] == stat.st_mtime_ns:
            return entry[2]
        digest = file_hash(path)
        self.known[key] = [stat.st_size, stat.st_mtime_ns, digest]
        self.changed = True
        return digest

    def save(self) -> None:
        if self.changed:
            write_json(self.path, self.known)


def write_json(path: Path, value: Any) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def tokenizer_identity(tokenizer: Any) -> dict[str, str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # A fast tokenizer's whole serialization; a slow one's vocabulary stands for it.
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return {
        "tokenizer": hashlib.sha256(body.encode("utf-8")).hexdigest(),
        "chat_template": str(getattr(tokenizer, "chat_template", None) or ""),
        "eos": str(getattr(tokenizer, "eos_token", None) or ""),
    }


def cache_key(material: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode("utf-8")).hexdigest()[:32]


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    reason: str = ""


def write_manifest(folder: Path, files: dict[str, dict[str, Any]], info: dict[str, Any]) -> None:
    entries = {}
    for name, meta in files.items():
        path = folder / name
        entries[name] = {**meta, "bytes": path.stat().st_size, "xxh3": file_hash(path)}
    write_json(folder / MANIFEST, {"layout": CACHE_LAYOUT, "files": entries, "info": info})


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def check(folder: Path) -> CheckResult:
    """Every file of the cache has the size and hash its manifest says."""
    manifest = read_manifest(folder)
    if manifest is None:
        return CheckResult(False, "no manifest (the build did not finish)")
    if manifest.get("layout") != CACHE_LAYOUT:
        return CheckResult(False, f"layout {manifest.get('layout')}, this trainer writes {CACHE_LAYOUT}")
    for name, meta in manifest["files"].items():
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            return CheckResult(False, f"{name} is missing")
        if size != meta["bytes"]:
            return CheckResult(False, f"{name} has {size} bytes, the manifest says {meta['bytes']} (truncated?)")
        if file_hash(path) != meta["xxh3"]:
            return CheckResult(False, f"{name} does not match its hash (corrupted)")
    return CheckResult(True)


def touch_used(folder: Path) -> None:
    (folder / LAST_USED).write_text(str(time.time()), encoding="utf-8")


def _last_used(folder: Path) -> float:
    try:
        return (folder / LAST_USED).stat().st_mtime
    except OSError:
        return (folder / MANIFEST).stat().st_mtime if (folder / MANIFEST).exists() else 0.0


def prune(cache_dir: Path, current: str, now: float | None = None) -> list[str]:
    """Apply the prune rule (module docstring); return the keys removed."""
    now = time.time() if now is None else now
    caches = [p for p in cache_dir.iterdir() if p.is_dir() and (p / MANIFEST).exists()]
    caches.sort(key=_last_used, reverse=True)
    kept = [p for p in caches if p.name == current] + [p for p in caches if p.name != current]
    removed = []
    for folder in kept[KEEP:]:
        if now - _last_used(folder) > UNUSED_BEFORE_PRUNE_S and not (cache_dir / f"{folder.name}.lock").exists():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    for folder in cache_dir.glob("building-*"):
        key = folder.name.split("-")[1]
        if not (cache_dir / f"{key}.lock").exists() and now - folder.stat().st_mtime > 86400:
            shutil.rmtree(folder, ignore_errors=True)
    for note in (cache_dir / "runs").glob("*.json") if (cache_dir / "runs").is_dir() else ():
        if now - note.stat().st_mtime > 86400:
            note.unlink(missing_ok=True)
    return removed


class KeyLock:
    """``<key>.lock``: one builder per key on this storage, across nodes."""

    def __init__(self, cache_dir: Path, key: str) -> None:
        self.path = cache_dir / f"{key}.lock"
        self.held = False

    def try_take(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if self.stale():
                # The holder died (its node was killed mid-build): break the lock, once.
                self.path.unlink(missing_ok=True)
                return self.try_take()
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}))
        self.held = True
        return True

    def stale(self) -> bool:
        try:
            return time.time() - self.path.stat().st_mtime > LOCK_STALE_S
        except FileNotFoundError:
            return False

    def holder(self) -> str:
        try:
            info = json.loads(self.path.read_text(encoding="utf-8"))
            return f"{info['host']} pid {info['pid']}"
        except (OSError, ValueError, KeyError):
            return "another process"

    def refresh(self) -> None:
        if self.held:
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def launch_token(env: dict[str, str] | None = None) -> str:
    """One name for this launch on this node, the same in all its local ranks.

    The ranks of one launch share their parent (torchrun's agent or the deepspeed launcher)
    and its environment; a restart by the agent counts up TORCHELASTIC_RESTART_COUNT.
    """
    env = dict(os.environ) if env is None else env
    parts = [
        socket.gethostname(),
        str(os.getppid()),
        env.get("DZCTL_JOB_ID", ""),
        env.get("TORCHELASTIC_RUN_ID", ""),
        env.get("TORCHELASTIC_RESTART_COUNT", ""),
        env.get("MASTER_PORT", ""),
    ]
    return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()[:24]


class RunNote:
    """``runs/<launch>.json``: what the node's builder tells its other ranks (state, key, progress)."""

    def __init__(self, cache_dir: Path, token: str) -> None:
        self.path = cache_dir / "runs" / f"{token}.json"

    def write(self, state: str, **values: Any) -> None:
        write_json(self.path, {"state": state, "time": time.time(), **values})

    def read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
