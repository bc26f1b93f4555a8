"""The training itself: DeepSpeed config, model, data and the HF Trainer under ZeRO-3.

Order matters under ZeRO-3: the ``TrainingArguments`` (which carry the DeepSpeed
config and register it globally for transformers) are built *before* the model,
so ``from_pretrained``/``from_config`` run inside ``deepspeed.zero.Init`` and each
rank only ever holds its partition of the weights: the host-RAM blow-up of
loading a 72B model once per rank never happens.

Outputs in ``output_dir``: ``checkpoint-<step>/`` (ZeRO shards, resumable, every
``train.save_steps`` and at the end), ``model/`` (the consolidated Hugging Face
model in safetensors, plus the tokenizer, at the end) and ``progress.jsonl``; with
eval data, ``eval`` events and (``train.save_best``) ``dzctl-best.json`` (see evaluation/runner.py).
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers import set_seed as hf_set_seed

from ..errors import InputError
from ..planning import dsconfig, fusedloss
from ..planning.packing import resolve_packing
from ..planning.speed.fetchunit import resolve_fetch_unit
from ..planning.trackers import tracker_env
from ..spec.job import LoadedJob
from . import checkpoints, gang
from .data import conversations
from .data.collate import PackedCollator
from .data.tokenizer import load_tokenizer
from .datasets import data_summary, load_dataset  # noqa: F401 (data_summary: the data lines, for tests)
from .evaluation.runner import EvalRunner, forward_kwargs
from .hang import stacks
from .hang.timeout import PhaseTimeout, predicted_step_s
from .model import attention, checkpointing, fetchunit, lora, loss
from .preference import stage as pref_stage
from .preference.stage import progress_keys as pref_keys
from .progress import ProgressLog, finite
from .savetimer import save_callbacks

CONSOLIDATED = "model"


@dataclass(frozen=True)
class Ranks:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int = 1
    node_local: bool = False  # train.output_storage: node-local (each node its own output disk)

    @classmethod
    def from_env(cls, node_local: bool = False) -> Ranks:
        # torchrun and the deepspeed launcher both set these; a plain `python -m` run is one rank.
        return cls(
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
            node_local,
        )

    @property
    def marks_folders(self) -> bool:
        """Whether this rank writes the markers of its disk's checkpoints (and rotates and clears them)."""
        return self.local_rank == 0 if self.node_local else self.rank == 0

    @property
    def node_ranks(self) -> list[int]:
        """The global ranks on this node (launchers number them node by node)."""
        first = self.rank - self.local_rank
        return list(range(first, first + self.local_world_size))


@dataclass(frozen=True)
class Settings:
    """Everything the run needs, resolved before torch touches a model."""

    ds_config: dict[str, Any]
    ds_config_source: str
    micro_batch_size: int
    gradient_accumulation_steps: int
    gradient_checkpointing: bool
    precision: str
    output_dir: Path
    packing: bool = False
    # train.gradient_checkpointing: N: only the first N decoder layers recompute (None: all of them).
    checkpointed_layers: int | None = None


