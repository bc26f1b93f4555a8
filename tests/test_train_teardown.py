"""A rank that trained to the end leaves no gloo thread to race Python's finalization.

CI twice saw rank 1 of a run that had trained, consolidated and written its `end` event die with
SIGABRT (exit -6, "terminate called without an active exception") at exit, which made torchrun,
and so the node, fail. Left to interpreter finalization, gloo's worker threads can still hold
finished work whose tensors reference Python objects; freeing them then takes the GIL of an
interpreter being torn down, and the process aborts (pytorch/pytorch pull request 179291).
`destroy_process_group` alone does not help: for gloo it only forgets the group, whose threads
serve whoever still holds it (DeepSpeed does). The abort is a rare race, so the test checks its
cause on every rank, after a real ZeRO-3 run: the exit handlers run, and finalization never starts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_train import train

pytestmark = pytest.mark.slow

# Run by torchrun on each rank: the trainer's own `python -m orchestrator.train`, with two witnesses.
WRAPPER = """
import atexit, os, runpy, sys

class Finalized:
    # Freed only by interpreter finalization (a module global of __main__); os.write is bound
    # now because the os module may already be torn down when __del__ runs.
    def __init__(self, path):
        self.fd, self.write = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), os.write
    def __del__(self):
        self.write(self.fd, b"finalized\\n")

witness = Finalized(os.environ["WITNESS_DIR"] + f"/finalized-{os.environ['RANK']}")

def report():
    import torch.distributed as dist

    # One write, newline included: another rank's line cannot land between text and newline.
    sys.stdout.write(f"teardown rank {os.environ['RANK']}: atexit ran, process group alive {dist.is_initialized()}\\n")
    sys.stdout.flush()

atexit.register(report)
sys.argv = ["orchestrator.train", *sys.argv[1:]]
runpy.run_module("orchestrator.train", run_name="__main__", alter_sys=True)
"""


def test_every_rank_runs_its_exit_handlers_and_skips_finalization(tmp_path, monkeypatch):
    wrapper = tmp_path / "train_with_witnesses.py"
    wrapper.write_text(WRAPPER)
    witnesses = tmp_path / "witnesses"
    witnesses.mkdir()
    monkeypatch.setenv("WITNESS_DIR", str(witnesses))
    done = train(tmp_path / "out", "train.max_steps=1", "train.save=false", script=wrapper)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    # Found anywhere in the output, not per line: the ranks' lines share one pipe.
    reports = sorted(re.findall(r"teardown rank (\d+): atexit ran, process group alive (True|False)", done.stdout))
    assert reports == [("0", "False"), ("1", "False")], done.stdout[-3000:]
    # Each rank made its witness file; none was written to, so no rank entered finalization.
    assert sorted(p.name for p in witnesses.iterdir()) == ["finalized-0", "finalized-1"]
    assert [p.read_text() for p in sorted(witnesses.iterdir())] == ["", ""]


def test_every_script_that_runs_the_trainer_on_ranks_ends_them_with_exit_rank():
    # A test or benchmark that wraps the trainer (a script torchrun starts, often written by the
    # test itself) must end its ranks as the trainer's own entry point does; one that ended with
    # sys.exit failed a CI run with the gloo abort above (test_checkpoint_lineage's watch_saves.py).
    root = Path(__file__).resolve().parent.parent
    sources = sorted([*(root / "tests").glob("*.py"), *(root / "benchmarks").glob("*.py")])
    wrappers = [p for p in sources if "entry.main(" in p.read_text(encoding="utf-8")]
    assert wrappers, "no script runs the trainer's entry.main: the check below would pass on nothing"
    missing = [p.relative_to(root).as_posix() for p in wrappers if "exit_rank(" not in p.read_text(encoding="utf-8")]
    assert missing == [], f"these run entry.main on ranks but do not end with entry.exit_rank: {missing}"
