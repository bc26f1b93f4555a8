"""Benchmark: `dzctl distribute` vs what a user would type, `docker save IMAGE | ssh HOST docker load`.

For 1 and 3 test hosts (network namespaces with their own sshd and dockerd on this machine,
tests/testhosts.py), each measurement on freshly started hosts (no image yet):
- pipes: one `docker save IMAGE | ssh HOST docker load` per host, all in parallel (N saves);
- dzctl: `dzctl distribute IMAGE --hosts ...` (one save, teed to N loads over paramiko);
- with --codecs, dzctl at 3 hosts with each wire codec (none, gzip, zstd).
One run each, after one untimed `docker save` so every run reads the image from page cache.
Prints a table and the ratio dzctl/pipes; writes benchmarks/results/distribute.json.

    sudo .venv/bin/python benchmarks/distribute.py --image dzctl-test/cpu:latest [--codecs]

Needs root, dockerd, sshd; the image must be in the local daemon (`dzctl build --flavour cpu`,
or tests/test_image.py builds dzctl-test/cpu:latest). All hosts share this machine's cores, so
every `docker load` competes with the others and with the sender.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from localdocker import local_docker  # noqa: E402
from testhosts import TestCluster  # noqa: E402


def timed_pipes(cluster: TestCluster, docker_url: str, image: str) -> float:
    """Every host at once: its own `docker save | ssh host docker load`."""
    started = time.monotonic()
    procs = []
    for host in cluster.hosts:
        save = subprocess.Popen(["docker", "-H", docker_url, "save", image], stdout=subprocess.PIPE)
        load = subprocess.Popen(
            cluster.ssh_argv(host, ["docker", "load"]), stdin=save.stdout, stdout=subprocess.DEVNULL
        )
        save.stdout.close()  # the load owns the pipe now; save gets SIGPIPE if load dies
        procs += [save, load]
    codes = [proc.wait() for proc in procs]
    elapsed = time.monotonic() - started
    if any(codes):
        raise SystemExit(f"pipes failed: exit codes {codes}")
    return elapsed


def timed_dzctl(cluster: TestCluster, docker_url: str, image: str, codec: str, workdir: Path) -> tuple[float, dict]:
    hostfile = cluster.write_hostfile(workdir / "hostfile")
    argv = [sys.executable, "-m", "orchestrator", "distribute", image, "--hosts", str(hostfile)]
    argv += ["--ssh-config", str(cluster.ssh_config), "--codec", codec, "--json"]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "DOCKER_HOST": docker_url})
    elapsed = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"dzctl distribute failed:\n{done.stderr[-3000:]}")
    return elapsed, json.loads(done.stdout)


def verify(cluster: TestCluster, image_id: str) -> None:
    for host in cluster.hosts:
        got = cluster.run_in(host, ["docker", "image", "inspect", "--format", "{{.Id}}", image_id], check=False)
        if got.stdout.strip() != image_id:
            raise SystemExit(f"{host.name} does not hold {image_id} after the run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="dzctl-test/cpu:latest")
    parser.add_argument("--hosts", default="1,3", help="host counts to measure")
    parser.add_argument("--codecs", action="store_true", help="also dzctl at the largest count with each codec")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "distribute.json"))
    args = parser.parse_args()
    counts = [int(n) for n in args.hosts.split(",")]
    rows = []
    with local_docker() as url, tempfile.TemporaryDirectory(prefix="dzbench-") as tmp:
        inspect = ["docker", "-H", url, "image", "inspect", "--format", "{{.Id}} {{.Size}}", args.image]
        image_id, size = subprocess.run(inspect, capture_output=True, text=True, check=True).stdout.split()
        print(f"image {args.image} {image_id[:19]} {int(size) / 1e9:.2f} GB; cores {os.cpu_count()}", flush=True)
        # One untimed save, so that every timed run reads the layers from page cache.
        subprocess.run(["docker", "-H", url, "save", args.image], stdout=subprocess.DEVNULL, check=True)
        plan = [(n, "pipes", None) for n in counts] + [(n, "dzctl", "auto") for n in counts]
        if args.codecs:
            plan += [(max(counts), "dzctl", codec) for codec in ("none", "gzip", "zstd")]
        for n, how, codec in plan:
            workdir = Path(tmp) / f"{how}-{codec}-{n}"
            with TestCluster(n, docker=True, workdir=workdir) as cluster:
                if how == "pipes":
                    elapsed, extra = timed_pipes(cluster, url, args.image), {}
                else:
                    elapsed, report = timed_dzctl(cluster, url, args.image, codec, workdir)
                    extra = {"wire_codec": report["codec"], "wire_bytes": report["wire_bytes"]}
                verify(cluster, image_id)
            row = {"hosts": n, "how": how, "codec": codec, "seconds": round(elapsed, 1), **extra}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"| hosts | pipes (s) | dzctl auto (s) | dzctl / pipes |   image {int(size) / 1e9:.2f} GB")
    print("|---|---|---|---|")
    for n in counts:
        pipes = next(r["seconds"] for r in rows if r["hosts"] == n and r["how"] == "pipes")
        dz = next(r for r in rows if r["hosts"] == n and r["how"] == "dzctl" and r["codec"] == "auto")
        print(f"| {n} | {pipes} | {dz['seconds']} ({dz['wire_codec']}) | {dz['seconds'] / pipes:.2f} |")
    for row in rows:
        if row["how"] == "dzctl" and row["codec"] != "auto":
            wire = f"{row['wire_bytes'] / 1e6:,.0f} MB on the wire"
            print(f"codec {row['codec']:<5} at {row['hosts']} hosts: {row['seconds']} s, {wire}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"image": args.image, "image_bytes": int(size), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
