"""Fan-out cost: dzctl's SSH layer against pdsh over OpenSSH, on 1 and 8 real test hosts.

Run as root on a machine with sshd, pdsh and iproute2 (the test-host requirements):

    .venv/bin/python benchmarks/ssh_fanout.py [--hosts 1,8] [--repeat 7]

Both tools reach the same test hosts (network namespaces with their own sshd,
tests/testhosts.py) with the same ssh_config, keys and known_hosts, and run the
same probe commands. pdsh is DeepSpeed's own multi-node transport
(``pdsh -R ssh``); it forks one ``ssh`` per host per invocation.

Scenarios, each timed from nothing to every host's output in hand (connections included):
- ``1 command``: ``hostname`` on every host.
- ``5 probes``: five preflight-like probes on every host. pdsh gets its best case,
  one invocation with the commands joined by ``;`` (one SSH connection per host);
  dzctl runs them as five separate argv commands over its one connection per
  host, in turn (as preflight does) and at once on parallel channels.
- ``5 probes, pdsh ×5``: the same, with pdsh invoked once per probe, as a script
  calling pdsh for each step would.

Runs of the three take turns, so a shift in machine load hits all alike.
dzctl is timed in-process (the SSH layer is what is measured); a CLI run adds the
Python start-up and imports, printed separately. Median of ``--repeat`` runs.
On a 2-core machine every sshd shares the controller's cores, so nothing is
flat in N here; the ratio dzctl/pdsh is the measure.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from testhosts import TestCluster, missing_requirements  # noqa: E402

from orchestrator.transport.local import run_concurrently  # noqa: E402
from orchestrator.transport.pool import HostPool  # noqa: E402

# paramiko 5 offers mlkem768x25519 first, which OpenSSH 9.2's sshd lacks, so it settles on
# curve25519; OpenSSH's client prefers the costlier post-quantum sntrup761x25519 hybrid.
MATCHED_KEX = "-o KexAlgorithms=curve25519-sha256"

PROBES = [
    ["hostname"],
    ["nproc"],
    ["df", "-P", "-B1", "/"],
    ["cat", "/proc/loadavg"],
    ["ip", "-4", "-o", "addr", "show"],
]


def time_dzctl(names: list[str], config: Path, probes: list[list[str]], parallel: bool = False) -> float:
    started = time.perf_counter()
    with HostPool(names, ssh_config=config) as pool:

        def in_turn(conn):
            return [conn.run(argv, timeout=60, check=True).stdout for argv in probes]

        def at_once(conn):
            return [r.check().stdout for r in run_concurrently(conn, probes, timeout=60)]

        outcomes = pool.map(at_once if parallel else in_turn)
    elapsed = time.perf_counter() - started
    failed = outcomes.failed
    if failed:
        raise SystemExit(f"dzctl run failed: {failed}")
    return elapsed


def time_pdsh(names: list[str], config: Path, commands: list[str], ssh_opts: str = "") -> float:
    # pdsh's ssh module runs `ssh <PDSH_SSH_ARGS> <command>`; %h is the host.
    env = {**os.environ, "PDSH_SSH_ARGS": f"-F {config} -o BatchMode=yes {ssh_opts} -x %h", "PDSH_RCMD_TYPE": "ssh"}
    started = time.perf_counter()
    for command in commands:
        proc = subprocess.run(
            ["pdsh", "-R", "ssh", "-f", "64", "-w", ",".join(names), command],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        if proc.returncode != 0:
            raise SystemExit(f"pdsh failed ({proc.returncode}): {proc.stderr}")
    return time.perf_counter() - started


def interleaved_medians(repeat: int, fns) -> list[float]:
    """Median time of each function, runs taken in turn so a change in machine load hits all alike."""
    for fn in fns:
        fn()  # warm-up: page cache, ARP, sshd's first fork
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, sink in zip(fns, times, strict=True):
            sink.append(fn())
    return [statistics.median(t) for t in times]


def python_startup_s() -> float:
    runs = []
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import orchestrator.transport.pool"], check=True, cwd=REPO)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="1,8", help="comma-separated host counts (default 1,8)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per cell (median); default 7")
    args = parser.parse_args()
    counts = [int(n) for n in args.hosts.split(",")]
    missing = missing_requirements() + ([] if shutil.which("pdsh") else ["pdsh (apt-get install pdsh)"])
    if missing:
        raise SystemExit("cannot run: " + ", ".join(missing))

    joined = "; ".join(shlex.join(p) for p in PROBES)
    each = [shlex.join(p) for p in PROBES]
    scenarios = [
        ("1 command", PROBES[:1], ["hostname"]),
        ("5 probes", PROBES, [joined]),
        ("5 probes, pdsh ×5", PROBES, each),
    ]
    rows = []
    workdir = tempfile.mkdtemp(prefix="dzctl-bench-")
    try:
        with TestCluster(max(counts), workdir=Path(workdir)) as hosts:
            config = hosts.ssh_config
            for n in counts:
                names = [h.name for h in hosts.hosts[:n]]
                for label, argvs, commands in scenarios:
                    fns = [
                        partial(time_dzctl, names, config, argvs),
                        partial(time_dzctl, names, config, argvs, parallel=True),
                        partial(time_pdsh, names, config, commands),
                        partial(time_pdsh, names, config, commands, MATCHED_KEX),
                    ]
                    row = (label, n, *interleaved_medians(args.repeat, fns))
                    rows.append(row)
                    print("  " + "  ".join(map(str, row)), file=sys.stderr)

    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"\nmedian of {args.repeat} runs; {os.cpu_count()} CPU cores; connections included in every run")
    print("dzctl (seq): the probes one after another over the host's one connection")
    print("dzctl (par): the probes at once, one channel each, over the host's one connection")
    print("pdsh (a): OpenSSH defaults (KEX sntrup761x25519-sha512 with OpenSSH 9.2)")
    print(f"pdsh (b): `{MATCHED_KEX}`, the key exchange paramiko negotiates with these sshd\n")
    print("| scenario | hosts | dzctl seq (s) | dzctl par (s) | pdsh (a) (s) | pdsh (b) (s) | seq / (b) | par / (b) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, n, seq_s, par_s, pdsh_s, matched_s in rows:
        print(
            f"| {label} | {n} | {seq_s:.3f} | {par_s:.3f} | {pdsh_s:.3f} | {matched_s:.3f} | "
            f"{seq_s / matched_s:.2f}× | {par_s / matched_s:.2f}× |"
        )
    print(f"\nPython start-up + `import orchestrator.transport.pool` (once per CLI run): {python_startup_s():.3f} s")


if __name__ == "__main__":
    main()