def resolve_settings(loaded: LoadedJob, ranks: Ranks, ds_config_path: Path | None, output_dir: Path) -> Settings:
    """The DeepSpeed config (given, beside the job file, or generated) and what the Trainer must agree with."""
    spec = loaded.spec
    on_gpu = torch.cuda.is_available() and spec.accelerator == "gpu"
    resolved = dsconfig.resolve_defaults(spec, bf16_supported=on_gpu and torch.cuda.is_bf16_supported())
    beside = loaded.path.parent / "ds_config.json"
    if ds_config_path is None and beside.is_file():
        ds_config_path = beside
    if ds_config_path is not None:
        try:
            ds = json.loads(ds_config_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"{ds_config_path}: cannot read the DeepSpeed config: {exc}") from None
        if not isinstance(ds, dict):
            raise InputError(f"{ds_config_path}: a DeepSpeed config is a JSON object")
        ds = dsconfig.fill_auto(ds, resolved, ranks.world_size, spec)
        source = str(ds_config_path)
    else:
        ds = dsconfig.job_ds_config(loaded, resolved, ranks.world_size)
        source = "generated from the job spec"
    micro = ds.get("train_micro_batch_size_per_gpu")
    accumulation = ds.get("gradient_accumulation_steps")
    micro = micro if isinstance(micro, int) else resolved.micro_batch_size
    accumulation = accumulation if isinstance(accumulation, int) else spec.train.gradient_accumulation_steps
    total = ds.get("train_batch_size")
    if isinstance(total, int) and total != micro * accumulation * ranks.world_size:
        raise InputError(
            f"{source}: train_batch_size {total} != micro-batch {micro} x accumulation {accumulation} "
            f"x {ranks.world_size} ranks",
            fix='set train_batch_size to "auto" or to the product',
        )
    if spec.train.output_storage == "node-local":
        # DeepSpeed then writes its `latest` tag and model states from each node's
        # local rank 0, not only global rank 0: each node can load its own shards.
        ds = {**ds, "checkpoint": {**ds.get("checkpoint", {}), "use_node_local_storage": True}}
    precision = dsconfig.precision_of(ds)
    if (
        precision == "bf16"
        and spec.accelerator == "gpu"
        and not (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    ):
        raise InputError(
            f"{source}: bf16 asked for, but this GPU has no bf16 (compute capability below 8.0)",
            fix="set train.precision: fp16 (or auto)",
        )
    return Settings(
        ds_config=ds,
        ds_config_source=source,
        micro_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        gradient_checkpointing=resolved.gradient_checkpointing,
        checkpointed_layers=resolved.checkpointed_layers,
        precision=precision,
        output_dir=output_dir,
        packing=resolve_packing(spec),
    )


def prepare_cpu_distributed(timeout: timedelta) -> None:
    """Make accelerate see DeepSpeed over gloo on CPU-only ranks.

    accelerate (1.15) only enters DeepSpeed mode when it finds a GPU-like backend;
    on CPU it leaves ``num_processes`` at 1, and the Trainer then disagrees with
    DeepSpeed about the batch size. So: start DeepSpeed's process group on gloo,
    let accelerate read it as multi-CPU, then mark that shared state as DeepSpeed;
    ``TrainingArguments`` then use this configured state.
    """
    import importlib

    import deepspeed
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (C++, 1.5 to 5
    # minutes on 2 cores, and a compiler in the image) at its first process group.
    # It speeds up CPU inference collectives; training here runs on gloo without it.
    # (importlib: the package attribute deepspeed.comm.torch is torch itself, not the module.)
    ds_comm = importlib.import_module("deepspeed.comm.torch")
    if hasattr(ds_comm, "build_shm_op"):
        ds_comm.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, timeout=timeout)
    state = PartialState(cpu=True, backend="gloo")
    state.distributed_type = DistributedType.DEEPSPEED


def training_arguments(
    loaded: LoadedJob,
    settings: Settings,
    *,
    save: bool,
    group_timeout: timedelta = timedelta(minutes=30),
    stage_arguments: tuple[type, dict[str, Any]] | None = None,
) -> TrainingArguments:
    """``group_timeout``: the process group's at its start (hang/timeout.py; torch's and HF's 30 min by default).

    ``stage_arguments``: a preference stage's TRL config class and its own fields (train/preference/).
    """
    train = loaded.spec.train
    arguments_class, stage_fields = stage_arguments or (TrainingArguments, {})
    on_cpu = loaded.spec.accelerator == "cpu" or not torch.cuda.is_available()
    if on_cpu:
        prepare_cpu_distributed(group_timeout)
    return arguments_class(
        # GPU: HF hands it to accelerate, which starts DeepSpeed's (NCCL) group with it.
        ddp_timeout=int(group_timeout.total_seconds()),
        accelerator_config={"use_configured_state": True} if on_cpu else None,
        # CPU ranks: HF otherwise refuses bf16 (train.precision: bf16, train.pure_bf16) without a bf16 GPU.
        # Nothing else changes for them: the state above is already the CPU's, and no memory is pinned.
        use_cpu=on_cpu,
        output_dir=str(settings.output_dir),
        per_device_train_batch_size=settings.micro_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps,
        num_train_epochs=train.epochs,
        max_steps=train.max_steps,
        learning_rate=train.learning_rate,
        weight_decay=train.weight_decay,
        warmup_steps=train.warmup_ratio if train.warmup_ratio > 0 else 0,  # a float below 1: ratio of all steps
        lr_scheduler_type=train.lr_scheduler,
        bf16=settings.precision == "bf16",
        fp16=settings.precision == "fp16",
        # The ds_config's gradient_clipping (train.max_grad_norm, or the user's config): HF refuses a mismatch.
        max_grad_norm=_clipping(settings.ds_config, train.max_grad_norm),
        **checkpointing.trainer_arguments(settings.gradient_checkpointing, TrainingArguments),
        save_strategy="steps" if save else "no",
        save_steps=train.save_steps,
        # Not the Trainer's: it rotates before dzctl's marker exists. ProgressCallback rotates
        # (train.save_total_limit) once the new checkpoint is marked complete; see checkpoints.rotate.
        save_total_limit=None,
        # Node-local output disks: every node writes the trainer state, RNG and
        # config its ranks need to resume (HF), alongside its ZeRO shards.
        save_on_each_node=train.output_storage == "node-local",
        logging_strategy="steps",
        logging_steps=train.logging_steps,
        report_to=list(train.report_to) or "none",
        disable_tqdm=True,
        # Used when the DeepSpeed config has no "optimizer" section (no optimizer offload):
        # torch's fused AdamW on GPUs (one kernel), the plain one on CPU.
        optim="adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch",
        seed=train.seed,
        deepspeed=settings.ds_config,
        # Our examples carry exactly the model's inputs; nothing to strip.
        remove_unused_columns=False,
        dataloader_num_workers=0,
        **stage_fields,
    )


def _clipping(ds: dict[str, Any], default: float) -> float:
    value = ds.get("gradient_clipping")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


class Collator:
    """Pads a batch to its longest row (rounded up to 8 for tensor cores); pads never count in the loss."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        width = -(-longest // 8) * 8
        if all(len(r["input_ids"]) == width for r in rows):
            # No padding: leave out the attention mask so SDPA can take its causal fast path.
            return {
                "input_ids": torch.tensor([r["input_ids"] for r in rows]),
                "labels": torch.tensor([r["labels"] for r in rows]),
            }
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), conversations.IGNORE, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            ids[i, :n] = torch.tensor(row["input_ids"])
            labels[i, :n] = torch.tensor(row["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def batch_tokens(inputs: dict[str, Any]) -> tuple[int, int, int]:
    """(real tokens, processed tokens, examples) of one micro-batch.

    Processed: every position the model computes, padding included. Real: the
    positions the attention mask keeps (all of them in a packed or unpadded batch).
    Read from the collator's CPU tensors, before the Trainer moves them: no GPU sync.
    """
    if "input_ids" not in inputs:  # TRL's CPO/ORPO batches: each answer's sequences (train/preference/)
        masks = [inputs[f"{side}_attention_mask"] for side in ("chosen", "rejected")]
        return sum(int(m.sum()) for m in masks), sum(m.numel() for m in masks), masks[0].shape[0]
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask")
    real = int(mask.sum()) if mask is not None else ids.numel()
    cu = inputs.get("cu_seq_lens_q")
    examples = len(cu) - 1 if cu is not None else ids.shape[0]
    return real, ids.numel(), examples


class DzTrainer(Trainer):
    """The HF Trainer, counting each rank's real and processed tokens for ``tokens_per_s``."""

    tokens_seen = 0  # real (non-pad) tokens
    processed_seen = 0  # every position computed, padding included
    samples_seen = 0
    lora_base_name: str | None = None  # set for train.method: lora (the adapter's base model)
    lineage: str = ""  # this run's line of checkpoints (see checkpoints.py), set before training
    marks_folders = False  # this rank marks (and clears) the checkpoint folders of its disk
    eval_runner: EvalRunner | None = None  # with eval data: dzctl's per-token eval (evaluation/runner.py)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        stacks.pulse().phase("eval")  # an eval is no step: its own bound (observe/stall.py)
        try:
            if self.eval_runner is None:
                return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
            return self.eval_runner.run(self)
        finally:
            stacks.pulse().resume_steps()

    def save_model(self, output_dir=None, _internal_call=False):
        if self.lora_base_name is None:
            return super().save_model(output_dir, _internal_call)
        # LoRA: gather and write the adapter only, never the whole base (see lora.py).
        folder = Path(output_dir or self.args.output_dir)
        lora.save_adapter(self.model, folder, self.lora_base_name)
        if _internal_call and self.args.should_save:
            # A checkpoint: the base's config and the tokenizer beside the adapter, as the HF Trainer
            # writes them for full fine-tuning, so `dzctl export` can rebuild the model from its shards.
            self.model.get_base_model().config.save_pretrained(str(folder))
            self.processing_class.save_pretrained(str(folder))

    def training_step(self, model, inputs, *args, **kwargs):
        real, processed, examples = batch_tokens(inputs)
        self.tokens_seen += real
        self.processed_seen += processed
        self.samples_seen += examples
        return super().training_step(model, inputs, *args, **kwargs)

    def _save_checkpoint(self, model, trial):
        path = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
        # A folder of this name from an earlier save goes, marker first, before any rank writes into it.
        if self.marks_folders:
            checkpoints.clear_for_rewrite(path, self.lineage)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        # A save that fails (a full disk above all) must not leave a half-written
        # checkpoint-N beside the good ones: see checkpoints.save_failed.
        stacks.pulse().phase("save")
        try:
            super()._save_checkpoint(model, trial)
        except Exception as exc:
            traceback.print_exc()  # the original failure, for the rank's log
            raise checkpoints.save_failed(path, exc) from exc
        stacks.pulse().resume_steps()


class ProgressCallback(TrainerCallback):
    """Turns Trainer events into ``progress.jsonl`` lines (rank 0) and completes checkpoints (all ranks)."""

    def __init__(
        self,
        log: ProgressLog,
        ranks: Ranks,
        *,
        save: bool,
        lineage: str,
        keep: int | None = None,
        start_extra: dict | None = None,
        eval_runner: EvalRunner | None = None,
        checkpointed_layers: int | None = None,
    ) -> None:
        self.log, self.ranks, self.save = log, ranks, save
        self.eval_runner = eval_runner  # names the best checkpoint, which rotation keeps (train.save_best)
        self.checkpointed_layers = checkpointed_layers  # train.gradient_checkpointing: N (None: all or none)
        self.lineage = lineage  # written in every marker; rotation deletes only this line's checkpoints
        self.keep = keep  # train.save_total_limit: complete checkpoints kept (None: all)
        self.start_extra = start_extra or {}  # packing and attention kernel, for the start event
        self.trainer: DzTrainer | None = None
        self.step_times: list[float] = []
        self.last_end: float | None = None
        self.tokens_at_last_end = 0
        self.processed_at_last_end = 0
        self.samples_at_last_end = 0
        self.last_rate: tuple[float, float] | None = None
        self.last_processed_rate: float | None = None
        self.preference = False  # train.stage dpo | kto: TRL's evaluations are written as eval events here
        self.preference_eval: dict[str, Any] = {}  # their data: examples, unit and tokens (pref_stage.eval_fields)

    def _common(self, state) -> dict[str, Any]:
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        return {
            "step": state.global_step,
            "max_steps": state.max_steps,
            "epoch": finite(state.epoch),
            "gpu_mem_peak_gib": round(peak, 3) if peak is not None else None,
        }

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.last_end = time.perf_counter()
        stacks.pulse().phase("first-step")
        if model is not None and self.checkpointed_layers is not None:
            # The Trainer has enabled checkpointing on every layer; keep it on the first N only.
            checkpointing.checkpoint_first(model, self.checkpointed_layers)
        if self.ranks.rank == 0 and model is not None:
            # The Trainer has switched checkpointing on (or not) by now: say what the layers will do.
            on, layers = checkpointing.layers_checkpointed(model)
            print(f"dzctl-train: activation checkpointing in {on} of {layers} decoder layers", flush=True)
        if self.ranks.rank == 0:
            self.log.write("start", **self._common(state), world_size=self.ranks.world_size, **self.start_extra)

    def on_step_end(self, args, state, control, **kwargs):
        # No cuda.synchronize here: an extra sync a step costs throughput. ZeRO-3's
        # step already waits for its reductions, so step-end to step-end wall time
        # is the step's time once the run is steady.
        now = time.perf_counter()
        trainer = self.trainer
        if self.last_end is not None and trainer is not None:
            elapsed = now - self.last_end
            self.step_times.append(elapsed)
            tokens = (trainer.tokens_seen - self.tokens_at_last_end) * self.ranks.world_size
            samples = (trainer.samples_seen - self.samples_at_last_end) * self.ranks.world_size
            processed = (trainer.processed_seen - self.processed_at_last_end) * self.ranks.world_size
            self.last_rate = (tokens / elapsed, samples / elapsed)
            self.last_processed_rate = processed / elapsed
            self.tokens_at_last_end, self.samples_at_last_end = trainer.tokens_seen, trainer.samples_seen
            self.processed_at_last_end = trainer.processed_seen
        stacks.pulse().step_ended(state.global_step, self.step_times[-1] if self.step_times else None)
        self.last_end = now
        if self.save and state.global_step >= state.max_steps:
            # The end always gets a resumable checkpoint, whatever save_steps says.
            control.should_save = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self.ranks.rank == 0 and self.preference and "eval_loss" in logs:
            # A preference stage's evaluation (TRL's evaluate): its loss and reward metrics.
            self.log.write(
                "eval",
                **self._common(state),
                eval_loss=finite(logs["eval_loss"]),
                **self.preference_eval,
                **pref_keys(logs, "eval_"),
            )
        if self.ranks.rank != 0 or "loss" not in logs:
            return
        recent = self.step_times[-10:]
        step_time = sum(recent) / len(recent) if recent else None
        eta = (state.max_steps - state.global_step) * step_time if step_time else None
        tokens_per_s, samples_per_s = self.last_rate or (None, None)
        self.log.write(
            "step",
            **self._common(state),
            loss=finite(logs.get("loss")),
            learning_rate=finite(logs.get("learning_rate")),
            grad_norm=finite(logs.get("grad_norm")),  # before clipping (train.max_grad_norm), as HF logs it
            tokens_per_s=round(tokens_per_s, 1) if tokens_per_s else None,
            samples_per_s=round(samples_per_s, 3) if samples_per_s else None,
            eta_s=round(eta, 1) if eta is not None else None,
            step_time_s=round(self.step_times[-1], 4) if self.step_times else None,
            **token_rates(tokens_per_s, self.last_processed_rate),
            **pref_keys(logs),  # train.stage dpo | kto: rewards, reward accuracy and margin, KTO's KL
        )

    def on_save(self, args, state, control, **kwargs):
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        try:
            self._complete(path, state)
        except Exception as exc:
            # The marker could not be written (disk full), or a rank waiting here saw
            # a peer fail its save: the same cleanup and cause as in DzTrainer._save_checkpoint.
            traceback.print_exc()
            raise checkpoints.save_failed(path, exc) from exc

    def _complete(self, path: Path, state) -> None:
        # Every rank has written its shards and RNG state only once all reach here.
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        world, step, lineage = self.ranks.world_size, state.global_step, self.lineage
        if self.ranks.node_local:
            # Each node's disk holds its own ranks' shards: its local rank 0 vouches for them.
            if self.ranks.local_rank == 0 and path.is_dir():
                checkpoints.write_latest_tag(path)
                checkpoints.write_marker(path, world, step, self.ranks.node_ranks, lineage=lineage)
        elif self.ranks.rank == 0 and path.is_dir():
            checkpoints.write_marker(path, world, step, lineage=lineage)
        pending = self.eval_runner.pending_best if self.eval_runner else None
        best = {"best": True} if pending is not None and pending.step == step else {}
        if self.ranks.rank == 0 and path.is_dir():
            self.log.write("checkpoint", **self._common(state), path=str(path), **best)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        # Every node has marked it now: only then may it be named the best, and older ones go
        # (by the rank that marks this folder).
        protect = self.eval_runner.checkpoint_complete(path, step) if self.eval_runner else None
        if self.keep and self.ranks.marks_folders and checkpoints.inspect(path).complete:
            checkpoints.rotate(path.parent, self.keep, lineage, protect=protect)


def end_eval_keys(runner: EvalRunner | None, output_dir: Path) -> dict[str, Any]:
    """The ``end`` event's eval keys: the last eval, the best, where early stopping ended the run."""
    if runner is None:
        return {}
    last = runner.last or {}
    keys: dict[str, Any] = {
        "eval_loss": last.get("eval_loss"),
        "eval_tokens": last.get("eval_tokens"),
        "best_eval_loss": runner.history.best_loss,
        "best_step": runner.history.best_step,
        "stopped_early": runner.stopped_early_at is not None,
    }
    if runner.best is not None:
        keys["best_checkpoint"] = str(output_dir / runner.best.checkpoint)
    return keys


def token_rates(real_per_s: float | None, processed_per_s: float | None) -> dict[str, float | None]:
    """The extra progress keys beside ``tokens_per_s`` (real tokens): processed tokens and their ratio."""
    efficiency = real_per_s / processed_per_s if real_per_s and processed_per_s else None
    return {
        "processed_tokens_per_s": round(processed_per_s, 1) if processed_per_s else None,
        "padding_efficiency": round(efficiency, 4) if efficiency is not None else None,
    }


def global_batch_fields(spec, settings: Settings, ranks: Ranks) -> dict[str, Any]:
    """The start event's global batch: rows per optimizer step, and whether the spec fixes it."""
    rows = settings.micro_batch_size * settings.gradient_accumulation_steps * ranks.world_size
    fixed = spec.train.global_batch_size is not None or spec.train.global_batch_tokens is not None
    return {"global_batch_size": rows, "global_batch_fixed": fixed}


def global_batch_note(spec, settings: Settings, ranks: Ranks) -> str:
    """The global batch as the log says it: fixed by the spec, or what this hardware made it."""
    fields = global_batch_fields(spec, settings, ranks)
    how = "fixed by train.global_batch_size/_tokens" if fields["global_batch_fixed"] else "depends on the hardware"
    return f"global batch {fields['global_batch_size']} rows ({how})"


def model_config(loaded: LoadedJob):
    """The architecture: ``model.config`` (random init with ``model_type``) or the named model's, overridden."""
    model_spec = loaded.spec.model
    overrides = dict(model_spec.config or {})
    model_type = overrides.pop("model_type", None) if model_spec.init == "random" else None
    if model_type is not None:
        config = AutoConfig.for_model(model_type, **overrides)
    else:
        config = AutoConfig.from_pretrained(model_spec.name_or_path, **overrides)
    config.use_cache = False  # the KV cache is for generation; training only wastes memory on it
    return config


def build_model(loaded: LoadedJob, config, precision: str, attn_implementation: str | None = None):
    """Random weights for ``model.init: random``, else ``from_pretrained``.

    Called after the ``TrainingArguments`` exist, so both paths run under ZeRO-3's
    ``zero.Init`` (weights partitioned as they are created or loaded).
    """
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    attention = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if loaded.spec.model.init == "random":
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **attention)
    return AutoModelForCausalLM.from_pretrained(loaded.spec.model.name_or_path, config=config, dtype=dtype, **attention)


