"""Benchmark: a one-line code change, distributed again, moves only the layers that changed.

    sudo .venv/bin/python benchmarks/distribute_layers.py [--flavour cpu] [--image TAG] [--no-pipes]

The image is built first from this checkout as it is (a cache hit where it exists), and put in a
fresh layer store as `dzctl build` ends (`fill_store`; DZCTL_LAYER_STORE: a fresh one per run).
Then, on 3 fresh test hosts (network namespaces with their own sshd and dockerd, tests/testhosts.py):
1. `dzctl distribute IMAGE` (the nodes hold nothing: every layer, from the store's blobs);
2. change one line of orchestrator/ (in a copy of the build context) and rebuild (`build_image`,
   every earlier step cached, then `fill_store`: the new layers only);
3. `dzctl distribute` the rebuilt image (the nodes hold every layer under the code; its new layers
   come from the store).
And, unless --no-pipes, on 3 other fresh hosts, the naive `docker save | ssh HOST docker load` x3.
Checks that every host ends with each image's ID. Prints a table and the ratios the issue sets
(second <= 5% of the first's bytes and <= 10% of its time; first <= 0.61x the pipes), and writes
benchmarks/results/distribute-layers-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def distribute(cluster: TestCluster, url: str, image: str, workdir: Path, store: Path) -> tuple[float, dict]:
    hostfile = cluster.write_hostfile(workdir / "hostfile")
    argv = [sys.executable, "-m", "orchestrator", "distribute", image, "--hosts", str(hostfile)]
    argv += ["--ssh-config", str(cluster.ssh_config), "--json"]
    env = {**os.environ, "DOCKER_HOST": url, "DZCTL_LAYER_STORE": str(store)}
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    elapsed = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"dzctl distribute {image} failed:\n{done.stderr[-3000:]}")
    return elapsed, json.loads(done.stdout)


def build_from_copy(
    url: str, flavour: str, tag: str, base_image: str, workdir: Path, change: bool, store: Path
) -> tuple[float, dict]:
    """Build ``flavour`` from a copy of this checkout's context, with one comment line added to
    orchestrator/cli.py if ``change``, and fill the layer store as `dzctl build` does; return the
    build's seconds and the fill's report."""
    import docker

    from orchestrator.image.build import BuildRequest, build_image, context_files, read_dockerignore
    from orchestrator.image.store import fill_store

    client = docker.DockerClient(base_url=url, version="auto", timeout=3600)
    copy = workdir / ("changed" if change else "unchanged")
    for rel in context_files(ROOT, read_dockerignore(ROOT)):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, copy / rel)
    if change:
        changed = copy / "orchestrator" / "cli.py"
        changed.write_text(changed.read_text() + f"\n# one changed line ({time.time():.0f})\n")
    started = time.monotonic()
    built = build_image(BuildRequest(flavour=flavour, base_image=base_image, tag=tag), client, root=copy)
    built_s = time.monotonic() - started
    fill = fill_store(client, built.id, layer_store=store)
    if fill.stored is None:
        raise SystemExit(f"the layer store was not filled: {fill.note}")
    return built_s, fill.to_dict()


def base_image(url: str, args) -> str:
    if args.base_image:
        return args.base_image
    import docker
    from baseimage import ensure_base_image

    return ensure_base_image(docker.DockerClient(base_url=url, version="auto", timeout=900))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="dzctl-test/cpu:bench", help="tag the first build gets")
    parser.add_argument("--flavour", default="cpu")
    parser.add_argument("--base-image", help="the base IMAGE was built on (default: the tests' Debian base)")
    parser.add_argument("--no-pipes", action="store_true", help="skip the naive pipes at 3 hosts")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results" / f"distribute-layers-{time.strftime('%Y%m%d')}.json")
    )
    args = parser.parse_args()
    rows: dict[str, dict] = {}
    with local_docker() as url, tempfile.TemporaryDirectory(prefix="dzlayers-") as tmp:
        # The first image is this checkout as it is (a cache hit where it was built already), so
        # that the rebuild differs from it by the one line only.
        base = base_image(url, args)
        store = Path(tmp) / "layer-store"
        build_s, fill = build_from_copy(url, args.flavour, args.image, base, Path(tmp), False, store)
        rows["build"] = {"seconds": round(build_s, 1), "store_fill": fill}
        print("build  ", json.dumps(rows["build"]), flush=True)
        inspect = ["docker", "-H", url, "image", "inspect", "--format", "{{.Id}} {{.Size}}"]
        image_id, size = subprocess.run(
            [*inspect, args.image], capture_output=True, text=True, check=True
        ).stdout.split()
        print(f"image {args.image} {image_id[:19]} {int(size) / 1e9:.2f} GB; cores {os.cpu_count()}", flush=True)
        print(f"load average {os.getloadavg()}", flush=True)
        subprocess.run(["docker", "-H", url, "save", args.image], stdout=subprocess.DEVNULL, check=True)  # page cache
        with TestCluster(3, docker=True, workdir=Path(tmp) / "dz") as cluster:
            first_s, first = distribute(cluster, url, args.image, Path(tmp) / "dz", store)
            verify(cluster, image_id)
            rows["first"] = {
                "seconds": round(first_s, 1),
                "bytes": sum(h["bytes_sent"] for h in first["hosts"]),
                "phases": first.get("phases"),
                "notes": first.get("notes"),
                "load_average": os.getloadavg()[0],
            }
            print("first  ", json.dumps(rows["first"]), flush=True)
            changed = f"{args.image}-changed"
            build_s, fill = build_from_copy(url, args.flavour, changed, base, Path(tmp), True, store)
            changed_id = subprocess.run([*inspect, changed], capture_output=True, text=True, check=True).stdout.split()[
                0
            ]
            rows["rebuild"] = {"seconds": round(build_s, 1), "store_fill": fill, "image": changed}
            rows["rebuild"]["image_id"] = changed_id
            print("rebuild", json.dumps(rows["rebuild"]), flush=True)
            second_s, second = distribute(cluster, url, changed, Path(tmp) / "dz", store)
            verify(cluster, changed_id)
            rows["second"] = {
                "seconds": round(second_s, 1),
                "bytes": sum(h["bytes_sent"] for h in second["hosts"]),
                "layers_held": [f"{h['layers_held']}/{h['layers_total']}" for h in second["hosts"]],
                "sources": [h.get("source") for h in second["hosts"]],
                "phases": second.get("phases"),
                "notes": second.get("notes"),
                "load_average": os.getloadavg()[0],
            }
            print("second ", json.dumps(rows["second"]), flush=True)
        if not args.no_pipes:
            with TestCluster(3, docker=True, workdir=Path(tmp) / "pipes") as cluster:
                rows["pipes"] = {"seconds": round(timed_pipes(cluster, url, args.image), 1)}
                verify(cluster, image_id)
            print("pipes  ", json.dumps(rows["pipes"]), flush=True)
    first, second = rows["first"], rows["second"]
    ratios = {
        "second_bytes_over_first": round(second["bytes"] / first["bytes"], 5),
        "second_time_over_first": round(second["seconds"] / first["seconds"], 4),
    }
    if "pipes" in rows:
        ratios["first_over_pipes"] = round(first["seconds"] / rows["pipes"]["seconds"], 3)
    else:
        # Not measured in this run: the 3-host pipes of benchmarks/distribute.py's recorded run.
        recorded = json.loads((ROOT / "benchmarks" / "results" / "distribute.json").read_text())
        pipes = next(r["seconds"] for r in recorded["rows"] if r["hosts"] == 3 and r["how"] == "pipes")
        ratios["first_over_recorded_pipes"] = round(first["seconds"] / pipes, 3)
        ratios["recorded_pipes"] = {
            "seconds": pipes,
            "from": "benchmarks/results/distribute.json",
            "image_bytes": recorded["image_bytes"],
        }
    print()
    print(f"| 3 hosts, image {int(size) / 1e9:.2f} GB | seconds | bytes sent (all nodes) |")
    print("|---|---|---|")
    for name in ("pipes", "first", "second"):
        if name in rows:
            print(f"| {name} | {rows[name]['seconds']} | {rows[name].get('bytes', '-')} |")
    print(json.dumps(ratios))
    result = {
        "image": args.image,
        "image_bytes": int(size),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores (each row has the 1-minute load average after it); one run each",
        "load_average_1_5_15_at_end": os.getloadavg(),
        "rows": rows,
        "ratios": ratios,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
