"""From a killed node to training again, through the supervisor: with the same nodes, and on a spare.

    .venv/bin/python benchmarks/recovery_time.py [--repeat 1] [--out DIR]   (as root: it builds test hosts)

Three process-runtime test hosts (tests/testhosts.py: network namespaces, each with its own sshd;
one filesystem, like NFS), the tiny CPU job on node0 + node1 (real ZeRO-3, 2 gloo ranks) with
``restart: {max: 1, backoff_s: 0, spare_hosts: [node2]}`` and one shared output dir. Mid-run,
past a checkpoint, node 1's launcher and ranks are SIGKILLed:

- ``same nodes``: node 1 stays reachable; the restart runs on node0 + node1 again;
- ``spare``: node 1's sshd is stopped right after the kill; its preflight fails and node2 takes
  its place.

Timed from the kill (this machine's clock) to the first ``step`` line of the new attempt in
rank 0's progress.jsonl (the same clock: the hosts share this machine's), with the supervisor's
own ``seconds_to_running`` (failure seen to every node started) beside it. One JSON object per
run is printed and written to DIR/runs.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from test_e2e import Controller, _progress_events  # noqa: E402
from testhosts import TestCluster  # noqa: E402


def one_run(hosts: TestCluster, work: Path, spare: bool) -> dict:
    node0, node1, node2 = hosts.hosts
    work.mkdir(parents=True)
    controller = Controller(hosts, work, "process")
    controller.hostfile = hosts.write_hostfile(work / "hosts.txt", names=[node0.name, node1.name])
    output = f"{controller.remote}/shared/{controller.job}"
    sets = ["restart.max=1", "restart.backoff_s=0", f"restart.spare_hosts=[{node2.name}]",
            f"train.output_dir={output}"]  # fmt: skip
    result = controller.launch("--detach", *[x for s in sets for x in ("--set", s)], steps=100000)
    assert result.returncode == 0, result.stderr[-3000:]
    first_id = controller.job_id()
    progress = Path(output) / "progress.jsonl"
    while True:
        events = [e for e in (_progress_events(progress) if progress.exists() else []) if e["job_id"] == first_id]
        saved = [e["step"] for e in events if e["event"] == "checkpoint"]
        if saved and max((e["step"] for e in events if e["event"] == "step"), default=0) >= saved[-1] + 2:
            break
        time.sleep(0.1)
    killed_at = time.time()
    controller.kill_node(node1)
    if spare:
        hosts.stop_sshd(node1)
    try:
        while True:
            status = controller.status()
            history = (status.get("restarts") or {}).get("history") or []
            events = _progress_events(progress)
            if history and any(e["job_id"] == history[0]["job_id"] and e["event"] == "step" for e in events):
                break
            assert (status.get("restarts") or {}).get("supervisor") != "gave-up", status
            time.sleep(0.5)
        restart = history[0]
        mine = [e for e in events if e["job_id"] == restart["job_id"]]
        first_step = min(e["time"] for e in mine if e["event"] == "step")
        return {
            "scenario": "spare" if spare else "same nodes",
            "kill_to_training_s": round(first_step - killed_at, 1),
            "kill_to_failure_seen_s": round(restart["failed_seen_at"] - killed_at, 1),
            "failure_seen_to_running_s": restart["seconds_to_running"],
            "cause": restart["cause"],
            "replaced": restart["replaced"],
            "resumed_from_step": next(e["step"] for e in mine if e["event"] == "start"),
        }
    finally:
        controller.dzctl("stop", controller.job, "--ssh-config", str(hosts.ssh_config))
        if spare:
            hosts.start_sshd(node1)
        hosts.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="dzctl-recovery-") as tmp, TestCluster(3, workdir=Path(tmp)) as hosts:
        for index in range(args.repeat):
            for spare in (False, True):
                run = one_run(hosts, Path(tmp) / f"run-{index}-{'spare' if spare else 'same'}", spare)
                print(json.dumps(run), flush=True)
                runs.append(run)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))


if __name__ == "__main__":
    main()
