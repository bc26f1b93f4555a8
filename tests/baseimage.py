"""A local Debian base image for the image tests: no registry can be reached from these machines.

``debootstrap --variant=minbase`` of Debian bookworm, from the Debian mirror apt is configured with
here, into a folder, packed as a tarball and ``docker import``-ed. Debian bookworm's python3 is
3.11, the version the local torch wheel is
built for. The tarball is cached under ``$DZCTL_TEST_CACHE`` (default ``/var/cache/dzctl-test``),
keyed by everything that goes into it, so a rerun (CI runs on a fresh clone of the same machine)
skips the ~1 minute debootstrap; the first run builds it from nothing.

Run as a script to pre-build the cache: ``python -m tests.baseimage``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from orchestrator.image.sources import apt_mirror_for, read_apt_sources

SUITE = "bookworm"
# What the Dockerfile's CPU flavour needs from the system: an interpreter with venv and headers,
# a C++ compiler (DeepSpeed's CPU accelerator compiles its shared-memory op) and CA certificates.
PACKAGES = ("python3", "python3-venv", "python3-dev", "g++", "ca-certificates")
CACHE_DIR = Path(os.environ.get("DZCTL_TEST_CACHE", "/var/cache/dzctl-test"))
REPOSITORY = "dzctl-test/debian-base"


def debian_mirror() -> str:
    """The Debian mirror apt is configured with here (``$DZCTL_TEST_DEBIAN_MIRROR`` overrides it).

    No mirror is named in the repository: a machine behind a mirror or a proxy has apt set up for it.
    """
    explicit = os.environ.get("DZCTL_TEST_DEBIAN_MIRROR")
    if explicit:
        return explicit
    mirror = apt_mirror_for(SUITE, read_apt_sources())
    if mirror is None:
        raise RuntimeError(
            f"apt on this machine has no source for Debian {SUITE} (/etc/apt/sources.list*): "
            "set DZCTL_TEST_DEBIAN_MIRROR to a Debian mirror URL"
        )
    return mirror


def base_key() -> str:
    """Hash of every input of the rootfs: a change of any of them makes a new tarball."""
    inputs = {"suite": SUITE, "variant": "minbase", "packages": sorted(PACKAGES), "mirror": debian_mirror(), "v": 1}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]


def base_tag() -> str:
    return f"{REPOSITORY}:{base_key()}"


def base_tarball() -> Path:
    """Path of the cached rootfs tarball, built first if missing (serialised by a lock file)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tarball = CACHE_DIR / f"debian-{SUITE}-{base_key()}.tar"
    with open(CACHE_DIR / f"{tarball.name}.lock", "w") as lock:
        # Several test sessions share the machine: only one debootstraps, the others wait for it.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not tarball.exists():
            _debootstrap_to(tarball)
    return tarball


def _debootstrap_to(tarball: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE_DIR))
    try:
        argv = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            SUITE,
            str(root),
            debian_mirror(),
        ]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
            raise RuntimeError(f"debootstrap failed ({done.returncode}):\n{tail}")
        # Package archives and lists are dead weight in an image (~100 MB); apt-get update restores lists.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (root / junk).glob("*"):
                if entry.is_file():
                    entry.unlink()
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."], check=True)
        partial.rename(tarball)  # atomic: a reader never sees half a tarball
    finally:
        _unmount_under(root)  # a failed debootstrap can leave /proc or /sys mounted in the rootfs
        shutil.rmtree(root, ignore_errors=True)


def _unmount_under(root: Path) -> None:
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    targets = [line.split()[1] for line in mounts if line.split()[1].startswith(f"{root}/")]
    for target in sorted(targets, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)


def ensure_base_image(client) -> str:
    """Import the base into the daemon behind ``client`` (a ``docker.DockerClient``) unless there; return its tag."""
    import docker.errors

    tag = base_tag()
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    repository, _, version = tag.partition(":")
    client.api.import_image_from_file(str(base_tarball()), repository=repository, tag=version)
    client.images.get(tag)  # raises if the import did not produce it
    return tag


if __name__ == "__main__":
    print(base_tarball())


def torch_wheelhouse(version: str = "2.13.0") -> Path:
    """A folder holding the CPU torch wheel for the image tests' ``--wheelhouse``.

    ``$DZCTL_TEST_WHEELHOUSE`` if set; otherwise ``pip download`` into the cache, which on these
    machines finds the CPU wheel that pip's config points at (``pip config list``: find-links).
    PyPI's own torch wheel for Linux is a multi-GB CUDA build: refused here, not silently used.
    """
    explicit = os.environ.get("DZCTL_TEST_WHEELHOUSE")
    if explicit:
        return Path(explicit)
    folder = CACHE_DIR / f"wheelhouse-torch-{version}"
    with open(CACHE_DIR / "wheelhouse.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not list(folder.glob("torch-*.whl")):
            folder.mkdir(parents=True, exist_ok=True)
            argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder)]
            subprocess.run([*argv, f"torch=={version}"], check=True, capture_output=True)
    wheels = list(folder.glob("torch-*.whl"))
    if not any("+cpu" in wheel.name for wheel in wheels):
        raise RuntimeError(
            f"{folder} holds {[w.name for w in wheels]}, not a CPU torch wheel: "
            "set DZCTL_TEST_WHEELHOUSE to a folder with torch-<version>+cpu-*.whl"
        )
    return folder