def _check_vocab(config, tokenizer_size: int, loaded: LoadedJob) -> None:
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and tokenizer_size > vocab:
        raise InputError(
            f"{loaded.where('model')}: the tokenizer has {tokenizer_size} tokens but the model's vocab_size is "
            f"{vocab}: ids past it would index outside the embedding",
            fix=f"set model.config.vocab_size to at least {tokenizer_size}",
        )


def resolve_fused_loss(loaded: LoadedJob, config) -> str:
    """``train.fused_loss`` for this model (``auto`` as the planner resolves it), checked before any weight loads."""
    choice = loaded.spec.train.fused_loss
    model_type = getattr(config, "model_type", None)
    resolved = fusedloss.resolve(choice, accelerator=loaded.spec.accelerator, model_type=model_type)
    where = loaded.where("train.fused_loss")
    loss.require_model_type(resolved, model_type, where)
    loss.require_available(resolved, where)
    return resolved


def expected_shapes(model) -> dict[str, list[int]]:
    """Full shapes of the model's parameters; under ZeRO-3 the local tensors are empty placeholders."""
    shapes = {}
    for name, param in model.named_parameters():
        shape = getattr(param, "ds_shape", None) or param.shape
        shapes[name] = list(shape)
    return shapes


def gather_memory_peaks() -> list[list[float]] | None:
    """Every rank's peak GPU memory (allocated, reserved; GiB), for the end event. A collective: all ranks call it."""
    if not torch.cuda.is_available():
        return None
    mine = [round(torch.cuda.max_memory_allocated() / 2**30, 3), round(torch.cuda.max_memory_reserved() / 2**30, 3)]
    if not torch.distributed.is_initialized():
        return [mine]
    gathered: list[list[float] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    return gathered  # type: ignore[return-value]


def _agree_on_resume(resume, output_dir: Path) -> tuple[checkpoints.Checkpoint | None, str]:
    """All ranks resume from one step, whatever each node's own disk holds (see checkpoints.agree_on_resume).

    Returns it with the run's lineage: the resumed checkpoint's, or for a fresh
    start rank 0's new id (every rank must write the same one into its markers).
    """
    proposal = checkpoints.new_lineage()
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return resume, resume.lineage if resume else proposal
    gathered: list[tuple[int | None, str] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (resume.step if resume else None, proposal))
    import socket

    steps = [entry[0] for entry in gathered]  # type: ignore[index]
    chosen = checkpoints.agree_on_resume(resume, steps, output_dir, socket.gethostname())
    return chosen, chosen.lineage if chosen else gathered[0][1]  # type: ignore[index]


def _already_complete(finished: checkpoints.Finished, ranks: Ranks, log: ProgressLog) -> Path:
    """A relaunch of a run that trained to its end: say so and train nothing (see checkpoints.finished_run)."""
    if ranks.rank == 0:
        print(
            f"dzctl-train: already complete: {finished.step} steps, model at {finished.model}; nothing to train "
            "(a larger train.max_steps continues this run, a new train.output_dir starts a fresh one)",
            flush=True,
        )
        log.write(
            "end",
            step=finished.step,
            max_steps=finished.step,
            eta_s=0.0,
            path=finished.model,
            already_complete=True,
        )
    return Path(finished.model)


def train(
    loaded: LoadedJob, *, output_dir: Path, ds_config_path: Path | None, save: bool, log: ProgressLog
) -> Path | None:
    """Run the job; return the consolidated model folder (``None`` when saving is off)."""
    spec = loaded.spec
    ranks = Ranks.from_env(node_local=spec.train.output_storage == "node-local")
    start = checkpoints.resume_candidate(spec.train.resume, output_dir)
    finished = checkpoints.finished_run(start, spec.train.max_steps, spec.train.epochs, model_here=ranks.rank == 0)
    if finished is not None:
        return _already_complete(finished, ranks, log)
    from .environment import announce_op_builds

    announce_op_builds()  # a DeepSpeed op's JIT build (cpu_adam: minutes) says what it builds and its seconds
    settings = resolve_settings(loaded, ranks, ds_config_path, output_dir)
    universal = (spec.zero.overrides.get("checkpoint") or {}).get("load_universal") is True
    resume = checkpoints.check_resume(
        start,
        spec.train.resume,
        output_dir,
        ranks.world_size,
        load_universal=universal,
        max_steps=spec.train.max_steps,
    )
    if ranks.rank == 0:
        print(
            f"dzctl-train: {ranks.world_size} ranks, micro-batch {settings.micro_batch_size}, "
            f"accumulation {settings.gradient_accumulation_steps}, {settings.precision}, "
            f"gradient checkpointing {settings.gradient_checkpointing}, DeepSpeed config {settings.ds_config_source}, "
            f"resume from {resume.path if resume else 'nothing (fresh start)'}; "
            f"{global_batch_note(spec, settings, ranks)}",
            flush=True,
        )
    # Tokenizer, architecture and data first: a bad row or vocabulary fails in
    # seconds, before any process group starts or any weight is loaded.
    tokenizer = load_tokenizer(spec.model.tokenizer, spec.model.name_or_path)
    config = model_config(loaded)
    _check_vocab(config, len(tokenizer), loaded)
    fused_loss = resolve_fused_loss(loaded, config)
    if ranks.rank == 0:
        print(f"dzctl-train: loss {fused_loss} (train.fused_loss: {spec.train.fused_loss})", flush=True)
    preference = spec.train.stage != "sft"
    if preference:  # dpo | kto: the node's mapped cache of encoded rows, TRL's trainers (train/preference/)
        dataset, eval_dataset = pref_stage.load_data(loaded, tokenizer, ranks, settings.output_dir)
    else:
        dataset, eval_dataset = load_dataset(loaded, tokenizer, settings, ranks, config.vocab_size, log)
    for key, value in tracker_env(spec.train.report_to, str(output_dir), os.environ.get("DZCTL_JOB_ID", "run")).items():
        os.environ.setdefault(key, value)  # the job's own launch.env wins (a tracking server, online wandb)
    # The group's timeout follows the phase (hang/timeout.py): long while the model loads, minutes in training.
    timeouts = PhaseTimeout(spec.stall.model_dump(), predicted_step_s(), ranks.rank)
    stacks.pulse().listen(timeouts.phase)
    # Before the model: registers ZeRO-3 for zero.Init.
    reference = pref_stage.reference_for(loaded, config, ranks.world_size, settings.ds_config) if preference else None
    if reference is not None and ranks.rank == 0:
        print(f"dzctl-train: stage {pref_stage.describe(loaded, reference)}", flush=True)
    stage_arguments = pref_stage.arguments(loaded, reference, eval_dataset is not None) if reference else None
    args = training_arguments(
        loaded, settings, save=save, group_timeout=timeouts.start_timeout(), stage_arguments=stage_arguments
    )
    gang.start_watchdog()  # the process group exists now: watch the other nodes (see gang.py)
    resume, lineage = _agree_on_resume(resume, output_dir)
    if ranks.rank == 0 and save:
        how = f"continued from step {resume.step}" if resume else "new"
        print(f"dzctl-train: checkpoint line {lineage} ({how}) in {output_dir}", flush=True)
    hf_set_seed(spec.train.seed)  # every rank creates the same random weights before partitioning
    stacks.pulse().phase("model-load")
    packed = settings.packing and not spec.data.synthetic and not preference  # TRL pads its own batches
    kernel = attention.choose_kernel() if packed else None
    model = build_model(loaded, config, settings.precision, attention.register(kernel) if kernel else None)
    # Before the adapters wrap it (Liger patches the base model's own modules), and before
    # the Trainer, which reads the forward's signature.
    if not preference:  # TRL computes its log-probs through its own fused LM head
        loss.apply_fused_loss(model, fused_loss)
    if spec.train.method == "lora":
        model = lora.wrap(model, loaded)
        if ranks.rank == 0:
            trainable, total = lora.trainable_summary(model)
            print(f"dzctl-train: LoRA: {trainable:,} of {total:,} parameters train", flush=True)
    _, params_offloaded = dsconfig.offload_of(settings.ds_config)
    if resolve_fetch_unit(spec.zero.fetch_unit, spec.train.method, params_offloaded) == "layer":
        leaves = fetchunit.fetch_by_layer(model)
        if ranks.rank == 0:
            print(f"dzctl-train: ZeRO-3 fetches by decoder layer ({leaves} leaf modules; zero.fetch_unit)", flush=True)
    used = f"{attention.NAME}/{kernel}" if kernel else str(model.config._attn_implementation)
    if ranks.rank == 0:
        print(f"dzctl-train: packing {packed}, attention {used}", flush=True)
    collator = PackedCollator() if packed else Collator(tokenizer.pad_token_id)
    runner = None
    if eval_dataset is not None and not preference:
        stopping = spec.train.early_stopping
        runner = EvalRunner(
            eval_dataset,
            collator,
            log,
            rank=ranks.rank,
            world_size=ranks.world_size,
            micro=settings.micro_batch_size,
            eval_steps=spec.train.eval_steps,
            patience=stopping.patience if stopping else None,
            min_delta=stopping.min_delta if stopping else 0.0,
            save=save,
            save_best=spec.train.save_best,
            lineage=lineage,
            marks_folders=ranks.marks_folders,
            output_dir=output_dir,
            forward=forward_kwargs(model, fused_loss),
        )
    callback = ProgressCallback(
        log,
        ranks,
        save=save,
        lineage=lineage,
        keep=spec.train.save_total_limit,
        start_extra={"packing": packed, "attention": used, **global_batch_fields(spec, settings, ranks)},
        eval_runner=runner,
        checkpointed_layers=settings.checkpointed_layers if settings.gradient_checkpointing else None,
    )
    callbacks = [callback, *save_callbacks(spec.train.save_minutes, save), *([runner] if runner else [])]
    if preference:
        callback.preference = True
        callback.preference_eval = pref_stage.eval_fields(eval_dataset, spec.train.stage) if ranks.rank == 0 else {}
        ref_model = None
        if reference == "frozen-copy":
            hf_set_seed(spec.train.seed)  # random init: the copy's weights are the policy's first ones
            ref_model = build_model(loaded, config, settings.precision)
        trainer = pref_stage.make_trainer(
            loaded, DzTrainer, model, ref_model, args, dataset, eval_dataset, tokenizer, callbacks
        )
    else:
        trainer = DzTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=collator,
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    callback.trainer = trainer
    trainer.lineage, trainer.marks_folders, trainer.eval_runner = lineage, ranks.marks_folders, runner
    stopped_early = None  # the step early stopping ended the run at, once it has
    if spec.train.method == "lora":
        trainer.lora_base_name = lora.base_name(loaded, output_dir)
    result = trainer.train(resume_from_checkpoint=str(resume.path) if resume else None)
    stopped_early = runner.stopped_early_at if runner else None
    if stopped_early is not None and ranks.rank == 0:
        print(f"dzctl-train: early stopping ended the run at step {stopped_early} (train.early_stopping)", flush=True)
    final_dir = None
    if save and spec.train.method == "lora":
        final_dir = lora.save_outputs(trainer, loaded, output_dir, ranks.rank)
    elif save:
        final_dir = output_dir / CONSOLIDATED
        if ranks.rank == 0:  # a 72B model takes minutes here: say so, for the watcher's view
            print(f"dzctl-train: consolidating the model into {final_dir} (gathering the ZeRO-3 shards)", flush=True)
        consolidating = time.perf_counter()
        stacks.pulse().phase("save")
        trainer.save_model(str(final_dir))  # gathers the ZeRO-3 partitions (16-bit) on rank 0
        if ranks.rank == 0:
            tokenizer.save_pretrained(str(final_dir))
            checkpoints.check_consolidated(final_dir, expected_shapes(trainer.model))
            print(f"dzctl-train: model consolidated in {time.perf_counter() - consolidating:.1f} s", flush=True)
    if final_dir is not None:
        # Rank 0 has checked the model: only now may a relaunch call this run finished.
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        if ranks.marks_folders:
            checkpoints.write_finished(
                output_dir,
                lineage=lineage,
                step=trainer.state.global_step,
                max_steps=spec.train.max_steps,
                epochs=spec.train.epochs,
                model=final_dir,
                stopped_early=stopped_early is not None,
            )
    peaks = gather_memory_peaks()
    if ranks.rank == 0:
        state = trainer.state
        step_times = callback.step_times
        mean = sum(step_times) / len(step_times) if step_times else None
        log.write(
            "end",
            step=state.global_step,
            max_steps=state.max_steps,
            epoch=finite(state.epoch),
            loss=finite(getattr(result, "training_loss", None)),
            learning_rate=None,
            tokens_per_s=round(trainer.tokens_seen * ranks.world_size / sum(step_times), 1) if mean else None,
            **token_rates(
                trainer.tokens_seen * ranks.world_size / sum(step_times) if mean else None,
                trainer.processed_seen * ranks.world_size / sum(step_times) if mean else None,
            ),
            samples_per_s=round(trainer.samples_seen * ranks.world_size / sum(step_times), 3) if mean else None,
            gpu_mem_peak_gib=callback._common(state)["gpu_mem_peak_gib"],
            eta_s=0.0,
            path=str(final_dir) if final_dir else None,
            step_times_s=[round(t, 4) for t in step_times],
            # Per rank: [max_memory_allocated, max_memory_reserved] in GiB, rank order.
            gpu_mem_peak_gib_per_rank=peaks,
            **end_eval_keys(runner, output_dir),
        )
    if math.isnan(getattr(result, "training_loss", 0.0) or 0.0):
        raise RuntimeError("training loss is NaN")
    gang.finish()  # this node's part is done: its silence from now on is not a failure
    stacks.pulse().phase("done")
    return final_dir
