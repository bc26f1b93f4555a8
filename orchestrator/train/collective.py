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

After the all-reduce it times what ZeRO-3 runs per micro-step: the all-gather (``--gather-bytes``,
the prefetch bucket) and the reduce-scatter (``--reduce-bytes``, the reduce bucket), each with
``busbw = algbw × (n−1)/n`` over the whole gathered/reduced tensor, and each collective's
latency: the mean time of one call on a one-element-per-rank message, where bandwidth plays
no part. They are fields of the same ``result`` line (``all_gather_*``, ``reduce_scatter_*``,
``*_latency_s``); the all-reduce's fields keep their names.
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


def gather_factor(world_size: int) -> float:
    """nccl-tests' factor for all-gather and reduce-scatter: each rank sends/receives (n−1)/n of the tensor."""
    return (world_size - 1) / world_size if world_size > 1 else 0.0


LATENCY_ITERS = 10  # one-element calls: ~0.1 ms each on gloo, ~10 µs on NCCL


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
    parser.add_argument("--gather-bytes", type=int, default=None, help="all-gather size (default: --bytes)")
    parser.add_argument("--reduce-bytes", type=int, default=None, help="reduce-scatter size (default: --bytes)")
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
    zero = _zero_collectives(args, dist, torch, dtype, device, world, gpu, iters)
    # The group's time is its slowest rank's: a collective ends for everyone at once, but
    # a rank that entered late measured less. One MAX over every figure at once.
    names = ["all_reduce_mean_s", *zero]
    slowest = torch.tensor([mean, *zero.values()], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    group = dict(zip(names, slowest.tolist(), strict=True))
    group_mean = group["all_reduce_mean_s"]
    factor = bus_factor(world)
    extra: dict = {}
    for name, nbytes in (
        ("all_gather", zero_bytes(args.gather_bytes, size)),
        ("reduce_scatter", zero_bytes(args.reduce_bytes, size)),
    ):
        nbytes = _rounded(nbytes, world, dtype, torch)
        own, grp = zero[f"{name}_mean_s"], group[f"{name}_mean_s"]
        extra.update(
            {
                f"{name}_bytes": nbytes,
                f"{name}_mean_s": round(own, 6),
                f"{name}_busbw_gbs": round(nbytes / own / 1e9 * gather_factor(world), 3),
                f"{name}_group_mean_s": round(grp, 6),
                f"{name}_group_busbw_gbs": round(nbytes / grp / 1e9 * gather_factor(world), 3),
            }
        )
    for name in ("all_reduce", "all_gather", "reduce_scatter"):
        extra[f"{name}_latency_s"] = round(group[f"{name}_latency_s"], 7)
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
        **extra,
    )
    dist.destroy_process_group()
    return 0


def zero_bytes(given: int | None, default: int) -> int:
    return given if given and given > 0 else default


def _rounded(nbytes: int, world: int, dtype, torch) -> int:
    """The whole tensor's bytes, a whole number of elements per rank (the collectives split it evenly)."""
    element = torch.tensor([], dtype=dtype).element_size()
    return max(1, nbytes // (element * world)) * element * world


def _zero_collectives(args, dist, torch, dtype, device, world: int, gpu: bool, iters: int) -> dict[str, float]:
    """Mean seconds of ZeRO-3's all-gather and reduce-scatter at their sizes, and of one tiny call of each kind."""
    element = torch.tensor([], dtype=dtype).element_size()
    times: dict[str, float] = {}
    for name, given in (("all_gather", args.gather_bytes), ("reduce_scatter", args.reduce_bytes)):
        per_rank = _rounded(zero_bytes(given, args.bytes), world, dtype, torch) // element // world
        times[f"{name}_mean_s"] = _timed(
            _op(name, dist, torch, per_rank, world, dtype, device), iters, args.warmup, gpu
        )
    # Latency: one element per rank, the call's fixed cost (NCCL's ring model's base + per-hop terms).
    one = torch.ones(1, dtype=dtype, device=device)
    tiny = {
        "all_reduce": lambda: dist.all_reduce(one),
        "all_gather": _op("all_gather", dist, torch, 1, world, dtype, device),
        "reduce_scatter": _op("reduce_scatter", dist, torch, 1, world, dtype, device),
    }
    for name, call in tiny.items():
        times[f"{name}_latency_s"] = _timed(call, LATENCY_ITERS, 2, gpu)
    return times


def _op(name: str, dist, torch, per_rank: int, world: int, dtype, device):
    shard = torch.ones(per_rank, dtype=dtype, device=device)
    whole = torch.ones(per_rank * world, dtype=dtype, device=device)
    if name == "all_gather":
        return lambda: dist.all_gather_into_tensor(whole, shard)
    return lambda: dist.reduce_scatter_tensor(shard, whole)


def _timed(call, iters: int, warmup: int, gpu: bool) -> float:
    """Mean seconds per call, queued back to back with one synchronisation at the end (as the all-reduce)."""
    for _ in range(warmup):
        call()
    _sync(gpu)
    began = time.perf_counter()
    for _ in range(max(1, iters)):
        call()
    _sync(gpu)
    return (time.perf_counter() - began) / max(1, iters)


def _sync(gpu: bool) -> None:
    if gpu:
        import torch

        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
