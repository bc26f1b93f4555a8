"""Benchmark: what carrying a stream costs the controller, paramiko against the OpenSSH client.

    sudo .venv/bin/python benchmarks/ssh_streams.py [--mb 600] [--rounds 2]

On 3 fresh test hosts (network namespaces with their own sshd, tests/testhosts.py), each method
sends MB megabytes of random bytes to every host at once, into `cat > /dev/null`, through the
product's own carriers:
- paramiko:        the HostPool's connection (``SSHConnection.run`` with stdin), one thread per host;
- openssh:         ``openssh.OpenSSHLink`` as ``distribute`` builds it (AES-GCM moved first);
- openssh-chacha:  the same with ``Ciphers=chacha20-poly1305@openssh.com``, OpenSSH's own first
                   choice, to check the cipher order ``openssh.CIPHERS`` sets.
Rounds interleave the methods. Prints wall seconds and this process's CPU seconds (itself and its
ssh children; the hosts' sshd is not counted: on a real fleet it runs on the nodes), and writes
benchmarks/results/ssh-streams-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from testhosts import TestCluster  # noqa: E402

from orchestrator.transport.openssh import OpenSSHLink, stream_links  # noqa: E402
from orchestrator.transport.pool import HostPool  # noqa: E402

CHUNK = 1 << 20
METHODS = ("paramiko", "openssh", "openssh-chacha")


class Source:
    """``size`` bytes, a 1 MiB random block over and over: nothing on the way compresses it."""

    block = os.urandom(CHUNK)

    def __init__(self, size: int) -> None:
        self.left = size

    def read(self, _size: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        self.left -= CHUNK
        return self.block


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def carriers(method: str, pool: HostPool, hosts: list[str]) -> dict:
    if method == "paramiko":
        return {host: pool.connection(host) for host in hosts}
    links, _, _ = stream_links(pool, hosts, "openssh")
    if method == "openssh-chacha":
        for link in links.values():
            link.prefix = [
                "Ciphers=chacha20-poly1305@openssh.com" if word.startswith("Ciphers=") else word for word in link.prefix
            ]
    assert isinstance(next(iter(links.values())), OpenSSHLink)
    return links


def timed(method: str, cluster: TestCluster, size: int) -> dict:
    hosts = [host.name for host in cluster.hosts]
    with HostPool(hosts, ssh_config=cluster.ssh_config) as pool:
        links = carriers(method, pool, hosts)  # connected before the clock starts
        failures: list[str] = []

        def send(host: str) -> None:
            result = links[host].run(["sh", "-c", "cat > /dev/null"], stdin=Source(size))
            if not result.ok:
                failures.append(f"{host}: {result.how_it_ended} {result.stderr[-300:]}")

        threads = [threading.Thread(target=send, args=(host,)) for host in hosts]
        cpu, started = cpu_seconds(), time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall, cpu = time.monotonic() - started, cpu_seconds() - cpu
    if failures:
        raise SystemExit(f"{method} failed: {failures}")
    return {"method": method, "wall_s": round(wall, 2), "controller_cpu_s": round(cpu, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=600, help="MiB sent to each host")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / f"ssh-streams-{time.strftime('%Y%m%d')}.json")
    )
    args = parser.parse_args()
    size = args.mb * CHUNK
    print(f"3 hosts, {args.mb} MiB each ({3 * size / 1e9:.2f} GB in all); cores {os.cpu_count()}", flush=True)
    rows = []
    with TestCluster(3) as cluster:
        for round_ in range(args.rounds):
            for method in METHODS:
                row = {"round": round_, **timed(method, cluster, size), "load_average": round(os.getloadavg()[0], 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n| 3 hosts x {args.mb} MiB | wall (s), median | controller CPU (s), median |\n|---|---|---|")
    summary = {}
    for method in METHODS:
        mine = [row for row in rows if row["method"] == method]
        wall = statistics.median(row["wall_s"] for row in mine)
        cpu = statistics.median(row["controller_cpu_s"] for row in mine)
        summary[method] = {"wall_s": wall, "controller_cpu_s": cpu}
        print(f"| {method} | {wall:.1f} | {cpu:.1f} |")
    Path(args.out).write_text(json.dumps({"mb_per_host": args.mb, "rows": rows, "medians": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
