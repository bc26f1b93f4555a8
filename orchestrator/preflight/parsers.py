"""Pure parsers of what the nodes' tools print. No I/O here: tested against recorded outputs.

nvidia-smi formats are tested against real outputs from two H200s (tests/fixtures/h200x2).
``docker info`` and ``nvidia-ctk`` had no GPU machine to be recorded on: their parsers
follow the documented formats (``docker info --format '{{json .}}'``, the Docker Engine
API's SystemInfo object; ``nvidia-ctk --version``'s "NVIDIA Container Toolkit CLI
version X" first line) and real ``docker info`` output from the test hosts' dockerd.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass

# The --query-gpu fields preflight asks for, in this order (the fixture's command).
GPU_QUERY_FIELDS = (
    "index",
    "name",
    "uuid",
    "driver_version",
    "memory.total",
    "memory.used",
    "utilization.gpu",
    "pci.bus_id",
    "compute_cap",
    "ecc.errors.uncorrected.volatile.total",
)
GPU_QUERY_ARGV = (
    "nvidia-smi",
    f"--query-gpu={','.join(GPU_QUERY_FIELDS)}",
    "--format=csv,noheader,nounits",
)


class ParseError(ValueError):
    """Output did not have the expected shape; the message quotes what was seen."""


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str
    driver_version: str
    memory_total_mib: int
    memory_used_mib: int
    utilization_pct: int | None
    pci_bus_id: str
    compute_cap: str
    ecc_uncorrected: int | None  # None: ECC off or not reported ("[N/A]")

    @property
    def compute_capability(self) -> float | None:
        """``compute_cap`` as a number (``"9.0"`` → 9.0); ``None`` where nvidia-smi gives none.

        A float orders every capability NVIDIA has shipped (minor versions are one digit).
        """
        try:
            return float(self.compute_cap)
        except ValueError:
            return None


def _int_or_none(text: str) -> int | None:
    text = text.strip()
    return None if not text or text.startswith("[") or text in ("N/A", "Not Supported") else int(float(text))


def parse_gpu_query(text: str) -> list[Gpu]:
    """Rows of ``nvidia-smi --query-gpu=<GPU_QUERY_FIELDS> --format=csv,noheader,nounits``."""
    gpus = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(GPU_QUERY_FIELDS):
            raise ParseError(f"line {number}: expected {len(GPU_QUERY_FIELDS)} fields, got {len(cells)}: {line!r}")
        try:
            gpus.append(
                Gpu(
                    index=int(cells[0]),
                    name=cells[1],
                    uuid=cells[2],
                    driver_version=cells[3],
                    memory_total_mib=int(float(cells[4])),
                    memory_used_mib=int(float(cells[5])),
                    utilization_pct=_int_or_none(cells[6]),
                    pci_bus_id=cells[7],
                    compute_cap=cells[8],
                    ecc_uncorrected=_int_or_none(cells[9]),
                )
            )
        except ValueError as exc:
            raise ParseError(f"line {number}: {exc}: {line!r}") from None
    return gpus


_SMI_HEADER = re.compile(r"Driver Version:\s*(?P<driver>[\d.]+)\s+CUDA Version:\s*(?P<cuda>[\d.]+)")


def parse_smi_header(text: str) -> tuple[str, str]:
    """(driver version, highest CUDA version the driver supports) from plain ``nvidia-smi``."""
    match = _SMI_HEADER.search(text)
    if not match:
        raise ParseError("no 'Driver Version: ... CUDA Version: ...' line in nvidia-smi output")
    return match["driver"], match["cuda"]


def version_tuple(text: str) -> tuple[int, ...]:
    """``"13.0"`` → (13, 0); ``"2.8.0+cu128"`` → (2, 8, 0)."""
    parts = re.match(r"^\s*(\d+(?:\.\d+)*)", text or "")
    if not parts:
        raise ParseError(f"not a version: {text!r}")
    return tuple(int(p) for p in parts.group(1).split("."))


def cuda_compatibility(image_cuda: str, driver_cuda: str) -> str:
    """``ok``, ``minor`` (needs CUDA minor-version compatibility) or ``too-old``.

    The driver runs any CUDA up to the version nvidia-smi reports. Since CUDA 11,
    a newer minor release of the same major also runs (minor-version
    compatibility), except features that need the newer driver (PTX JIT of newer
    code): a warning. A newer major never runs.
    """
    image = version_tuple(image_cuda)[:2]
    driver = version_tuple(driver_cuda)[:2]
    if image <= driver:
        return "ok"
    if image[0] == driver[0] and image[0] >= 11:
        return "minor"
    return "too-old"


@dataclass(frozen=True)
class DockerInfo:
    server_version: str
    cgroup_driver: str
    cgroup_version: str
    runtimes: tuple[str, ...]
    default_runtime: str
    cdi_spec_dirs: tuple[str, ...]
    docker_root_dir: str
    name: str


def parse_docker_info(text: str) -> DockerInfo:
    """``docker info --format '{{json .}}'``: the Engine API's SystemInfo object."""
    try:
        data = json.loads(text.strip().splitlines()[-1] if text.strip() else "")
    except (json.JSONDecodeError, IndexError):
        raise ParseError(f"docker info did not print JSON: {text.strip()[:200]!r}") from None
    if not isinstance(data, dict):
        raise ParseError("docker info JSON is not an object")
    if data.get("ServerErrors"):
        raise ParseError("; ".join(map(str, data["ServerErrors"])))
    if not data.get("ServerVersion"):
        raise ParseError("docker info has no ServerVersion (is the daemon reachable?)")
    return DockerInfo(
        server_version=str(data["ServerVersion"]),
        cgroup_driver=str(data.get("CgroupDriver", "")),
        cgroup_version=str(data.get("CgroupVersion", "")),
        runtimes=tuple(sorted((data.get("Runtimes") or {}).keys())),
        default_runtime=str(data.get("DefaultRuntime", "")),
        cdi_spec_dirs=tuple(data.get("CDISpecDirs") or ()),
        docker_root_dir=str(data.get("DockerRootDir", "")),
        name=str(data.get("Name", "")),
    )


