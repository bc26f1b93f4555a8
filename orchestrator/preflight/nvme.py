"""The ``nvme`` check: is ``zero.nvme_path`` usable for ZeRO-Infinity on this node, and how fast is it?

Runs only when the job names ``zero.nvme_path``. On the node (not in a container:
the path is the node's disk, mounted into the container at the same place):

- the folder exists, is a folder, and a file can be created in it;
- its free space, against what the planner says offload to NVMe needs per node;
- a short direct-I/O bandwidth test (``O_DIRECT``, as DeepSpeed's async I/O reads and
  writes): ``PROBE_MIB`` MiB written then read back in 1 MiB blocks, bounded by
  ``PROBE_MAX_S``; the file is removed afterwards whatever happens.

And where the job runs (the image, or the node's Python for ``runtime: process``):
DeepSpeed's ``AsyncIOBuilder().is_compatible()``, which needs libaio; without it
the run would die at its first step, so here it is a failure with its fix.
The readings feed the planner (free space, read and write bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..transport.connection import Connection
from . import parsers as p
from .model import Check, fail, ok, warn

PROBE_MIB = 256  # a few hundred MiB: past the disk's own cache, done in well under a second on NVMe
PROBE_MAX_S = 20.0  # a slow disk stops the test early; bandwidth is measured over what was done
PROBE_TIMEOUT_S = 60.0
# Slower than this and NVMe offload is unusable in practice: an 8B model's optimizer
# states (~100 GB) would take over 10 minutes a step each way.
SLOW_BYTES_PER_S = 100 * 2**20
MARK = "DZCTL_NVME "
LIBAIO_FIX = (
    "install libaio (Debian/Ubuntu: apt-get install libaio-dev; RHEL: dnf install libaio-devel) where the "
    "job runs (the image: dzctl build; runtime process: the node), so DeepSpeed can build its async_io op"
)

# Python on the node. argv: path, MiB, seconds. One JSON line; never a traceback.
PROBE = r"""
import json, mmap, os, sys, time
path, mib, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
out = {"path": path}
def done():
    print("DZCTL_NVME " + json.dumps(out)); sys.exit(0)
if not os.path.exists(path):
    out["problem"] = "missing"; done()
if not os.path.isdir(path):
    out["problem"] = "not a folder"; done()
