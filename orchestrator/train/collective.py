"""One all-reduce across every rank of a job, run by the job's own launcher before the model loads.

    torchrun ... -m orchestrator.train.collective --bytes N --iters K --warmup W --timeout S

dzctl's collective check (``orchestrator/preflight/collective.py``) starts this on every
node exactly as it starts the trainer: same launcher, image or Python, environment,
``*_SOCKET_IFNAME`` and network flags. So it fails where the training would, only
minutes earlier and before a model is loaded.

Every rank prints its progress as ``dzctl-collective {json}`` lines (``start``, ``imported``,
``store``, ``group``, ``iter``, ``result`` or ``error``): the controller tells from them the last
step each node reached. Bandwidth is computed as nccl-tests does: ``algbw = bytes /
time``, ``busbw = algbw × 2(n−1)/n`` for an all-reduce over n ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta

MARK = "dzctl-collective "


def bus_factor(world_size: int) -> float:
    """nccl-tests' all-reduce bus-bandwidth factor: what each link carries relative to the data."""
    return 2 * (world_size - 1) / world_size if world_size > 1 else 0.0


class Reporter:
    def __init__(self, rank: int, local_rank: int, node_rank: int) -> None:
        self.fields = {"rank": rank, "local_rank": local_rank, "node_rank": node_rank}
        self.started = time.monotonic()

    def __call__(self, event: str, **fields) -> None:
        record = {"event": event, **self.fields, "t": round(time.monotonic() - self.started, 4), **fields}
        # One write(2) of the whole line: the ranks of a node share one stdout, and print() writes
        # the text and its newline apart (unbuffered), so two ranks' records were glued together
        # on the GPU machine. A line under PIPE_BUF (4 KiB) is written whole into a pipe.
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), (MARK + json.dumps(record) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.train.collective")
    parser.add_argument("--bytes", type=int, required=True, help="all-reduce message size per rank")
    parser.add_argument("--iters", type=int, default=20, help="timed all-reduces, in rounds of --per-round")
    parser.add_argument("--per-round", type=int, default=4, help="all-reduces queued back to back per timed round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the store and the group to form")
    args = parser.parse_args(argv)

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    node_rank = int(os.environ.get("DZCTL_NODE_RANK") or os.environ.get("GROUP_RANK") or 0)
    report = Reporter(rank, local_rank, node_rank)
    report("start", world_size=world, host=socket.gethostname(), pid=os.getpid())
    try:
        return _run(args, rank, world, local_rank, report)
    except Exception as exc:  # the controller reads the reason from the last line
        report("error", error=f"{type(exc).__name__}: {exc}"[:500])
        return 1


def _run(args, rank: int, world: int, local_rank: int, report: Reporter) -> int:
    began = time.monotonic()
    import torch
    import torch.distributed as dist

    # Its own step: on a cold page cache (an image just loaded) this import alone can take a minute.
    report("imported", import_s=round(time.monotonic() - began, 3))

    gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
    backend = "nccl" if gpu else "gloo"
    device = torch.device("cuda", local_rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=args.timeout)

    # The store first, on its own, so "reached the master's store" and "formed the group"
    # are two steps the controller can tell apart. torchrun's agent already serves it on
    # the master port (workers then share it); under `deepspeed --no_ssh` rank 0 hosts it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not agent_store,
        timeout=timeout,
    )
    prefixed = dist.PrefixStore("dzctl-collective", store)
    report("store", master=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")

    started = time.monotonic()
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
    # NCCL connects lazily: the first collective is what forms the communicator.
    one = torch.ones(1, device=device)
    dist.all_reduce(one)
    _sync(gpu)
    report("group", backend=backend, form_s=round(time.monotonic() - started, 4), sum=one.item())

    dtype = torch.bfloat16 if gpu else torch.float32
    numel = max(1, args.bytes // torch.tensor([], dtype=dtype).element_size())
    size = numel * torch.tensor([], dtype=dtype).element_size()
    data = torch.ones(numel, dtype=dtype, device=device)
    for _ in range(args.warmup):
        dist.all_reduce(data)
    _sync(gpu)
    # As nccl-tests times: all-reduces queued back to back, one synchronisation at the end, the
    # time divided by their number. Synchronising after each one (as a first version did) added
    # the launch gap to every 1 ms all-reduce at 256 MiB: 257 GB/s on the H200s instead of ~300.
    # In rounds, so the controller still sees progress (one "iter" line per round).
    per_round = max(1, min(args.per_round, args.iters))
    rounds = max(1, args.iters // per_round)
    total = 0.0
    for index in range(rounds):
        _sync(gpu)
        began = time.perf_counter()
        for _ in range(per_round):
            dist.all_reduce(data)
        _sync(gpu)
        took = time.perf_counter() - began
        total += took
        report("iter", i=index, rounds=rounds, s=round(took / per_round, 6))
    iters = rounds * per_round
    mean = total / iters
    # The group's time is its slowest rank's: an all-reduce ends for everyone at once, but
    # a rank that entered late measured less.
    slowest = torch.tensor([mean], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    group_mean = slowest.item()
    factor = bus_factor(world)
    report(
        "result",
        backend=backend,
        dtype=str(dtype).removeprefix("torch."),
        bytes=size,
        iters=iters,
        warmup=args.warmup,
        world_size=world,
        mean_s=round(mean, 6),
        algbw_gbs=round(size / mean / 1e9, 3),
        busbw_gbs=round(size / mean / 1e9 * factor, 3),
        group_mean_s=round(group_mean, 6),
        group_algbw_gbs=round(size / group_mean / 1e9, 3),
        group_busbw_gbs=round(size / group_mean / 1e9 * factor, 3),
    )
    dist.destroy_process_group()
    return 0


def _sync(gpu: bool) -> None:
    if gpu:
        import torch

        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
