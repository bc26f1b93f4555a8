"""How long `dzctl launch` takes to get 2 nodes running, and dzctl's own share of it.

Run as root on a machine that can host test hosts (see tests/testhosts.py):

    .venv/bin/python benchmarks/launch_overhead.py [--runs 3]

It starts 2 test hosts (netns + sshd + dockerd each), builds the CPU image on a
local dockerd, launches the tiny job once to put the image on both nodes (not
measured), then launches it --detach --json RUNS more times, each time reading
the phases dzctl reports and the wall time of the whole command (Python start
included). dzctl's share = wall time − image transfer − container starts: the job's
`docker run` on the nodes and preflight's probe container (a container start
plus torch's import inside it, on the slowest node). What remains is Python
start, parsing, SSH, the other checks, planning, upload and bookkeeping.
Target (issue 6): under 3 s.

The collective check (issue 18) runs in every launch here: its seconds (the `collective`
phase: starting the check's container on both nodes, torch's import there, the group's
rendezvous, the all-reduce, and removing the containers) are reported in their own column
and left out of dzctl's share. Target (issue 18): under 15 s on GPU nodes.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    import docker
    from baseimage import ensure_base_image
    from localdocker import local_docker
    from test_image import CPU_TAG, cpu_build_args
    from testhosts import TestCluster

    work = Path(tempfile.mkdtemp(prefix="dzctl-bench-launch-"))
    with local_docker() as url:
        base = ensure_base_image(docker.DockerClient(base_url=url, version="auto", timeout=900))
        env = {**os.environ, "DOCKER_HOST": url, "DZCTL_HOME": str(work / "home"), "PYTHONPATH": str(ROOT)}
        build = subprocess.run([sys.executable, "-m", "orchestrator", *cpu_build_args(base)], env=env, text=True,
                               capture_output=True)  # fmt: skip
        if build.returncode != 0:
            print(build.stderr[-2000:], file=sys.stderr)
            return 1
        with TestCluster(2, docker=True, workdir=work / "hosts") as cluster:
            hostfile = cluster.write_hostfile(work / "hosts.txt", slots=1)

            def launch(name: str) -> tuple[float, dict]:
                sets = [
                    f"name={name}", f"image={CPU_TAG}", "runtime=docker", "train.max_steps=100000",
                    f"launch.remote_dir=/var/tmp/dzctl-bench-{cluster.cid}/{{host}}",
                ]  # fmt: skip
                argv = [
                    sys.executable,
                    "-m",
                    "orchestrator",
                    "launch",
                    str(ROOT / "jobs/tiny-cpu.yaml"),
                    "--hosts",
                    str(hostfile),
                    "--ssh-config",
                    str(cluster.ssh_config),
                    "--detach",
                    "--json",
                ]
                argv += [x for s in sets for x in ("--set", s)]  # fmt: skip
                started = time.monotonic()
                done = subprocess.run(argv, env=env, text=True, capture_output=True)
                wall = time.monotonic() - started
                if done.returncode != 0:
                    raise SystemExit(done.stderr[-3000:])
                result = json.loads(done.stdout)
                stop = [sys.executable, "-m", "orchestrator", "stop", result["job_id"], "--ssh-config",
                        str(cluster.ssh_config)]  # fmt: skip
                subprocess.run(stop, env=env, capture_output=True)
                return wall, result["phases_s"]

            first_wall, first = launch("bench-warmup")
            print(f"first launch (distributes the image): {first_wall:.1f} s, phases {first}")
            rows = []
            for index in range(args.runs):
                wall, phases = launch(f"bench-{index}")
                excluded = (
                    phases.get("distribute", 0.0)
                    + phases.get("start_nodes", 0.0)
                    + phases.get("preflight_container_probe", 0.0)
                    + phases.get("collective", 0.0)
                )
                rows.append((wall, phases, wall - excluded))
    print()
    print(f"{'run':>3} {'wall s':>7} {'preflight':>9} {'probe ctr':>9} {'plan':>6} {'collective':>10} {'upload':>7} "
          f"{'docker run':>10} {'dzctl share':>11}")  # fmt: skip
    for index, (wall, ph, share) in enumerate(rows):
        print(f"{index:>3} {wall:7.2f} {ph.get('preflight', 0):9.2f} {ph.get('preflight_container_probe', 0):9.2f} "
              f"{ph.get('memory_plan', 0):6.2f} {ph.get('collective', 0):10.2f} "
              f"{ph.get('upload', 0):7.2f} {ph.get('start_nodes', 0):10.2f} {share:11.2f}")  # fmt: skip
    share = statistics.median(r[2] for r in rows)
    wall = statistics.median(r[0] for r in rows)
    collective = statistics.median(r[1].get("collective", 0.0) for r in rows)
    print(f"\nmedian dzctl share: {share:.2f} s (target < 3 s); median wall: {wall:.2f} s")
    print(f"median collective check at 2 nodes (gloo, CPU test hosts): {collective:.2f} s (target < 15 s on GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
