"""The step-time model on real traffic: 2 test hosts × 2 gloo ranks, the link between them shaped with tc.

Needs root (it builds two network-namespace hosts with tests/testhosts.py, each behind a veth on a
private bridge) and the repo's .venv (torch, DeepSpeed, transformers). For each rate (unshaped, then
each ``--rates`` Mbit/s, set with a tbf on both bridge-side veths, so each host receives at that rate
and, the bridge being non-blocking, sends at it too) and each configuration of
benchmarks/steptime_cpu_worker.py, it starts torchrun in both hosts and collects rank 0's record.

    python3 benchmarks/steptime_shaped.py --out benchmarks/results/steptime-shaped-YYYYMMDD

Writes ``runs.json`` (every record, with the rate) and nothing else: the analysis is
benchmarks/steptime_shaped_report.py, which reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from testhosts import TestCluster  # noqa: E402

PYTHON = REPO / ".venv" / "bin" / "python"
PORT = 29611


def shape(cluster: TestCluster, mbit: int | None) -> None:
    for index in range(len(cluster.hosts)):
        dev = f"dzv{cluster.cid}{index}"
        subprocess.run(["tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        if mbit is not None:
            # burst ≥ rate / HZ and larger than a GSO super-packet (64 KiB), or tbf drops them
            subprocess.run(
                ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", "1mb",
                 "latency", "400ms"],
                check=True,
            )  # fmt: skip


def run(cluster: TestCluster, config: str, steps: int, out: Path, probe: bool, timeout: float) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")  # fmt: skip
    master = cluster.hosts[0].address
    procs = []
    for index, host in enumerate(cluster.hosts):
        argv = ["nsenter", f"--net={host.netns_path}", str(PYTHON), "-m", "torch.distributed.run",
                "--nnodes", "2", "--node_rank", str(index), "--nproc_per_node", "2",
                "--master_addr", master, "--master_port", str(PORT),
                str(REPO / "benchmarks" / "steptime_cpu_worker.py"), "--config", config, "--steps", str(steps),
                "--out", str(out), *(["--probe"] if probe else [])]  # fmt: skip
        log = open(out.with_suffix(f".node{index}.log"), "w")  # noqa: SIM115 (closed below)
        procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        log.close()
    if any(codes) or not out.exists():
        return {"config": config, "failed": codes}
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rates", type=int, nargs="*", default=[400, 100], help="Mbit/s")
    parser.add_argument("--configs", nargs="*", default=["plain", "plain-release", "hpz-release"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=400)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    with TestCluster(2, workdir=args.out / "hosts") as cluster:
        for mbit in [None, *args.rates]:
            shape(cluster, mbit)
            for config in args.configs:
                target = args.out / f"{config}-{mbit or 'unshaped'}.json"
                record = run(cluster, config, args.steps, target, probe=True, timeout=args.timeout)
                record["rate_mbit"] = mbit
                records.append(record)
                times = [s["time_s"] for s in record.get("steps", [])]
                print(f"{mbit or 'unshaped'} Mbit/s {config}: steps {times} {record.get('failed', '')}", flush=True)
                (args.out / "runs.json").write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
        shape(cluster, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
