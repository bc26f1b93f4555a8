"""Measured choices (``dzctl tune``): the calibration's key, its records, and which candidates to measure. Pure.

The step-time model ranks a job's candidates (micro-batch × checkpointed layers) by a cost fitted on
one GPU kind; on another it can rank them backwards (issue 42: on an H100 the model's LoRA choice
ran 27% slower than the fastest of four). ``dzctl tune`` measures the model's top candidates on one
node and keeps the fastest in ``$DZCTL_HOME/calibration.json``; a later plan for the same key uses it
where it still fits and the spec allows it, and says so.

The file's reading and writing are the backends' (``backends/calibrationfile.py``): here only what
its content means.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import InputError
from ..shape import ModelShape
from .steptime import gpu_kind

CPU_KIND = "cpu"
DEFAULT_TOP = 4  # candidates `dzctl tune` measures: the model's top K of the chosen offload level


@dataclass(frozen=True)
class CalibrationKey:
    """What a measurement holds for: a different GPU kind, model, sequence length, method, precision
    or ranks per node can rank the candidates differently."""

    kind: str  # the GPU kind (planning/speed/steptime.py's name where known, else nvidia-smi's) or "cpu"
    shape: str  # shape_fingerprint(): the model's layer sizes, not its name
    seq_len: int
    method: str  # full | lora
    precision: str
    ranks_per_node: int

    def text(self) -> str:
        """The file's key: one readable line."""
        return (
            f"{self.kind}|shape {self.shape}|seq {self.seq_len}|{self.method}|{self.precision}|"
            f"{self.ranks_per_node} per node"
        )


def kind_of(accelerator: str, gpu_name: str | None) -> str | None:
    """The calibration's GPU kind: "cpu", the step-time table's name for a known GPU (an ``nvidia-smi`` name or
    ``--gpu-kind``: ``NVIDIA H100 80GB HBM3`` and ``H100`` are one kind), else the name as given; None: not known."""
    if accelerator == "cpu":
        return CPU_KIND
    if not gpu_name or not gpu_name.strip():
        return None
    known = gpu_kind(gpu_name)
    return known.name if known is not None else gpu_name.strip()


def shape_fingerprint(shape: ModelShape) -> str:
    """The model's sizes (not its name or where they were read): two checkpoints of one architecture share it."""
    sizes = {k: v for k, v in shape.to_dict().items() if k not in ("name", "source")}
    return hashlib.sha256(json.dumps(sizes, sort_keys=True).encode()).hexdigest()[:12]


def key_for(
    shape: ModelShape, *, kind: str, seq_len: int, method: str, precision: str, ranks_per_node: int
) -> CalibrationKey:
    return CalibrationKey(kind, shape_fingerprint(shape), seq_len, method, precision, ranks_per_node)


