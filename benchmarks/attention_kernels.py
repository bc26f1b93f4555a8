"""Attention kernels for packed micro-batches: forward+backward time and error, per candidate.

The shape is one attention layer of Qwen3-8B (32 query heads, 8 key/value heads,
head_dim 128, bf16) over one packed micro-batch: ``--rows`` rows of ``--seq``
tokens filled by dzctl's packer (``orchestrator/train/data/packing.py``) with
examples of log-normal lengths (``benchmarks/sft_data.py``: median 500, mean
~700), i.e. exactly what the trainer hands the model with ``train.packing``.

Candidates, on the flattened sequence (batch 1, boundaries in ``cu_seq_lens``):

- ``varlen``: torch.nn.attention.varlen.varlen_attn (dzctl's ``auto`` on CUDA);
- ``flex``: flex_attention with a document-causal BlockMask (compiled);
- ``sdpa_split``: one causal SDPA call per example (PyTorch picks the backend);
- ``sdpa_split_cudnn`` / ``sdpa_split_flash``: the same, forced to cuDNN / flash;
- ``sdpa_mask``: one SDPA call with a dense block-diagonal causal mask;

and on rows kept apart (batch ``--rows``, each padded to ``--seq``):

- ``rows_flex``: flex_attention, per-row document mask, padding masked;
- ``rows_sdpa_mask``: SDPA with a per-row block-diagonal causal mask.

Reference: each example alone through SDPA (causal) in fp32 from the same inputs.
Reported: median fwd+bwd time over ``--iters`` after ``--warmup`` (CUDA events;
wall time on CPU), attention TFLOP/s (causal FLOPs of the examples only: 2·2·n²/2·H·D
forward, ×2.5 for backward), the max abs error of the output and of dq, dk, dv
against the reference, the one-off cost of building a mask for a new batch (paid once
a micro-step, not per layer), and the peak memory the call added.

    python3 benchmarks/attention_kernels.py --out DIR                  # GPU: Qwen3-8B shape, 6 rows of 4096
    python3 benchmarks/attention_kernels.py --tiny --out /tmp/a        # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import sft_data  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from orchestrator.train.data import packing  # noqa: E402
from orchestrator.train.model import attention  # noqa: E402

FLAT = ("varlen", "flex", "sdpa_split", "sdpa_split_cudnn", "sdpa_split_flash", "sdpa_mask")
ROWS = ("rows_flex", "rows_sdpa_mask")


def packed_lengths(rows: int, seq: int, seed: int) -> list[list[int]]:
    """The first ``rows`` rows the packer makes from log-normal examples: each row's example lengths."""
    median = min(500, seq / 8)  # the CPU smoke run's short rows get proportionally short examples
    lengths = sft_data.target_lengths(max(400, rows * 20), seed, median=median, mean=1.4 * median, max_len=seq)
    packed = packing.pack(lengths, seq, seed)
    return [[lengths[i] for i in row] for row in packed[:rows]]


def backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name.endswith("_cudnn"):
        return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
    if name.endswith("_flash"):
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    return contextlib.nullcontext()


_rows_cache: dict = {}


def rows_call(name: str, q, k, v, row_lengths: list[list[int]], seq: int, scale: float):
    """Rows kept apart: (rows, H, seq, D) views of the flattened tensors, padding at each row's end."""
    key = (name, id(row_lengths))
    if key not in _rows_cache:
        seg = torch.full((len(row_lengths), seq), -1, dtype=torch.long, device=q.device)
        for r, lengths in enumerate(row_lengths):
            at = 0
            for i, n in enumerate(lengths):
                seg[r, at : at + n] = i
                at += n
        if name == "rows_flex":
            from torch.nn.attention.flex_attention import create_block_mask

            def document_causal(b, h, q_idx, kv_idx):
                return (seg[b, q_idx] == seg[b, kv_idx]) & (seg[b, q_idx] >= 0) & (q_idx >= kv_idx)

            _rows_cache[key] = create_block_mask(document_causal, len(row_lengths), None, seq, seq, device=q.device)
        else:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
            same = (seg[:, :, None] == seg[:, None, :]) & causal
            same |= torch.eye(seq, dtype=torch.bool, device=q.device)  # pad rows attend to themselves: no NaN
            _rows_cache[key] = same[:, None]
    mask = _rows_cache[key]
    qr, kr, vr = (to_rows(t, row_lengths, seq) for t in (q, k, v))
    if name == "rows_flex":
        if "flex" not in _rows_cache:
            from torch.nn.attention.flex_attention import flex_attention

            _rows_cache["flex"] = torch.compile(flex_attention, dynamic=False)
        out = _rows_cache["flex"](qr, kr, vr, block_mask=mask, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=scale, enable_gqa=True)
    return from_rows(out, row_lengths)


def to_rows(t: torch.Tensor, row_lengths: list[list[int]], seq: int) -> torch.Tensor:
    parts, at = [], 0
    for lengths in row_lengths:
        n = sum(lengths)
        parts.append(F.pad(t[0, :, at : at + n], (0, 0, 0, seq - n)))
        at += n
    return torch.stack(parts)


