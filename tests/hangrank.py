"""One real gloo rank for tests/test_hang_probe.py: it registers dzctl's stack dump, joins the group, then
either waits in an all_reduce (``--collective``) or blocks reading a FIFO (``--read PATH``)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    from orchestrator.train.hang import stacks

    stacks.prepare(out, "cpu")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    print("ready", flush=True)
    if sys.argv[5] == "--read":
        with open(sys.argv[6], "rb") as fifo:
            fifo.read(1)  # no writer ever writes: blocked here, as on a hung network filesystem
    else:
        dist.all_reduce(torch.ones(4))


if __name__ == "__main__":
    main()
