"""What recomputing activations costs, against the fixed cost of a step: the planner's ranking of candidates.

Pure: numbers in, numbers out. Used only to rank candidates that fit (never to predict tokens/s).

Time of one micro-step, in units of the time one token's forward and backward take without
checkpointing (so the numbers carry over between model sizes):

    work(T, N)  = T · (1 + rho · N / L) + C
    floor(N)    = F · (1 + N / (2 L))
    step        = max(work, floor);  cost per token = step / T

* ``rho``: checkpointing every layer runs each layer's forward again, about a third of a layer's
  FLOPs in full fine-tuning; the measured share comes out between 0.3 and 0.42 (the recomputed
  kernels run at the same speed as the first forward, the backward is not faster).
* ``C``: what does not grow with the micro-batch: ZeRO-3's gathers of every parameter for the
  forward and backward, the reduce-scatter, the optimizer step, the launches.
* ``F``: a floor under the step, measured with LoRA: ZeRO-3's per-module hooks run on the CPU,
  once per module for the forward and the backward (and again for a recomputed forward), while the
  GPU has too little work to hide them. LoRA triples the modules (base, A and B per projection),
  so there the floor decides small micro-batches; in full fine-tuning it is under the work from
  micro-batch 4 on.

Fitted (least squares, ``benchmarks/recompute_h200.py --refit``) to the step times measured on one
H200 (``benchmarks/results/recompute-h200x1-20261203/``: Qwen3-8B layer shapes, seq 4096, ZeRO-3,
Liger, bf16). Full fine-tuning, 18 layers, micro-batches 4 to 32 and N = 0, 9, 18: rho 0.42,
C 5,940 tokens (every point within 2 %). LoRA r16 on all 7 projections, 36 layers, micro 8 and 16:
rho 0.30, C 5,380; its steps at micro 2 and 4 do not shrink with the micro-batch (2.0 s without
checkpointing, 2.5 s with half the layers, 3.0 s with all), a floor of about 28,000 token-times.

LoRA with each decoder layer one ZeRO-3 fetch unit (``zero.fetch_unit: layer``, planning/speed/fetchunit.py)
has a cost model of its own: one hook pair per layer instead of 85, so no floor. Fitted the same way to
the grid of ``benchmarks/results/fetchunit2-h200x1-20261204/recompute-lora-grid-lora-layer.json``
(36 layers, micro 2 to 8, N = 0, 6, 14, 36; 14 points, worst within 5.6 %): rho 0.61, C 6,720. Its
micro 2 steps take 0.81-1.13 s against 2.0-3.0 s by module: the floor is gone, and micro 4 without
checkpointing (1.22 s, 13,455 tokens/s) outruns micro 8 with 14 of 36 layers recomputed (2.70 s, 12,143).

The constants are the GPU kind's own where one was measured (``BY_KIND``), else the H200's above. On one
H100 80GB the same LoRA grid by layer (``benchmarks/results/plans-h100x1-20261207/``, 7 points that fit
of micro 2-16 x N = 0, 18, 36; worst within 6.1 %) gives rho 0.37, C 2,030: a third of the H200's fixed
cost in token-times, so small micro-batches without recomputation win there. With the H200's constants
the planner chose micro 16 with 33 of 36 layers recomputed on the H100, the slowest of four launches
(9,799 tokens/s against 12,459 for micro 2 without recomputation, issue 42's table).

Full fine-tuning has a floor too (``FULL_FLOOR_TOKENS``), measured on one H100 80GB: with the 12-layer shape a
micro-step of micro-batch 1 took 0.40 s and one of micro-batch 2 (5 of 12 recomputed) 0.48 s, where the work above
predicts 0.25 s and 0.38 s (``dzctl tune`` of ``benchmarks/results/plans-h100x1-20261207d/tune-full12``: 10,243 and
17,086 tokens/s against 16,589 and 21,306 predicted). Both give the same floor, about 16,000 token-times scaled by
(1 + N / 2L) as LoRA's is: ZeRO-3's hooks, about 15 modules a layer here, once each for the forward, the backward
and a recomputed forward. That is the fit set (``benchmarks/full_floor_fit.py``, ``full-floor-fit.txt`` in
``benchmarks/results/plans-h100x1-20261207e/``); the check set is three other launches on an H100, in another call
(the same folder: micro 1, 2 and the auto plan). The H200's full fine-tuning fit never went below micro-batch 4,
where the floor is under the work at every N, so its launches keep their predictions; no H200 launch checks the
floor.

A floor is host time per layer and micro-step, so in token-times it shrinks as a layer's FLOPs per token grow:
``floor_scale`` divides the floors (full fine-tuning's and LoRA's, both measured on Qwen3-8B's layers at seq 4096)
by the model's layer FLOPs per token over that layer's. A 72B layer (hidden 8192, intermediate 29568) does about
4.2 times the work of an 8B one a token: its floor is about 3,900 token-times, under a micro-batch of 1's work.

Checked on launches through dzctl, fitted on one card and checked on the other (``benchmarks/lora_crosscheck.py``,
``benchmarks/results/plans-h200x1-20261207/lora-crosscheck.txt``): the H100's constants on the four candidates of
``dzctl tune`` on one H200 (micro 4 to 32, 0 to 33 layers recomputed) are within 5.2 % of each; the H200's
constants on the H100's two LoRA launches are off by up to 17.8 % (micro 2 without recomputation: −17.8 %). On
that H200 the planner's own choice (micro 4, none recomputed, 14,071 tokens/s) was the fastest of the four.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..shape import ModelShape


@dataclass(frozen=True)
class StepCosts:
    """The measured constants of one method (see the module docstring), in token-times."""

    rho: float  # recompute share when every layer is checkpointed
    fixed_tokens: float  # C: per micro-step, independent of its size
    floor_tokens: float  # F: the step's floor when the GPU has little work (0: never binding)


# The floor of full fine-tuning by module, fitted on one H100 (above): benchmarks/full_floor_fit.py prints it.
FULL_FLOOR_TOKENS = 16160.0
FULL = StepCosts(rho=0.42, fixed_tokens=5940.0, floor_tokens=FULL_FLOOR_TOKENS)
LORA = StepCosts(rho=0.30, fixed_tokens=5380.0, floor_tokens=28000.0)  # hooks on every sub-module
LORA_BY_LAYER = StepCosts(rho=0.61, fixed_tokens=6720.0, floor_tokens=0.0)  # zero.fetch_unit: layer


# (GPU kind, method, fetch unit) -> the constants measured on that kind; others take the H200's.
BY_KIND: dict[tuple[str, str, str], StepCosts] = {
    ("H100", "lora", "layer"): StepCosts(rho=0.37, fixed_tokens=2030.0, floor_tokens=0.0),
}


def costs_for(method: str, fetch_unit: str = "module", gpu_kind: str | None = None) -> StepCosts:
    """The constants of a method and ZeRO-3 fetch unit (full fine-tuning has one set: its unit is module),
    on ``gpu_kind`` where that kind has its own (``BY_KIND``)."""
    unit = fetch_unit if method == "lora" else "module"
    measured = BY_KIND.get((gpu_kind or "", method if method == "lora" else "full", unit))
    if measured is not None:
        return measured
    if method != "lora":
        return FULL
    return LORA_BY_LAYER if fetch_unit == "layer" else LORA


# The layer the floors were measured on: Qwen3-8B's (hidden 4096, intermediate 12288, 32 query and 8 KV heads of
# 128, q/k norms) at seq 4096, in ModelShape.layer_flops_per_token's terms (tests/test_full_floor.py checks it).
FLOOR_REFERENCE_LAYER_FLOPS = 6 * 192_946_432 + 12 * 32 * 128 * 4096


def floor_scale(shape: ModelShape, seq_len: int) -> float:
    """The factor on a floor for ``shape``'s decoder layer at ``seq_len``: a floor is host time per layer (hooks),
    so in token-times it is smaller where a token's work in a layer is larger."""
    flops = shape.layer_flops_per_token(seq_len)
    return FLOOR_REFERENCE_LAYER_FLOPS / flops if flops > 0 else 1.0


def cost_per_token(
    micro_batch_size: int,
    seq_len: int,
    checkpointed: int,
    num_layers: int,
    costs: StepCosts,
    *,
    floor_scale: float = 1.0,
) -> float:
    """Relative time per token of a micro-step (lower is faster); ``checkpointed`` of ``num_layers`` recompute;
    ``floor_scale``: the model's (``floor_scale()``), 1 for the layer the floors were measured on."""
    tokens = micro_batch_size * seq_len
    share = checkpointed / num_layers if num_layers else 0.0
    work = tokens * (1 + costs.rho * share) + costs.fixed_tokens
    floor = costs.floor_tokens * floor_scale * (1 + share / 2)
    return max(work, floor) / tokens
