"""Resume with packing continues at the right example: real ZeRO-3, 2 gloo ranks, the tiny job.

One run trains 5 steps straight; another stops after its checkpoint at step 2 and a
third run resumes it (``resume: auto``) to step 5. The packed rows are built again
on resume, so the Trainer's skip of the 2 consumed batches must land on the same
rows as in the straight run: the per-step losses of steps 3-5 then agree (fp32 on
CPU is deterministic run to run). Micro-batch 2 on 2 ranks over ~24 packed rows:
the resume falls in the middle of the first epoch, not at its edge.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.train.progress import read_events

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "tiny-cpu.yaml"
PACKED = ("train.packing=true", "train.max_seq_len=256", "train.micro_batch_size=2", "train.save_steps=2")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def train(output: Path, *sets: str) -> list[dict]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    argv += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    argv += ["-m", "orchestrator.train", str(JOB), "--output-dir", str(output)]
    for item in (*PACKED, *sets):
        argv += ["--set", item]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "dzctl-train: data packed:" in done.stdout
    return read_events(output / "progress.jsonl")


def _losses(events: list[dict]) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def test_resume_with_packing_gives_the_uninterrupted_losses(tmp_path):
    straight = _losses(train(tmp_path / "straight", "train.max_steps=5"))
    interrupted = tmp_path / "interrupted"
    first = train(interrupted, "train.max_steps=2")
    assert (interrupted / "checkpoint-2").is_dir()
    resumed_events = train(interrupted, "train.max_steps=5", "train.resume=auto")[len(first) :]
    resumed = _losses(resumed_events)
    assert sorted(resumed) == [3, 4, 5]
    start = next(e for e in resumed_events if e["event"] == "start")
    assert start["step"] == 2 and start["packing"] is True
    assert _losses(first) == pytest.approx({k: straight[k] for k in (1, 2)}, rel=1e-6)
    assert resumed == pytest.approx({k: straight[k] for k in (3, 4, 5)}, rel=1e-5)
