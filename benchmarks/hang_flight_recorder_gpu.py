"""One-rank NCCL job on a GPU: the hang evidence path of issue 45 (flight recorder dumped on demand, the stack).

    OUT=/some/dir python benchmarks/hang_flight_recorder_gpu.py

Starts one rank (a child process) that sets up its rank files as the trainer does
(``orchestrator.train.hang.stacks.prepare``: SIGUSR1 stack dump, ``TORCH_NCCL_TRACE_BUFFER_SIZE``,
``TORCH_NCCL_DEBUG_INFO_PIPE_FILE``), forms an NCCL process group, runs a few all_reduces and
then waits. The parent probes it with the controller's node-side code (``runtimes/rankprobe.py``):
its /proc state, its Python stack (SIGUSR1) and the flight recorder through the debug pipe. The
rank files and the probe's JSON are copied under ``$OUT/hang-flight-recorder/``. Exit 0 when the
dump was written and unpickles with at least one entry.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RANK = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from orchestrator.train.hang import stacks
stacks.prepare(Path({out!r}), "gpu")
import torch, torch.distributed as dist
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
x = torch.ones(1 << 20, device="cuda")
for _ in range(5):
    dist.all_reduce(x)
torch.cuda.synchronize()
print("ready", flush=True)
time.sleep(600)
"""


def main() -> int:
    from orchestrator.runtimes import rankprobe

    out = Path(os.environ.get("OUT", "/tmp/hang-out")) / "hang-flight-recorder"
    work = out / "output"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29555", "DZCTL_JOB_ID": "gpu-fr"}  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", RANK.format(root=str(ROOT), out=str(work))], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = child.stdout.readline().strip()
        if line != "ready":
            print(child.stderr.read()[-4000:], file=sys.stderr)
            return 1
        time.sleep(1)
        files = work / "dzctl-ranks" / "gpu-fr"
        found = rankprobe.probe_rank(child.pid, files, wait_s=30)
        found["gpus"] = rankprobe.gpu_utilization()
        (out / "probe.json").write_text(json.dumps(found, indent=1))
        trace = found.get("nccl_trace") or {}
        print(json.dumps({k: found[k] for k in ("rank", "state", "stack_via", "nccl_trace", "gpus")}, indent=1))
        if not trace.get("ok"):
            return 1
        dump = pickle.loads(Path(trace["path"]).read_bytes())
        entries = dump.get("entries", []) if isinstance(dump, dict) else []
        print(f"flight recorder: {len(entries)} entries; last: "
              f"{[(e.get('profiling_name'), e.get('collective_seq_id')) for e in entries[-3:]]}")  # fmt: skip
        return 0 if entries else 1
    finally:
        child.kill()
        child.wait(timeout=30)
        if (work / "dzctl-ranks").exists():
            # The rank's NCCL debug pipe is a FIFO, which copytree refuses (it did on the H100).
            skip_pipes = shutil.ignore_patterns("*.pipe")
            shutil.copytree(work / "dzctl-ranks", out / "dzctl-ranks", dirs_exist_ok=True, ignore=skip_pipes)


if __name__ == "__main__":
    sys.exit(main())