def from_rows(out: torch.Tensor, row_lengths: list[list[int]]) -> torch.Tensor:
    parts = [out[r, :, : sum(lengths)] for r, lengths in enumerate(row_lengths)]
    return torch.cat(parts, dim=1)[None].transpose(1, 2)


def call(name: str, q, k, v, cu, max_len: int, row_lengths, seq: int, scale: float) -> torch.Tensor:
    """(1, T, H, D) output of one candidate."""
    if name in ROWS:
        return rows_call(name, q, k, v, row_lengths, seq, scale)
    with backend(name):
        kernel = name.removesuffix("_cudnn").removesuffix("_flash")
        return attention.attend(kernel, q, k, v, cu, max_len, scale)


def reference(q, k, v, lengths: list[int], scale: float):
    """Each example alone, causal SDPA in fp32; output (1, T, H, D) and the input grads for ``grad_out``."""
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    outs, at = [], 0
    for n in lengths:
        sl = slice(at, at + n)
        outs.append(
            F.scaled_dot_product_attention(qf[:, :, sl], kf[:, :, sl], vf[:, :, sl], is_causal=True, scale=scale,
                                           enable_gqa=True)
        )  # fmt: skip
        at += n
    return torch.cat(outs, dim=2).transpose(1, 2), (qf, kf, vf)


def timed(fn, warmup: int, iters: int, cuda: bool) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU-sized: 4/2 heads, head_dim 16, fp32, seq 256")
    parser.add_argument("--rows", type=int, default=6, help="rows in the micro-batch (the planner's micro-batch)")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--only", action="append", default=[], help="run only these candidates")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    heads, kv_heads, dim = (4, 2, 16) if args.tiny else (32, 8, 128)
    seq = args.seq or (256 if args.tiny else 4096)
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.tiny:
        args.rows, args.warmup, args.iters = min(args.rows, 3), 1, 2
    row_lengths = packed_lengths(args.rows, seq, seed=0)
    lengths = [n for row in row_lengths for n in row]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    scale = dim**-0.5
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(h):
        return torch.randn(1, h, total, dim, device=device, dtype=dtype, generator=gen)

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    grad_out = torch.randn(1, total, heads, dim, device=device, dtype=dtype, generator=gen)
    ref_out, ref_leaves = reference(q, k, v, lengths, scale)
    ref_out.backward(grad_out.float())
    ref_grads = [t.grad for t in ref_leaves]
    causal_flops = sum(2 * 2 * n * n / 2 * heads * dim for n in lengths) * 3.5  # fwd + bwd (2.5x)
    candidates = args.only or [*FLAT, *ROWS]
    results = []
    for name in candidates:
        record: dict = {"kernel": name}
        try:
            if name == "varlen" and not attention.varlen_available():
                raise RuntimeError("torch.nn.attention.varlen needs CUDA (and torch 2.10+)")
            if name.endswith(("_cudnn", "_flash")) and not cuda:
                raise RuntimeError("a CUDA backend")
            if name == "varlen":
                _fn, _extra, takes_gqa, _scale = attention._varlen_call()
                record["varlen_native_gqa"] = takes_gqa
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

            def step(leaves=leaves, name=name):
                for t in leaves:
                    t.grad = None
                out = call(name, *leaves, cu, max(lengths), row_lengths, seq, scale)
                out.backward(grad_out)
                return out

            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            out = step()
            record["max_err_out"] = float((out.detach().float() - ref_out.detach()).abs().max())
            record["max_err_grad"] = max(
                float((t.grad.float() - g).abs().max()) for t, g in zip(leaves, ref_grads, strict=True)
            )
            times = timed(step, args.warmup, args.iters, cuda)
            median = statistics.median(times)
            record.update(median_ms=round(1000 * median, 3), tflops=round(causal_flops / median / 1e12, 1))
            if cuda:
                record["peak_extra_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
            if name not in ROWS and name in FLAT:
                # A new batch: a new boundaries tensor, so masks and host copies are built again.
                fresh = cu.clone()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                call(name, *leaves, fresh, max(lengths), row_lengths, seq, scale).sum().backward()
                if cuda:
                    torch.cuda.synchronize()
                record["new_batch_ms"] = round(1000 * (time.perf_counter() - t0), 3)
        except Exception as exc:  # a candidate that does not run here is a result, not a crash
            record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        results.append(record)
        print(json.dumps(record), flush=True)
    summary = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "rows": args.rows,
        "seq": seq,
        "examples": len(lengths),
        "tokens": total,
        "row_lengths": row_lengths,
        "warmup": args.warmup,
        "iters": args.iters,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_kernels.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"{len(lengths)} examples, {total} tokens in {args.rows} rows of {seq}; {dtype}, {heads}/{kv_heads} heads")
    print("| kernel | fwd+bwd ms | TFLOP/s | max err out | max err grad | new batch ms | extra GiB |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['kernel']} | {r['error']} |")
            continue
        print(
            f"| {r['kernel']} | {r['median_ms']} | {r['tflops']} | {r['max_err_out']:.2e} | "
            f"{r['max_err_grad']:.2e} | {r.get('new_batch_ms', '-')} | {r.get('peak_extra_gib', '-')} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
