"""A rank that trained to the end hands Python's teardown no live process group.

CI once saw rank 1 of a run that had trained, consolidated and written its `end` event die with
SIGABRT (exit -6) at exit, which made torchrun, and so the node, fail. Left to interpreter exit,
gloo's worker threads can still hold finished work whose tensors reference Python objects;
freeing them then takes the GIL of an interpreter being torn down, and the process aborts
(pytorch/pytorch pull request 179291 describes this; torch does not clean up by itself). The
abort is a rare race, so the test checks its cause on every rank, after a real ZeRO-3 run.
"""

from __future__ import annotations

import re

import pytest
from test_train import train

pytestmark = pytest.mark.slow

# Run by torchrun on each rank: the trainer's own entry point, then a look at what is left for teardown.
WRAPPER = """
import os, sys
import torch.distributed as dist
from orchestrator.train.entry import main
code = main(sys.argv[1:])
# One write, newline included: print() writes the text and the newline apart, and torchrun's
# prefixed output can put another rank's line between them.
sys.stdout.write(f"teardown rank {os.environ['RANK']}: exit {code}, process group alive {dist.is_initialized()}\\n")
sys.stdout.flush()
sys.exit(code)
"""


def test_every_rank_destroys_its_process_group_before_exit(tmp_path):
    wrapper = tmp_path / "train_then_report.py"
    wrapper.write_text(WRAPPER)
    done = train(tmp_path / "out", "train.max_steps=1", "train.save=false", script=wrapper)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    # Found anywhere in the output, not per line: the ranks' lines share one pipe.
    reports = sorted(re.findall(r"teardown rank (\d+): exit (-?\d+), process group alive (True|False)", done.stdout))
    assert reports == [("0", "0", "False"), ("1", "0", "False")], done.stdout[-3000:]
