"""The tokenized-data cache on a node: its key, its files, their check, who builds, who waits.

Layout under ``data.cache_dir`` (default ``<output_dir>/data-cache``)::

    fingerprints.json        path -> [size, mtime_ns, ctime_ns, inode, hashed at, content hash]: the key's fast path
    <key>/manifest.json      written last: every file's dtype, length, bytes and xxh3 hash
    <key>/*.bin              token ids (trained flag in the top bit), offsets, packed rows
    <key>/last_used          touched at every use (the prune rule reads it)
    <key>.lock               the builder holding the key (any node, on shared storage)
    runs/<launch>.json       this launch's builder telling the node's other ranks how it goes

**Key**: a SHA-256 of everything that changes the content: each source's files' bytes
(xxh3-128 of each; an unchanged stat finds a known hash without reading the file again:
``Fingerprints``), its
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
``LOCK_STALE_S`` (``DZCTL_DATA_LOCK_STALE_S``) is broken and taken over; a builder touches
its lock from a heartbeat thread (``prepare.py``) however long a silent phase lasts, and a
release removes the lock only while it is still its own (its token inside).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

# Bump when the files' layout or the encoding changes: old caches then miss the key.
# 2: labels aligned by tokens, one example per re-rendered assistant turn (train/data/chat.py).
# 3: data.eval_split holds out rows, not examples (holdout.py); turns cut away by max_seq_len counted.
CACHE_LAYOUT = 3
MANIFEST = "manifest.json"
LAST_USED = "last_used"
KEEP = 3
UNUSED_BEFORE_PRUNE_S = 3600
LOCK_STALE_S = 120.0
BLOCK = 1 << 24
# A stat taken within this long of the file's last change may not show a change made in the same
# tick of a coarse clock (FAT's 2 s, some NFS servers' 1 s): such an entry is hashed again ("racy
# git": git's index re-reads a file whose mtime is not older than the index itself, for the same reason).
RACY_S = 3.0


def lock_stale_s() -> float:
    """``DZCTL_DATA_LOCK_STALE_S``: how long a lock nobody touched stays its holder's (the tests lower it)."""
    return float(os.environ.get("DZCTL_DATA_LOCK_STALE_S", LOCK_STALE_S))


def file_hash(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with path.open("rb") as handle:
        while block := handle.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


class Fingerprints:
    """Content hashes of source files, reused while a file's stat is unchanged.

    Size and mtime alone are not enough: ``cp -p``, ``rsync -t`` and ``tar x`` rewrite a file and
    keep both. The key adds the inode and the ctime, which no tool can set back (the kernel stamps
    it at every write, rename or chmod; only changing the clock could), so any rewrite misses it and
    the file is hashed again. A false miss (a chmod) costs one hash; a false hit cannot happen,
    except within one clock tick of a change, which ``RACY_S`` covers. Why not hash at every launch:
    it reads every byte again, 0.19 s per GiB from the page cache here, but at the storage's speed
    when cold: ~14 GB of JSONL over 1 Gbit/s NFS is ~2 minutes on every node, at every launch.
    """

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
        seen = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
        # An older trainer's 3-item entry [size, mtime, hash] never matches: that file is hashed again.
        if entry and len(entry) == 6 and entry[:4] == seen and entry[4] - stat.st_ctime_ns / 1e9 > RACY_S:
            return entry[5]
        hashed_at = time.time()
        digest = file_hash(path)
        self.known[key] = [*seen, hashed_at, digest]
        self.changed = True
        return digest

    def save(self) -> None:
        if self.changed:
            write_json(self.path, self.known)


def unique_suffix() -> str:
    """A name no other writer uses: a pid alone repeats across nodes' containers (each starts its own count)."""
    return f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(6)}"


def write_json(path: Path, value: Any) -> None:
    """Atomically: a reader sees the old file or the new one, never half of one (any number of writers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{unique_suffix()}.tmp")
    try:
        tmp.write_text(json.dumps(value, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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


def _mtime(path: Path) -> float | None:
    """The file's mtime, or None when it is gone: another node's prune may remove it at any moment."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def _last_used(folder: Path) -> float:
    for name in (LAST_USED, MANIFEST):
        found = _mtime(folder / name)
        if found is not None:
            return found
    return 0.0


def prune(cache_dir: Path, current: str, now: float | None = None) -> list[str]:
    """Apply the prune rule (module docstring); return the keys removed.

    Other nodes may prune the same folder at the same time: anything listed here can be gone by
    the time it is looked at, and a name gone is skipped."""
    now = time.time() if now is None else now
    caches = [p for p in cache_dir.iterdir() if p.is_dir() and (p / MANIFEST).exists()]
    used = {p: _last_used(p) for p in caches}
    caches.sort(key=used.__getitem__, reverse=True)
    kept = [p for p in caches if p.name == current] + [p for p in caches if p.name != current]
    removed = []
    for folder in kept[KEEP:]:
        if now - used[folder] > UNUSED_BEFORE_PRUNE_S and not (cache_dir / f"{folder.name}.lock").exists():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    for folder in cache_dir.glob("building-*"):
        key = folder.name.split("-")[1]
        changed = _mtime(folder)
        if changed is not None and not (cache_dir / f"{key}.lock").exists() and now - changed > 86400:
            shutil.rmtree(folder, ignore_errors=True)
    for note in (cache_dir / "runs").glob("*.json") if (cache_dir / "runs").is_dir() else ():
        changed = _mtime(note)
        if changed is not None and now - changed > 86400:
            note.unlink(missing_ok=True)
    return removed


class KeyLock:
    """``<key>.lock``: one builder per key on this storage, across nodes.

    The file holds its taker's token (host, pid, random): ``refresh`` and ``release`` act only on a
    lock that still holds this one's token, so a builder whose lock was broken (it went silent past
    the bound) never keeps alive nor removes the next holder's."""

    def __init__(self, cache_dir: Path, key: str) -> None:
        self.path = cache_dir / f"{key}.lock"
        self.token = unique_suffix()
        self.held = False

    def try_take(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if self._break_if_stale():
                return self.try_take()
            return False
        with os.fdopen(fd, "w") as handle:
            info = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "token": self.token}
            handle.write(json.dumps(info))
        self.held = True
        return True

    def _read(self, path: Path | None = None) -> dict[str, Any] | None:
        try:
            return json.loads((path or self.path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def _break_if_stale(self) -> bool:
        """Break a lock whose holder died (its node was killed mid-build); True when it is gone.

        Two nodes may judge one lock stale at once: each renames it to a name of its own (one rename
        wins), then checks that what it moved is the lock it judged, not one the other node took
        meanwhile in its place; such a fresh lock is put back."""
        seen = self._read()
        if not self.stale():
            return False
        moved = self.path.with_name(f"{self.path.name}.broken.{unique_suffix()}")
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return True  # another node broke it first: try to take it
        if self._read(moved) != seen:
            with contextlib.suppress(OSError):
                os.link(moved, self.path)  # back where it was (unless yet another lock is there)
            moved.unlink(missing_ok=True)
            return False
        moved.unlink(missing_ok=True)
        return True

    def stale(self) -> bool:
        try:
            return time.time() - self.path.stat().st_mtime > lock_stale_s()
        except FileNotFoundError:
            return False

    def holder(self) -> str:
        info = self._read() or {}
        return f"{info['host']} pid {info['pid']}" if "host" in info and "pid" in info else "another process"

    def mine(self) -> bool:
        info = self._read()
        return info is not None and info.get("token") == self.token

    def refresh(self) -> None:
        if self.held and self.mine():
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        if self.held:
            if self.mine():
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