st = os.statvfs(path)
out["free_bytes"] = st.f_bavail * st.f_frsize
mib = max(1, min(mib, out["free_bytes"] // 4 >> 20))  # never fill the disk being measured
name = os.path.join(path, ".dzctl-nvme-probe-%d" % os.getpid())
block = 1 << 20
buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
buf.write(os.urandom(block))
try:
    try:
        fd = os.open(name, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    except OSError as exc:
        out["problem"] = "not writable"; out["error"] = exc.strerror; done()
    os.close(fd)
    try:
        fd = os.open(name, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
    except OSError as exc:
        out["problem"] = "no direct I/O"; out["error"] = exc.strerror; done()
    try:
        start, n = time.monotonic(), 0
        while n < mib and time.monotonic() - start < limit:
            os.write(fd, buf); n += 1
        os.fsync(fd)
        out["write_bytes"], out["write_s"] = n * block, time.monotonic() - start
    except OSError as exc:
        out["problem"] = "no direct I/O" if exc.errno == 22 else "write failed"; out["error"] = exc.strerror; done()
    finally:
        os.close(fd)
    fd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        start, got = time.monotonic(), 0
        while got < n and time.monotonic() - start < limit:
            got += os.readv(fd, [buf]) // block
        out["read_bytes"], out["read_s"] = got * block, time.monotonic() - start
    finally:
        os.close(fd)
finally:
    try:
        os.unlink(name)
    except OSError:
        pass
done()
"""


@dataclass(frozen=True)
class NvmeProbe:
    """One node's answer; ``problem`` is None when the path is usable."""

    path: str
    problem: str | None
    free_bytes: int = 0
    read_bytes_per_s: float = 0.0
    write_bytes_per_s: float = 0.0
    error: str = ""


def parse_probe(text: str) -> NvmeProbe:
    data = p.parse_json_line(text, MARK)

    def rate(kind: str) -> float:
        seconds = float(data.get(f"{kind}_s") or 0.0)
        return data.get(f"{kind}_bytes", 0) / seconds if seconds > 0 else 0.0

    return NvmeProbe(
        path=str(data["path"]),
        problem=data.get("problem"),
        free_bytes=int(data.get("free_bytes", 0)),
        read_bytes_per_s=rate("read"),
        write_bytes_per_s=rate("write"),
        error=str(data.get("error", "")),
    )


def probe(conn: Connection, python: str, path: str) -> NvmeProbe | Check:
    """Run the probe on the node; a Check (failed) when it could not run at all."""
    result = conn.run([python, "-c", PROBE, path, str(PROBE_MIB), str(PROBE_MAX_S)], timeout=PROBE_TIMEOUT_S)
    try:
        return parse_probe(result.stdout)
    except p.ParseError:
        tail = (result.stderr or result.stdout).strip()[-300:]
        return fail("nvme", f"the NVMe probe did not run with {python}: {tail}", "check that python3 runs on the node")


def _mib_s(value: float) -> str:
    return f"{value / 2**20:,.0f} MiB/s"


def nvme_check(found: NvmeProbe, need_bytes: int | None) -> Check:
    """Judge one node's probe: usable or not, and why; the bandwidths reported either way."""
    path = found.path
    if found.problem == "missing":
        return fail("nvme", f"zero.nvme_path {path} does not exist", f"create it on this node: mkdir -p {path}")
    if found.problem == "not a folder":
        return fail("nvme", f"zero.nvme_path {path} is not a folder", "point zero.nvme_path at a folder")
    if found.problem == "not writable":
        return fail(
            "nvme",
            f"zero.nvme_path {path} is not writable ({found.error})",
            f"let the launching user write there (chown/chmod {path}) or choose another folder",
        )
    if found.problem == "no direct I/O":
        return fail(
            "nvme",
            f"zero.nvme_path {path} does not take direct I/O (O_DIRECT: {found.error}); tmpfs and some network "
            "filesystems do not",
            "point zero.nvme_path at a folder on a local disk (ext4/xfs on NVMe)",
        )
    if found.problem is not None:
        return fail("nvme", f"zero.nvme_path {path}: {found.problem} ({found.error})", "check the disk")
    detail = (
        f"{path}: {p.gib(found.free_bytes)} free; direct I/O write {_mib_s(found.write_bytes_per_s)}, "
        f"read {_mib_s(found.read_bytes_per_s)}"
    )
    if need_bytes is not None and found.free_bytes < need_bytes:
        return fail(
            "nvme",
            f"{detail}; offload to NVMe needs {p.gib(need_bytes)} per node",
            "free space on that disk, choose a larger one, or use more nodes (each holds less)",
        )
    if min(found.read_bytes_per_s, found.write_bytes_per_s) < SLOW_BYTES_PER_S:
        return warn(
            "nvme",
            f"{detail}: slow for ZeRO-Infinity (each step reads and writes the optimizer states)",
            "use a local NVMe disk",
        )
    return ok("nvme", detail)


def async_io_check(env: dict, where: str) -> Check:
    """DeepSpeed's async_io op (libaio) where the job runs, from the Python probe's answer."""
    if "async_io" not in env:
        detail = env.get("async_io_error") or "the Python probe did not answer about DeepSpeed's async_io op"
        return fail("nvme-aio", f"{where}: {detail}", LIBAIO_FIX)
    if env["async_io"] is not True:
        return fail("nvme-aio", f"{where}: DeepSpeed's async_io op cannot be built (libaio missing)", LIBAIO_FIX)
    return ok("nvme-aio", f"{where}: DeepSpeed async_io (libaio) available")


def check_nvme(conn: Connection, python: str, path: str, need_bytes: int | None, env: dict, where: str):
    """Both NVMe checks of one node; returns (checks, the usable probe or None)."""
    found = probe(conn, python, path)
    if isinstance(found, Check):
        return [found, async_io_check(env, where)], None
    check = nvme_check(found, need_bytes)
    return [check, async_io_check(env, where)], (found if check.status != "fail" else None)


def reading_dict(found: NvmeProbe) -> dict:
    return {
        "free_bytes": found.free_bytes,
        "read_bytes_per_s": round(found.read_bytes_per_s, 1),
        "write_bytes_per_s": round(found.write_bytes_per_s, 1),
    }
