"""Addresses and the route to the master without iproute2: for nodes that lack the ``ip`` tool.

Seen on an H200 node: no ``ip`` binary, so ``ip route get`` failed and preflight blamed the routing
table. When ``ip`` is missing, the node's Python answers the same two questions from the kernel:
interface addresses by ``SIOCGIFADDR`` (the primary IPv4 address of each interface, as NCCL and gloo
pick them), the source address the kernel chooses for the master (a connected UDP socket sends
nothing), and the outgoing interface from ``/proc/net/route`` (longest prefix of the main table).
"""

from __future__ import annotations

import json

from .parsers import ParseError, Route

# Debian/Ubuntu call the package iproute2, RHEL/Fedora iproute.
IP_TOOL_FIX = (
    "install iproute2 on the node (Debian/Ubuntu: apt-get install iproute2; RHEL/Fedora: dnf install iproute), "
    "or python3, which dzctl uses in place of `ip`"
)

NET_PROBE = r"""
import fcntl, json, socket, struct, sys
SIOCGIFADDR = 0x8915
def addresses():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    found = []
    for _, name in socket.if_nameindex():
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            continue  # no IPv4 address on this interface
        found.append([name, socket.inet_ntoa(packed[20:24])])
    return found
def route(target, own):
    local = [name for name, addr in own if addr == target]
    if local or target.startswith("127."):
        return {"kind": "local", "dev": local[0] if local else "lo", "src": target, "via": None}
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((target, 9))  # UDP: no packet leaves; the kernel picks the route and source
    except OSError as exc:
        return {"error": exc.strerror or str(exc)}
    src = s.getsockname()[0]
    want = struct.unpack("=I", socket.inet_aton(target))[0]
    best = None
    with open("/proc/net/route") as table:
        next(table)
        for line in table:
            w = line.split()
            dest, gateway, flags, mask = int(w[1], 16), int(w[2], 16), int(w[3], 16), int(w[7], 16)
            if flags & 1 and want & mask == dest and (best is None or bin(mask).count("1") > best[0]):
                best = (bin(mask).count("1"), w[0], gateway)
    dev = best[1] if best else next((name for name, addr in own if addr == src), None)
    via = socket.inet_ntoa(struct.pack("=I", best[2])) if best and best[2] else None
    return {"kind": "unicast", "dev": dev, "src": src, "via": via}
own = addresses()
out = {"addresses": own}
if len(sys.argv) > 1:
    out["route"] = route(sys.argv[1], own)
print(json.dumps(out))
"""


def probe_argv(python: str, target: str | None = None) -> list[str]:
    return [python, "-c", NET_PROBE, *([target] if target else [])]


def parse_addresses(text: str) -> list[tuple[str, str]]:
    try:
        return [(name, addr) for name, addr in json.loads(text)["addresses"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ParseError(f"unreadable address probe output: {text[:200]!r}") from exc


def parse_route(text: str, target: str) -> Route:
    """The probe's answer as ``ip route get`` would give it; ParseError when there is no route."""
    try:
        found = json.loads(text)["route"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ParseError(f"unreadable route probe output: {text[:200]!r}") from exc
    if "error" in found:
        raise ParseError(f"no route to master {target}: {found['error']}")
    if not found.get("dev"):
        raise ParseError(f"no route to master {target} in /proc/net/route")
    return Route(target, found["dev"], found.get("src"), found.get("via"), found.get("kind", "unicast"))