@dataclass(frozen=True)
class Measured:
    """One candidate as `dzctl tune` ran it: its tokens/s, or why it has none."""

    micro_batch_size: int
    checkpointed_layers: int  # of the model's decoder layers, how many recompute (0: none)
    offload: str
    model_rank: int  # 1: the model's own choice; k: its k-th fastest by the cost model
    tokens_per_s: float | None = None  # median useful tokens/s per rank over the steps after the warm-up
    error: str | None = None  # why it did not run to the end (OOM, crash, timeout)
    predicted_tokens_per_s: float | None = None  # the step-time model's figure for this candidate's own plan

    def to_dict(self) -> dict[str, Any]:
        return {
            "micro_batch_size": self.micro_batch_size,
            "checkpointed_layers": self.checkpointed_layers,
            "offload": self.offload,
            "model_rank": self.model_rank,
            "tokens_per_s": self.tokens_per_s,
            "predicted_tokens_per_s": self.predicted_tokens_per_s,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measured:
        return cls(
            micro_batch_size=int(data["micro_batch_size"]),
            checkpointed_layers=int(data["checkpointed_layers"]),
            offload=str(data["offload"]),
            model_rank=int(data["model_rank"]),
            tokens_per_s=None if data.get("tokens_per_s") is None else float(data["tokens_per_s"]),
            error=data.get("error"),
            predicted_tokens_per_s=(
                None if data.get("predicted_tokens_per_s") is None else float(data["predicted_tokens_per_s"])
            ),
        )

    def words(self, num_layers: int) -> str:
        ckpt = self.checkpointed_layers
        layers = "none" if ckpt == 0 else "all" if ckpt >= num_layers else f"{ckpt} of {num_layers}"
        return f"micro-batch {self.micro_batch_size}, {layers} layers recomputed, offload {self.offload}"


def fastest(measured: list[Measured]) -> Measured | None:
    """The candidate with the most tokens/s (None: none ran); a tie goes to the model's higher rank."""
    ran = [m for m in measured if m.tokens_per_s is not None]
    return max(ran, key=lambda m: (m.tokens_per_s, -m.model_rank)) if ran else None


@dataclass(frozen=True)
class Calibration:
    """One key's record: every candidate measured, and when, where and by which dzctl."""

    key: CalibrationKey
    measured: tuple[Measured, ...]
    measured_at: str  # ISO 8601, UTC
    steps: int
    warmup: int
    dzctl_version: str
    commit: str | None = None

    @property
    def fastest(self) -> Measured | None:
        return fastest(list(self.measured))

    def to_dict(self) -> dict[str, Any]:
        best = self.fastest
        return {
            "key": {
                "kind": self.key.kind,
                "shape": self.key.shape,
                "seq_len": self.key.seq_len,
                "method": self.key.method,
                "precision": self.key.precision,
                "ranks_per_node": self.key.ranks_per_node,
            },
            "candidates": [m.to_dict() for m in self.measured],
            "fastest": best.to_dict() if best else None,
            "measured_at": self.measured_at,
            "steps": self.steps,
            "warmup": self.warmup,
            "dzctl_version": self.dzctl_version,
            "commit": self.commit,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        key = data["key"]
        return cls(
            key=CalibrationKey(
                str(key["kind"]),
                str(key["shape"]),
                int(key["seq_len"]),
                str(key["method"]),
                str(key["precision"]),
                int(key["ranks_per_node"]),
            ),
            measured=tuple(Measured.from_dict(m) for m in data["candidates"]),
            measured_at=str(data["measured_at"]),
            steps=int(data["steps"]),
            warmup=int(data["warmup"]),
            dzctl_version=str(data["dzctl_version"]),
            commit=data.get("commit"),
        )

    def source_line(self) -> str:
        """How a plan that uses it says so."""
        best = self.fastest
        assert best is not None  # a calibration without a measured candidate is never used
        date = self.measured_at[:10]
        return (
            f"from calibration (measured {date} on {self.key.kind}: {best.tokens_per_s:,.0f} tokens/s; "
            f"the model ranked it {ordinal(best.model_rank)})"
        )

    def to_summary(self, num_layers: int) -> dict[str, Any]:
        """``plan --json``'s ``calibration`` object."""
        best = self.fastest
        return {
            "key": self.key.text(),
            "measured_at": self.measured_at,
            "kind": self.key.kind,
            "tokens_per_s": best.tokens_per_s if best else None,
            "model_rank": best.model_rank if best else None,
            "candidates": [m.to_dict() for m in self.measured],
        }


MODEL_LINE = "from the model (no calibration for this GPU kind, model shape, seq_len, method and precision)"


def choice_source_line(plan: Any) -> str:
    """Where a memory plan's micro-batch and checkpointing come from: a ``dzctl tune`` calibration, or the model."""
    return plan.calibration.source_line() if plan.choice_source == "calibration" else MODEL_LINE


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def parse_calibrations(text: str, source: str) -> dict[str, Calibration]:
    """The file's records by key text; a file that is not dzctl's calibration is bad input naming it."""
    fix = f"remove {source} (dzctl tune writes it again)"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{source}:{exc.lineno}: not JSON ({exc.msg})", fix=fix) from None
    if not isinstance(data, dict) or not isinstance(data.get("calibrations"), dict):
        raise InputError(f'{source}: no "calibrations" object: not a dzctl calibration file', fix=fix)
    found = {}
    for name, record in data["calibrations"].items():
        try:
            found[name] = Calibration.from_dict(record)
        except (KeyError, TypeError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            raise InputError(f"{source}: calibrations -> {name}: unreadable ({why})", fix=fix) from None
    return found


def calibrations_text(records: Mapping[str, Calibration]) -> str:
    """The file's content for these records."""
    body = {"calibrations": {name: record.to_dict() for name, record in sorted(records.items())}}
    return json.dumps(body, indent=2) + "\n"


def with_record(records: Mapping[str, Calibration], record: Calibration) -> dict[str, Calibration]:
    """The records with this one in its key's place (a new tune replaces the old measurement)."""
    return {**records, record.key.text(): record}


@dataclass(frozen=True)
class CalibrationInput:
    """What a plan reads of the calibration: the records (read once, like the job's other inputs) and the
    GPU kind of the nodes (None: not known, so no record can apply)."""

    records: Mapping[str, Calibration]
    kind: str | None

    def lookup(self, key: CalibrationKey) -> Calibration | None:
        """The record for this key that has a measured fastest candidate, if any."""
        found = self.records.get(key.text())
        return found if found is not None and found.fastest is not None else None


def tune_candidates(ranked: tuple[Any, ...], model_choice: Any, top: int = DEFAULT_TOP) -> list[Any]:
    """The candidates `dzctl tune` measures: the model's choice first, then the next by its cost ranking,
    ``top`` distinct ones in all (the model's choice may lie outside ``ranked``: the ZeRO settings can move
    the micro-batch after the memory search)."""
    chosen = [model_choice]
    for choice in ranked:
        if len(chosen) >= top:
            break
        if choice not in chosen:
            chosen.append(choice)
    return chosen[:top]
