"""A global batch that does not change with the hardware: ``train.global_batch_size`` or ``train.global_batch_tokens``.

Without either key the global batch is what the hardware makes it: the micro-batch the planner
fits to these GPUs × ``gradient_accumulation_steps`` × the world size (Qwen3-8B on 4 × A100-40GB:
micro 14 × 8 × 4 = 448 rows; on other GPUs another number, and with it another learning-rate
schedule). With one, the planner searches only the micro-batches ``m`` that divide
``rows / world`` and sets accumulation to ``rows / (m × world)``, so that
micro × accumulation × world equals it exactly; among those that fit it keeps the fastest
(the largest, ``search.expected_cost_per_token``). A micro-batch or accumulation the spec fixes
narrows the divisors to one. When no split exists or fits, the job is refused (exit 2) with the
nearest global batches that do split on these ranks.

``train.global_batch_tokens`` counts rows of ``train.max_seq_len`` tokens: a packed row holds up to
that many (its real tokens are the packing efficiency of it), an unpacked one at most that many.

Cost: the divisors of ``rows / world`` (at most a few hundred for any batch of rows) replace the
1..1024 candidates of the plain search, so a fixed global batch plans no slower.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...errors import InputError
from ...spec.job import JobSpec
from .search import Allowed, MemoryPlan


class GlobalBatchImpossible(InputError):
    """The global batch cannot be split into micro × accumulation × world on these ranks. Exit code 2."""


@dataclass(frozen=True)
class GlobalBatch:
    rows: int
    key: str  # the spec key that fixed it: train.global_batch_size or train.global_batch_tokens
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len


def global_batch(spec: JobSpec) -> GlobalBatch | None:
    """The global batch the spec fixes, in rows (None: the hardware decides it, as before)."""
    train = spec.train
    if train.global_batch_size is not None:
        return GlobalBatch(train.global_batch_size, "train.global_batch_size", train.max_seq_len)
    if train.global_batch_tokens is None:
        return None
    seq = train.max_seq_len
    if train.global_batch_tokens % seq:
        below = train.global_batch_tokens // seq * seq
        nearest = ", ".join(str(v) for v in (below, below + seq) if v > 0)
        raise GlobalBatchImpossible(
            f"train.global_batch_tokens {train.global_batch_tokens} is not a whole number of rows of "
            f"train.max_seq_len {seq}",
            fix=f"set train.global_batch_tokens to a multiple of {seq}: nearest {nearest}",
        )
    return GlobalBatch(train.global_batch_tokens // seq, "train.global_batch_tokens", seq)


def fixed_accumulation(spec: JobSpec) -> int | None:
    """``gradient_accumulation_steps`` as the spec wrote it (None: left to the planner with a global batch)."""
    train = spec.train
    return train.gradient_accumulation_steps if "gradient_accumulation_steps" in train.model_fields_set else None


def divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def constrain(allowed: Allowed, batch: GlobalBatch, world: int, accumulation: int | None) -> Allowed:
    """The micro-batches that split ``batch`` exactly on ``world`` ranks (and the fixed values), or the refusal."""
    step = world * (allowed.micro_batch_size or 1) * (accumulation or 1)
    if batch.rows % step:
        fixed = [f"{world} ranks"]
        if allowed.micro_batch_size is not None:
            fixed.append(f"micro-batch {allowed.micro_batch_size}")
        if accumulation is not None:
            fixed.append(f"gradient_accumulation_steps {accumulation}")
        raise GlobalBatchImpossible(
            f"{batch.key}: {_describe(batch)} does not split into micro-batch × accumulation × world size on "
            f"{' and '.join(fixed)}: it is not a multiple of {step}",
            fix=f"set {batch.key} to {_nearest(batch, step)}"
            + ("; or leave train.gradient_accumulation_steps unset" if accumulation is not None else ""),
        )
    per_rank = batch.rows // world
    if allowed.micro_batch_size is not None:
        return allowed
    if accumulation is not None:
        return replace(allowed, micro_batch_size=per_rank // accumulation)
    return replace(allowed, micro_candidates=divisors(per_rank))


def accumulation_for(batch: GlobalBatch, micro: int, world: int) -> int:
    return batch.rows // (micro * world)


def with_batch(plan: MemoryPlan, batch: GlobalBatch) -> MemoryPlan:
    """A fitting plan's accumulation for the fixed global batch at its micro-batch, and the key that fixed it."""
    steps = accumulation_for(batch, plan.choice.micro_batch_size, plan.world_size)
    return replace(plan, gradient_accumulation_steps=steps, global_batch_key=batch.key)


def refuse_unfit(batch: GlobalBatch, world: int, accumulation: int | None, largest_micro: int | None) -> None:
    """No split of the global batch fits memory where an unconstrained micro-batch would: name what does."""
    if largest_micro is None:
        return  # nothing fits at all: the memory refusal (DoesNotFit) says why and names the ways out
    if accumulation is not None:
        fits = largest_micro * accumulation * world
        raise GlobalBatchImpossible(
            f"{batch.key}: {_describe(batch)} needs micro-batch {batch.rows // (accumulation * world)} with "
            f"gradient_accumulation_steps {accumulation} on {world} ranks; the largest that fits is {largest_micro}",
            fix=f"set {batch.key} to at most {_rows_as(batch, fits)}, or leave train.gradient_accumulation_steps unset",
        )


def _describe(batch: GlobalBatch) -> str:
    if batch.key == "train.global_batch_tokens":
        return f"{batch.tokens} tokens ({batch.rows} rows of {batch.seq_len})"
    return f"{batch.rows} rows"


def _rows_as(batch: GlobalBatch, rows: int) -> str:
    return str(rows * batch.seq_len) if batch.key == "train.global_batch_tokens" else str(rows)


def _nearest(batch: GlobalBatch, step: int) -> str:
    below = batch.rows // step * step
    values = [v for v in (below, below + step) if v > 0]
    return " or ".join(_rows_as(batch, v) for v in values) + " (the nearest that split)"
