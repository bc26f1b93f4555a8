"""Benchmark: the first distribution of an image to 3 fresh nodes, against the naive pipes, the code
before layer-aware distribution, and the floor that no method using `docker load` can beat here.

    sudo .venv/bin/python benchmarks/distribute_first.py [--image TAG] [--rounds 2]

On 3 fresh test hosts each time (network namespaces with their own sshd and dockerd,
tests/testhosts.py), in rounds, interleaved so that a slow spell of this shared machine hits every
method alike:
- pipes:  `docker save IMAGE | ssh HOST docker load`, one per host, all at once (OpenSSH);
- before: `dzctl distribute` at the commit before layer-aware distribution (BEFORE below): one
          `docker save`, compressed once (zstd), teed to every node's `docker load`;
- dzctl:  `dzctl distribute` of this checkout, with the layer store filled as `dzctl build` fills
          it (`fill_store`, timed once and printed: the cost moved to the build); its streams go
          through the system's OpenSSH client (`--ssh-client auto`, checked in its report);
- paramiko: the same, with `--ssh-client paramiko`: what the OpenSSH client changed;
- floor:  each host's own `docker load -i FILE` of a saved copy on this machine's disk, all at
          once: no save, no SSH, no transfer. Every node must do this much, whatever sends it,
          and here the three hosts share this machine's cores and disk.
Every host is checked to hold the image's ID afterwards. Prints every run, the medians and the
ratios to the pipes, and writes benchmarks/results/distribute-first-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from distribute import timed_pipes, verify  # noqa: E402  (benchmarks/distribute.py)
from localdocker import local_docker  # noqa: E402
from testhosts import TestCluster  # noqa: E402

# The last commit before layer-aware distribution (a4da474): what the issue calls "today's".
BEFORE = "ff3137a"
METHODS = ("pipes", "before", "dzctl", "paramiko", "floor")


def timed_distribute(
    cluster: TestCluster, url: str, image: str, workdir: Path, checkout: Path, store: str, ssh_client: str = "auto"
) -> float:
    hostfile = cluster.write_hostfile(workdir / "hostfile")
    argv = [sys.executable, "-m", "orchestrator", "distribute", image, "--hosts", str(hostfile)]
    argv += ["--ssh-config", str(cluster.ssh_config), "--json"]
    env = {**os.environ, "DOCKER_HOST": url, "DZCTL_LAYER_STORE": store, "PYTHONPATH": str(checkout)}
    env["DZCTL_SSH_CLIENT"] = ssh_client  # the checkout before it has no such option and ignores it
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=checkout)
    elapsed = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"dzctl distribute ({checkout}) failed:\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    if store != "off":  # this checkout with the filled store: every node must have had its blobs
        sources = {host["source"] for host in report["hosts"]}
        if sources != {"store"}:
            raise SystemExit(f"expected every node to stream from the store, got {sources}: {report}")
        carriers = {host["ssh_client"] for host in report["hosts"]}
        if carriers != {"openssh" if ssh_client == "auto" else ssh_client}:
            raise SystemExit(f"expected the streams to go through {ssh_client}, got {carriers}: {report}")
    return elapsed


def timed_floor(cluster: TestCluster, saved: Path) -> float:
    started = time.monotonic()
    loads = [
        subprocess.Popen(["docker", "-H", host.docker_host, "load", "-i", str(saved)], stdout=subprocess.DEVNULL)
        for host in cluster.hosts
    ]
    codes = [load.wait() for load in loads]
    if any(codes):
        raise SystemExit(f"docker load -i failed: exit codes {codes}")
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="dzctl-test/cpu:latest")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS), help="which to run, comma-separated (pipes always)")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / f"distribute-first-{time.strftime('%Y%m%d')}.json")
    )
    args = parser.parse_args()
    methods = [m for m in METHODS if m == "pipes" or m in args.methods.split(",")]
    import docker

    from orchestrator.image.store import fill_store

    rows: list[dict] = []
    with local_docker() as url, tempfile.TemporaryDirectory(prefix="dzfirst-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        client = docker.DockerClient(base_url=url, version="auto", timeout=3600)
        image = client.images.get(args.image)
        size = int(image.attrs["Size"])
        print(f"image {args.image} {image.id[:19]} {size / 1e9:.2f} GB; cores {os.cpu_count()}", flush=True)
        print(f"load average at the start {os.getloadavg()}", flush=True)
        before = work / "before"
        if "before" in methods:
            worktree = ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(before), BEFORE]
            subprocess.run(worktree, check=True)
        try:
            fill = fill_store(client, image.id, layer_store=work / "store")
            if fill.stored is None:
                raise SystemExit(f"the layer store was not filled: {fill.note}")
            print("build's store fill", json.dumps(fill.to_dict()), flush=True)
            saved = work / "image.tar"
            started = time.monotonic()
            subprocess.run(["docker", "-H", url, "save", "-o", str(saved), args.image], check=True)
            print(f"saved for the floor in {time.monotonic() - started:.1f} s", flush=True)
            for round_ in range(args.rounds):
                for method in methods:
                    runwork = work / f"{method}-{round_}"
                    with TestCluster(3, docker=True, workdir=runwork) as cluster:
                        os.sync()  # each run starts with this machine's dirty pages written out
                        if method == "pipes":
                            seconds = timed_pipes(cluster, url, args.image)
                        elif method == "before":
                            seconds = timed_distribute(cluster, url, args.image, runwork, before, "off")
                        elif method in ("dzctl", "paramiko"):
                            client = "auto" if method == "dzctl" else "paramiko"
                            store = str(work / "store")
                            seconds = timed_distribute(cluster, url, args.image, runwork, ROOT, store, client)
                        else:
                            seconds = timed_floor(cluster, saved)
                        verify(cluster, image.id)
                    row = {"round": round_, "method": method, "seconds": round(seconds, 1)}
                    row["load_average"] = round(os.getloadavg()[0], 2)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            if "before" in methods:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
    medians = {m: statistics.median(r["seconds"] for r in rows if r["method"] == m) for m in methods}
    print()
    print(f"| 3 hosts, image {size / 1e9:.2f} GB | runs (s) | median (s) | median / pipes |")
    print("|---|---|---|---|")
    for method in methods:
        runs = ", ".join(str(r["seconds"]) for r in rows if r["method"] == method)
        print(f"| {method} | {runs} | {medians[method]:.1f} | {medians[method] / medians['pipes']:.2f} |")
    ratios = {f"{m}_over_pipes": round(medians[m] / medians["pipes"], 3) for m in methods if m != "pipes"}
    if "dzctl" in medians and "before" in medians:
        ratios["dzctl_over_before"] = round(medians["dzctl"] / medians["before"], 3)
    if "dzctl" in medians and "paramiko" in medians:
        ratios["dzctl_over_paramiko"] = round(medians["dzctl"] / medians["paramiko"], 3)
    print(json.dumps(ratios))
    record = {"image": args.image, "image_bytes": size, "store_fill": fill.to_dict(), "rows": rows, **ratios}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