_CTK_VERSION = re.compile(r"NVIDIA Container Toolkit CLI version\s+(\S+)")


def parse_nvidia_ctk_version(text: str) -> str:
    """``nvidia-ctk --version`` → "1.17.8" (first line: "NVIDIA Container Toolkit CLI version 1.17.8")."""
    match = _CTK_VERSION.search(text)
    if not match:
        raise ParseError(f"unexpected nvidia-ctk --version output: {text.strip()[:200]!r}")
    return match.group(1)


@dataclass(frozen=True)
class Route:
    destination: str
    dev: str
    src: str | None
    via: str | None
    kind: str  # "unicast", "local", ...


def parse_route_get(text: str) -> Route:
    """One ``ip route get ADDR`` answer, e.g. ``10.0.0.2 dev eth0 src 10.0.0.1 uid 0``."""
    line = next((ln for ln in text.splitlines() if ln.strip() and not ln.startswith(" ")), "")
    words = line.split()
    if not words:
        raise ParseError("ip route get printed nothing")
    kind = "unicast"
    if words[0] in ("local", "broadcast", "unreachable", "prohibit", "blackhole", "multicast"):
        kind, words = words[0], words[1:]
    fields = {words[i]: words[i + 1] for i in range(1, len(words) - 1) if words[i] in ("dev", "src", "via")}
    if "dev" not in fields:
        raise ParseError(f"no 'dev' in ip route get output: {line!r}")
    return Route(words[0], fields["dev"], fields.get("src"), fields.get("via"), kind)


def parse_addresses(text: str) -> list[tuple[str, str]]:
    """``ip -4 -o addr show`` → [(interface, address)], in the kernel's order."""
    found = []
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 4 and words[2] == "inet":
            found.append((words[1].split("@")[0], words[3].split("/")[0]))
    return found


def parse_getent(text: str) -> list[str]:
    """``getent ahostsv4 NAME`` → unique addresses in order."""
    return list(dict.fromkeys(line.split()[0] for line in text.splitlines() if line.split()))


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


# Bridges of container engines and VMs: a route to the master through one of
# these means the master address is wrong for a multi-node job.
VIRTUAL_PREFIXES = ("docker", "br-", "virbr", "veth", "cni", "flannel", "cali", "lxc", "vmnet")


def is_virtual_interface(name: str) -> bool:
    return name == "lo" or name.startswith(VIRTUAL_PREFIXES)


@dataclass(frozen=True)
class DiskSpace:
    path: str  # the path asked about
    checked: str  # the existing ancestor df looked at
    avail_bytes: int
    mount: str


def parse_disk_lines(text: str) -> list[DiskSpace]:
    """Lines of ``PATH<TAB>CHECKED<TAB>`` + a ``df -P -B1`` data row (see checks.DISK_SCRIPT)."""
    spaces = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) != 3:
            continue
        cols = parts[2].split()
        if len(cols) < 6:
            raise ParseError(f"unexpected df row: {parts[2]!r}")
        spaces.append(DiskSpace(parts[0], parts[1], int(cols[3]), cols[5]))
    return spaces


def parse_memlock(text: str) -> int | None:
    """``ulimit -l`` (KiB, or "unlimited") → bytes; None for unlimited."""
    word = text.strip().splitlines()[0].strip() if text.strip() else ""
    if word == "unlimited":
        return None
    if not word.isdigit():
        raise ParseError(f"unexpected ulimit -l output: {word!r}")
    return int(word) * 1024


def parse_json_line(text: str, mark: str) -> dict:
    """The JSON object on the line starting with ``mark`` (probe scripts print one)."""
    for line in text.splitlines():
        if line.startswith(mark):
            try:
                return json.loads(line[len(mark) :])
            except json.JSONDecodeError as exc:
                raise ParseError(f"bad JSON after {mark!r}: {exc}") from None
    raise ParseError(f"no line starting with {mark!r} in output: {text.strip()[-300:]!r}")


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.1f} GiB"


def human_bytes(n_bytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= size:
            return f"{n_bytes / size:.1f} {unit}"
    return f"{int(n_bytes)} B"


def parse_meminfo_total(text: str) -> int:
    """``/proc/meminfo`` → MemTotal in bytes."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ParseError("no MemTotal in /proc/meminfo")
