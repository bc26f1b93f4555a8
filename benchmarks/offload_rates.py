"""What an offloaded optimizer step costs on one node (issue 42): DeepSpeed's CPU Adam and the pinned PCIe copies.

ZeRO-3 with ``offload_optimizer`` runs AdamW on the host (DeepSpeed's ``DeepSpeedCPUAdam``, the ``cpu_adam``
op) over each rank's fp32 partition, after the gradients came down to pinned host memory, and sends the
16-bit weights back up. Three rates decide that step, and this script measures each on the machine it runs on:

* ``cpu_adam_params_per_s``: ``DeepSpeedCPUAdam.step`` (AdamW mode) over ``--params`` fp32 elements in
  sub-groups of ``--sub-group`` (DeepSpeed's ZeRO-3 default, 1e9), with the node's cores (the op's OpenMP
  threads: ``--threads``, default all); the median of ``--steps`` steps after one warm-up step.
* ``torch_fused_adamw_params_per_s``: torch's own ``AdamW(fused=True)`` (its vectorised CPU kernel) on the
  same tensors: what preflight's probe measures on every node (no op build), and its ratio to the op's rate.
  The two run in interleaved rounds (``--rounds``), so a busy host moves both alike.
* ``d2h_bytes_per_s`` / ``h2d_bytes_per_s``: a pinned host buffer of ``--copy-mib`` to and from the GPU
  (absent without one).

Also the time to load (or JIT-build) the op, which a first offload run pays before its first step.

    python3 benchmarks/offload_rates.py --out DIR          # a GPU node: about a minute once cpu_adam is built
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def adam_rate(step, params: list, grads_of, steps: int) -> tuple[float, list[float]]:
    """Elements per second of ``step()`` over ``params`` (median of ``steps`` after a warm-up)."""
    total = sum(p.numel() for p in params)
    times = []
    for i in range(steps + 1):
        grads_of()
        began = time.perf_counter()
        step()
        if i:
            times.append(time.perf_counter() - began)
    return total / statistics.median(times), [round(t, 4) for t in times]


def copy_rates(mib: int, repeats: int = 5) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    n = mib * 2**20 // 2
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            began = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        out[f"{name}_bytes_per_s"] = round(n * 2 / statistics.median(times[1:]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=2e9, help="fp32 elements stepped (default 2e9)")
    parser.add_argument("--sub-group", type=float, default=1e9, help="elements per sub-group (ZeRO-3's default)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="OpenMP/torch threads (0: all cores)")
    parser.add_argument("--copy-mib", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each optimizer")
    parser.add_argument("--skip-torch", action="store_true", help="leave torch's fused AdamW out")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    result: dict = {"cores": os.cpu_count(), "threads": threads, "params": int(args.params), "torch": torch.__version__}
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name(0)
    result.update(copy_rates(args.copy_mib))
    print(json.dumps(result), flush=True)

    sizes = []
    left = int(args.params)
    while left > 0:
        sizes.append(min(left, int(args.sub_group)))
        left -= sizes[-1]
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.float32)) for n in sizes]

    def grads_of() -> None:
        for p in params:
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.normal_()

    began = time.perf_counter()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    optimizers = {"cpu_adam": DeepSpeedCPUAdam(params, lr=1e-5, adamw_mode=True, weight_decay=0.0)}
    result["cpu_adam_load_s"] = round(time.perf_counter() - began, 1)
    if not args.skip_torch:
        optimizers["torch_fused_adamw"] = torch.optim.AdamW(params, lr=1e-5, fused=True)
    # Interleaved rounds (A B A B ...): a busy or shared host moves both alike, so their ratio holds.
    for _ in range(args.rounds):
        for name, opt in optimizers.items():
            rate, times = adam_rate(opt.step, params, grads_of, args.steps)
            result.setdefault(f"{name}_params_per_s_by_round", []).append(round(rate))
            result.setdefault(f"{name}_step_s", []).extend(times)
    for name in optimizers:
        result[f"{name}_params_per_s"] = round(statistics.median(result[f"{name}_params_per_s_by_round"]))
    if "torch_fused_adamw_params_per_s" in result:
        result["torch_fused_over_cpu_adam"] = round(
            result["torch_fused_adamw_params_per_s"] / result["cpu_adam_params_per_s"], 3
        )
    print(json.dumps(result), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "offload-rates.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
