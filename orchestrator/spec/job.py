"""The job spec (schema v1): pydantic models, loading, ``--set`` overrides.

Every key is validated at load time; an error names the file, the line and the
key path, and suggests the closest known key for a typo. Later issues extend
the schema with new keys; existing keys are never renamed.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ..errors import SpecError
from . import foreign
from .keymap import Conversion
from .recovery import NotifySpec, RestartSpec, StallSpec
from .yamlsource import KeyPath, LineMap, load_yaml_with_lines

SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|KEY", re.IGNORECASE)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Docker container names allow [a-zA-Z0-9][a-zA-Z0-9_.-]; job names become part of them.
JOB_NAME = r"^[a-z0-9][a-z0-9_.-]{0,62}$"


class _Strict(BaseModel):
    # extra="forbid": an unknown key is an error, never silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    name_or_path: str = Field(min_length=1)
    init: Literal["pretrained", "random"] = "pretrained"
    # Hugging Face config values: the whole architecture for a random-init model
    # (with ``model_type``), or overrides of the named model's config.
    config: dict[str, Any] | None = None
    tokenizer: str | None = None


# The benchmark source: random full-length rows made on the nodes (orchestrator/train/data/conversations.py),
# so there is no file to ship and nothing to pack.
SYNTHETIC_DATA = "synthetic:random"


DataFormat = Literal["alpaca", "messages", "sharegpt", "text"]
# The fields each format reads; ``columns`` renames them (``{instruction: prompt}``: the instruction
# is in the row's ``prompt`` column). The row formats themselves: orchestrator/planning/datarows.py.
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "alpaca": ("instruction", "input", "output", "system", "history", "chosen", "rejected", "kto_tag"),
    # chosen, rejected, kto_tag, prompt, label, completion: train.stage dpo | kto (planning/preference/rows.py).
    "messages": (
        *("messages", "role", "content", "reasoning_content", "tools"),
        *("prompt", "chosen", "rejected", "label", "completion"),
    ),
    "sharegpt": (
        *("conversations", "from", "value", "system", "reasoning_content", "tools"),
        *("chosen", "rejected", "kto_tag"),
    ),
    "text": ("text",),  # continued pretraining: every token trained
}
HUB_PREFIX = "hf:"


class KeyedValueError(ValueError):
    """A section's check that concerns one of its keys: the error is located at that key, not the section.

    A section's own validator (``data``) is reported by pydantic at the section; a problem with
    ``data.columns`` must name ``data.columns``'s line, or the ``--set data.columns=...`` it came from.
    """

    def __init__(self, key: KeyPath, message: str) -> None:
        super().__init__(message)
        self.key = key


def _check_columns(columns: dict[str, str], fmt: str, key: KeyPath | None = None) -> None:
    """``columns`` against the fields of ``fmt``; ``key``: where they were written, relative to the section."""
    known = FORMAT_FIELDS[fmt]

    def refused(problem: str) -> ValueError:
        return KeyedValueError(key, problem) if key is not None else ValueError(f"columns: {problem}")

    for name, column in columns.items():
        if name not in known:
            raise refused(f"{name!r} is not a field of format {fmt} (its fields: {', '.join(known)})")
        if not column:
            raise refused(f"{name!r} maps to an empty column name")


class SharegptTags(_Strict):
    """LLaMA-Factory's sharegpt ``tags``: the key of a turn's role and text, and each role's name."""

    role_tag: str = Field("from", min_length=1)
    content_tag: str = Field("value", min_length=1)
    user_tag: str = Field("human", min_length=1)
    assistant_tag: str = Field("gpt", min_length=1)
    observation_tag: str = Field("observation", min_length=1)  # a tool's result
    function_tag: str = Field("function_call", min_length=1)  # the assistant's tool call
    system_tag: str = Field("system", min_length=1)


TrainOnEos = Literal["turn", "last", "all", "none"]
TRAINABLE_ROLES = ("system", "user", "assistant", "tool")


class TurnTraining(_Strict):
    """Which turns of a conversation carry loss (axolotl's chat_template keys); the defaults train the answers."""

    # Roles whose turns are trained (axolotl's roles_to_train); None: assistant turns.
    roles_to_train: list[Literal["system", "user", "assistant", "tool"]] | None = None
    # Which end-of-turn tokens are trained: each trained turn's (turn), the last one's, every turn's, none.
    train_on_eos: TrainOnEos | None = None
    # A per-turn boolean key of the row's turns that decides that turn (axolotl's message_field_training);
    # None: the key ``train`` where a turn has it.
    message_field_training: str | None = Field(None, min_length=1)


class DataSource(TurnTraining):
    """One data set of ``data.sources``: where it is, its format, its share of the mix."""

    # A file (.json array, .jsonl, .parquet), a folder of ``datasets.save_to_disk``, or
    # ``hf:ORG/NAME[:SPLIT]`` (read from the nodes' Hugging Face datasets cache).
    path: str = Field(min_length=1)
    format: DataFormat | None = None  # None: data.format
    columns: dict[str, str] | None = None  # None: data.columns
    # The mix: each source's share of the rows is weight / sum(weights) (see train/data/mix.py).
    weight: float = Field(1.0, gt=0)
    max_rows: int | None = Field(None, ge=1)  # the first N rows of this source
    tags: SharegptTags | None = None  # None: data.tags (format sharegpt)
    # Written by ``dzctl launch`` into the job file it ships: the path as the user gave it,
    # so that an error on the node names the user's file rather than the node's copy.
    shipped_from: str | None = None


class EvalDataSpec(_Strict):
    """``data.eval``: evaluation rows of their own, in the forms of the training data (one path, or sources)."""

    path: str | None = Field(None, min_length=1)
    format: DataFormat | None = None  # None: data.format
    columns: dict[str, str] | None = None  # None: data.columns
    max_rows: int | None = Field(None, ge=1)
    sources: list[DataSource] | None = Field(None, min_length=1)
    shipped_from: str | None = None  # as DataSource.shipped_from, for data.eval.path

    @model_validator(mode="after")
    def _one_form(self) -> EvalDataSpec:
        if (self.path is None) == (self.sources is None):
            raise ValueError(
                "give data.eval.path (one data set) or data.eval.sources (a list of them), not both"
                if self.path
                else "data.eval.path is missing: give data.eval.path (one data set) or data.eval.sources"
            )
        if SYNTHETIC_DATA in (self.path, *(s.path for s in self.sources or ())):
            raise ValueError("synthetic:random has nothing to evaluate on: give a data file")
        return self


def _no_bool(value: Any) -> Any:
    # pydantic would read true as the row count 1.
    if isinstance(value, bool):
        raise ValueError("must be a fraction between 0 and 1 or a row count, not true/false")
    return value


def _check_eval_split(value: float | int | None) -> float | int | None:
    # A fraction of the rows, or a count of them: 1.0 would be every row, 0 none.
    if isinstance(value, float) and not 0 < value < 1:
        raise ValueError("must be a fraction between 0 and 1 (0.05: 5% of the rows) or a row count of at least 1")
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        raise ValueError("must be a row count of at least 1, or a fraction between 0 and 1")
    return value


def _dataset_names(value: Any) -> Any:
    # LLaMA-Factory writes ``dataset: identity,alpaca_en_demo``: one string, names split at commas.
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return value


MixStrategy = Literal["weights", "concat", "interleave_under", "interleave_over"]


class DataSpec(TurnTraining):
    # One source (the first form, kept): data.path with data.format. Or several: data.sources. Or
    # LLaMA-Factory's registry: data.dataset_info (dataset_info.json or its folder) with data.dataset
    # (names in it), expanded into data.sources when the job is loaded (spec/registry.py).
    path: str | None = Field(None, min_length=1)
    format: DataFormat = "alpaca"
    columns: dict[str, str] = Field(default_factory=dict)
    max_rows: int | None = Field(None, ge=1)
    on_error: Literal["fail", "skip"] = "fail"
    sources: list[DataSource] | None = Field(None, min_length=1)
    shipped_from: str | None = None  # as DataSource.shipped_from, for data.path
    tags: SharegptTags | None = None  # format sharegpt: LLaMA-Factory's tags (role and text keys, role names)
    dataset_info: str | None = Field(None, min_length=1)
    dataset: Annotated[list[str] | None, BeforeValidator(_dataset_names)] = Field(None, min_length=1)
    # How the sources mix (train/data/mix.py): weights (data.sources' default: each source's share is its
    # weight), concat (data.dataset's default: every row of each, as LLaMA-Factory), interleave_under /
    # interleave_over (shares from data.interleave_probs, stopping at the first / last source used up).
    mix_strategy: MixStrategy | None = None
    interleave_probs: list[Annotated[float, Field(gt=0)]] | None = Field(None, min_length=1)
    # Where the nodes keep tokenized data (train/data/cache.py). None: <output_dir>/data-cache.
    cache_dir: str | None = None
    # The chat template (planning/chattemplate.py): auto (the tokenizer's own) | chatml | plain | PATH.jinja.
    template: str = Field("auto", min_length=1)
    # Passed to the template as enable_thinking (Qwen3's switch); auto: not passed (README: reasoning rows).
    enable_thinking: Union[bool, Literal["auto"]] = "auto"  # noqa: UP007
    # Written by dzctl launch: a PATH.jinja template's text, so the nodes need no copy of the file.
    template_text: str | None = None
    # Evaluation (orchestrator/train/data/holdout.py): rows of the training data held out (a
    # fraction, or a count), or data of its own (data.eval). Not both.
    eval_split: Annotated[int | float | None, BeforeValidator(_no_bool), AfterValidator(_check_eval_split)] = None
    eval: EvalDataSpec | None = None

    @model_validator(mode="after")
    def _one_form(self) -> DataSpec:
        if (self.dataset is None) != (self.dataset_info is None):
            key = "dataset_info" if self.dataset_info is None else "dataset"
            raise KeyedValueError(
                (key,),
                f"data.dataset and data.dataset_info go together: data.{key} is missing "
                "(data.dataset_info: dataset_info.json or its folder; data.dataset: names in it)",
            )
        if self.dataset is not None and (self.path is not None or self.sources is not None):
            raise ValueError("give data.dataset (with data.dataset_info), data.path or data.sources: one of them")
        if self.dataset is None and (self.path is None) == (self.sources is None):
            raise ValueError(
                "give data.path (one data set) or data.sources (a list of them, each with path:), not both"
                if self.path
                else "data.path is missing: give data.path (one data set) or data.sources (a list of them)"
            )
        if self.interleave_probs is not None and not (self.mix_strategy or "").startswith("interleave"):
            raise KeyedValueError(
                ("interleave_probs",),
                "data.interleave_probs needs data.mix_strategy: interleave_under or interleave_over",
            )
        count = len(self.dataset or self.sources or ())
        if self.interleave_probs is not None and self.sources is not None and len(self.interleave_probs) != count:
            raise KeyedValueError(
                ("interleave_probs",),
                f"data.interleave_probs has {len(self.interleave_probs)} values for {count} sources",
            )
        if self.path == SYNTHETIC_DATA and (self.columns or self.max_rows):
            key = "columns" if self.columns else "max_rows"
            raise KeyedValueError((key,), "synthetic:random takes neither columns nor max_rows")
        _check_columns(self.columns, self.format, ("columns",))
        for index, source in enumerate(self.sources or ()):
            if source.path == SYNTHETIC_DATA:
                raise ValueError("synthetic:random is a data.path of its own, not one of data.sources")
            _check_columns(source.columns or {}, source.format or self.format, ("sources", index, "columns"))
        if self.eval_split is not None and self.eval is not None:
            raise ValueError("give data.eval_split (rows held out of the training data) or data.eval, not both")
        if self.eval_split is not None and self.synthetic:
            raise ValueError("synthetic:random has no rows to hold out: give data.eval with a data file")
        for source in self.eval_sources():
            _check_columns(source.columns or {}, source.format or self.format)
        return self

    @field_validator("enable_thinking", mode="before")
    @classmethod
    def _thinking_is_a_bool(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "auto":
            raise ValueError("must be true, false or auto")
        return value

    @field_validator("cache_dir")
    @classmethod
    def _cache_dir_is_absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError("must be an absolute path on the nodes")
        return value

    @property
    def synthetic(self) -> bool:
        return self.path == SYNTHETIC_DATA

    @property
    def has_eval(self) -> bool:
        return self.eval_split is not None or self.eval is not None

    def eval_sources(self) -> list[DataSource]:
        """``data.eval``'s sources with format and columns filled in (from data.eval, else data); [] without it."""
        held = self.eval
        if held is None:
            return []
        fmt = held.format or self.format
        columns = dict(self.columns if held.columns is None else held.columns)
        # data.tags and the per-turn training keys read the eval rows as they read the training rows.
        reading = {
            key: getattr(self, key) for key in ("tags", "roles_to_train", "train_on_eos", "message_field_training")
        }
        if held.sources is None:
            assert held.path is not None
            return [
                DataSource(
                    path=held.path,
                    format=fmt,
                    columns=columns,
                    max_rows=held.max_rows,
                    shipped_from=held.shipped_from,
                    **reading,
                )
            ]
        return [
            s.model_copy(
                update={
                    "format": s.format or fmt,
                    "columns": dict(columns if s.columns is None else s.columns),
                    **{key: value for key, value in reading.items() if getattr(s, key) is None},
                }
            )
            for s in held.sources
        ]

    def all_sources(self) -> list[DataSource]:
        """Every source with data.format / data.columns filled in (``data.path`` is one source)."""
        inherited = ("tags", "roles_to_train", "train_on_eos", "message_field_training")
        if self.sources is None:
            assert self.path is not None, "data.dataset is expanded into data.sources at load (spec/registry.py)"
            return [
                DataSource(
                    path=self.path,
                    format=self.format,
                    columns=dict(self.columns),
                    max_rows=self.max_rows,
                    shipped_from=self.shipped_from,
                    **{key: getattr(self, key) for key in inherited},
                )
            ]
        # data.interleave_probs are the sources' shares of an interleave (LLaMA-Factory's), in their order.
        probs = self.interleave_probs or [s.weight for s in self.sources]
        return [
            s.model_copy(
                update={
                    "format": s.format or self.format,
                    "columns": dict(self.columns if s.columns is None else s.columns),
                    "weight": weight,
                    **{key: getattr(self, key) for key in inherited if getattr(s, key) is None},
                }
            )
            for s, weight in zip(self.sources, probs, strict=True)
        ]

    @property
    def mix(self) -> str:
        """``mix_strategy`` resolved: weights for data.sources, concat for data.dataset."""
        return self.mix_strategy or ("concat" if self.dataset is not None else "weights")


# Attention and MLP projections of the Llama/Qwen/Mistral families (HF module names).
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSpec(_Strict):
    """``train.lora``: the adapters of ``train.method: lora`` (PEFT's LoraConfig)."""

    r: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0)
    # 0: PEFT's LoraConfig and LLaMA-Factory (hparams/finetuning_args.py, LoraArguments) default to
    # none. Any dropout is an element-wise pass over, and a saved copy and mask of, every adapted
    # projection's input; measured on one H200 it pushed LoRA on Qwen3-8B into checkpointing at a
    # smaller micro-batch (issue 29). Set it for small data sets where adapters overfit.
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_DEFAULT_TARGETS), min_length=1)
    # Also write merged full weights (base + scaled B·A) in ``model/`` beside the adapter.
    merge: bool = False


class EarlyStoppingSpec(_Strict):
    """``train.early_stopping``: stop after ``patience`` evals that beat the best eval loss by no more than
    ``min_delta`` (the rule of HF's EarlyStoppingCallback, whose defaults these are)."""

    patience: int = Field(1, ge=1)
    min_delta: float = Field(0.0, ge=0)


class TrainSpec(_Strict):
    # full: every weight trains. lora: the base weights stay frozen (bf16, partitioned)
    # and only low-rank adapters train; see orchestrator/train/model/lora.py.
    method: Literal["full", "lora"] = "full"
    lora: LoraSpec = Field(default_factory=LoraSpec)
    max_seq_len: int = Field(2048, ge=8)
    micro_batch_size: Union[Annotated[int, Field(ge=1)], Literal["auto"]] = "auto"  # noqa: UP007
    gradient_accumulation_steps: int = Field(1, ge=1)
    # A global batch that does not change with the hardware (planning/memory/globalbatch.py): rows, or
    # tokens (rows of max_seq_len) per optimizer step; the planner picks micro-batch and accumulation.
    global_batch_size: int | None = Field(None, ge=1)
    global_batch_tokens: int | None = Field(None, ge=1)
    epochs: float = Field(1.0, gt=0)
    max_steps: int = Field(-1, ge=-1)  # -1: run ``epochs`` over the data
    learning_rate: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.0, ge=0, le=1)
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup"] = "cosine"
    precision: Literal["bf16", "fp16", "fp32", "auto"] = "auto"
    # true: DeepSpeed keeps the master weights, gradients and AdamW's m and v in bf16 (its
    # bf16_master_weights_and_grads and bf16_optimizer_states): 10 bytes a trained parameter
    # on the GPUs instead of 16, for bf16's rounding of every update (LLaMA-Factory's pure_bf16,
    # axolotl's bf16: full and bfloat16). Needs bf16 precision and keeps the optimizer on the GPUs (no
    # zero.offload of it); LoRA's adapters may take it too (docs/memory-planner.md).
    pure_bf16: bool = False
    # true: every decoder layer recomputes its activations; N: the first N (selective); auto: the
    # planner picks N with the micro-batch (planning/speed/recompute.py).
    gradient_checkpointing: Union[bool, Annotated[int, Field(ge=0)], Literal["auto"]] = "auto"  # noqa: UP007
    save_steps: int = Field(500, ge=1)
    # Also save when this many minutes have passed since the last save (rank 0's clock decides for all).
    save_minutes: float | None = Field(None, gt=0)
    # false: no checkpoints and no final weights (throughput runs through dzctl launch;
    # the trainer's --no-save). A 72B model's end-of-run save alone takes minutes and ~1 TB.
    save: bool = True
    save_total_limit: int | None = Field(2, ge=1)
    logging_steps: int = Field(1, ge=1)
    # HF Trainer integrations, written on rank 0's node under output_dir (see trackers.py).
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)
    # None: ``<launch.remote_dir>/output/<name>`` on every node, stable across
    # relaunches so ``resume: auto`` finds the checkpoints.
    output_dir: str | None = None
    # Whether the nodes' output dirs are one shared filesystem or each node's own
    # disk. auto: `dzctl launch` finds out (a probe file written on node 0, looked
    # for on the others); a plain trainer run takes shared. node-local makes every
    # node keep the checkpoint metadata its own ranks need to resume.
    output_storage: Literal["auto", "shared", "node-local"] = "auto"
    resume: str = Field("auto", min_length=1)  # auto | never | PATH
    seed: int = 42
    # Several examples per row of max_seq_len (orchestrator/train/data/packing.py).
    # auto: on for GPU jobs, off on CPU and for synthetic:random.
    packing: Union[bool, Literal["auto"]] = "auto"  # noqa: UP007
    # The loss without the full logits (orchestrator/planning/fusedloss.py): auto = liger on GPUs, chunked on CPU.
    fused_loss: Literal["auto", "liger", "chunked", "none"] = "auto"
    # Evaluation (docs/evaluation.md): every eval_steps and once at the end, on data.eval_split or data.eval.
    eval_steps: int | None = Field(None, ge=1)
    early_stopping: EarlyStoppingSpec | None = None
    save_best: bool = False  # keep the checkpoint of the best eval loss out of rotation (dzctl-best.json)
    # The ds_config's gradient_clipping (the global gradient norm's bound); 0: no clipping.
    max_grad_norm: float = Field(1.0, ge=0)
    # Preference training (docs/preference.md), LLaMA-Factory's keys and defaults. sft: the rows'
    # answers are targets. dpo: rows with a chosen and a rejected answer (pref_loss: sigmoid/ipo need
    # the reference policy, orpo/simpo none). kto: unpaired answers labelled good or bad.
    stage: Literal["sft", "dpo", "kto"] = "sft"
    pref_loss: Literal["sigmoid", "ipo", "orpo", "simpo"] = "sigmoid"
    pref_beta: float = Field(0.1, gt=0)  # DPO/KTO's beta; ORPO's lambda (odds-ratio weight); SimPO's beta
    pref_ftx: float = Field(0.0, ge=0)  # weight of an SFT term on the chosen answers (DPO only)
    simpo_gamma: float = Field(0.5, ge=0)  # SimPO's target reward margin
    kto_chosen_weight: float = Field(1.0, gt=0)  # KTO's weight of the desirable answers' loss
    kto_rejected_weight: float = Field(1.0, gt=0)  # ... and of the undesirable ones'

    @field_validator("gradient_checkpointing", "packing", mode="before")
    @classmethod
    def _no_strings_for_bools(cls, value: Any, info: Any) -> Any:
        # pydantic would take "yes"/"1" as True; a spec should say true/false/auto.
        if isinstance(value, str) and value != "auto":
            if info.field_name == "gradient_checkpointing":
                raise ValueError("must be true, false, auto or a number of layers")
            raise ValueError("must be true, false or auto")
        if info.field_name == "packing" and isinstance(value, (int, float)) and not isinstance(value, bool):
            raise ValueError("must be true, false or auto")
        if isinstance(value, float):
            raise ValueError("must be true, false, auto or a whole number of layers")
        return value

    @model_validator(mode="after")
    def _one_global_batch(self) -> TrainSpec:
        if self.global_batch_size is not None and self.global_batch_tokens is not None:
            raise ValueError("give train.global_batch_size (rows) or train.global_batch_tokens, not both")
        return self

    @model_validator(mode="after")
    def _preference_keys_fit_the_stage(self) -> TrainSpec:
        # A key of another stage would be read by nothing: refused, naming the stage that reads it. At its
        # default it changes nothing, and the job.yaml `dzctl launch` ships writes every key out.
        fields = type(self).model_fields
        given = {key for key in self.model_fields_set if getattr(self, key) != fields[key].default}
        readers = {
            "pref_loss": ("dpo",),
            "pref_ftx": ("dpo",),
            "simpo_gamma": ("dpo",),
            "pref_beta": ("dpo", "kto"),
            "kto_chosen_weight": ("kto",),
            "kto_rejected_weight": ("kto",),
        }
        for key, stages in readers.items():
            if key in given and self.stage not in stages:
                raise KeyedValueError(
                    (key,),
                    f"train.{key} is read by train.stage: {' or '.join(stages)}; this job's stage is {self.stage} "
                    f"(set train.stage: {stages[0]}, or remove train.{key})",
                )
        if "simpo_gamma" in given and self.pref_loss != "simpo":
            raise KeyedValueError(
                ("simpo_gamma",), f"train.simpo_gamma is read by pref_loss: simpo; this job's is {self.pref_loss}"
            )
        if self.pref_ftx and self.pref_loss == "orpo":
            raise KeyedValueError(
                ("pref_ftx",), "pref_loss: orpo's loss holds its SFT term already (remove train.pref_ftx)"
            )
        return self


class ZeroSpec(_Strict):
    stage: Literal[3] = 3
    # nvme: ZeRO-Infinity, parameters and optimizer states swapped to ``nvme_path``.
    offload: Literal["none", "optimizer", "all", "nvme", "auto"] = "auto"
    # A folder on a fast local disk of every node (the same path on each), for
    # ``offload: nvme``; with ``offload: auto`` it lets the planner try NVMe last.
    nvme_path: str | None = None
    config: str | None = None  # path to a user ds_config.json (may hold "auto")
    overrides: dict[str, Any] = Field(default_factory=dict)
    # What ZeRO-3 gathers and releases as one unit. ``layer``: each decoder layer is a
    # ZeRO-3 leaf module, so its weights come in one gather and one hook pair runs per
    # layer. ``module``: DeepSpeed's default, hooks on every sub-module (a LoRA layer has
    # 85, most of them tiny adapters), whose host time can leave the GPU idle. auto: layer
    # for LoRA, module for full fine-tuning and where the weights are offloaded
    # (planning/speed/fetchunit.py says why).
    fetch_unit: Literal["auto", "layer", "module"] = "auto"

    @field_validator("nvme_path")
    @classmethod
    def _nvme_path_is_absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError("must be an absolute path on the nodes")
        return value

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> ZeroSpec:
        if self.offload == "nvme" and self.nvme_path is None:
            raise ValueError("offload: nvme needs zero.nvme_path (a folder on a local NVMe disk of every node)")
        return self


def _env_text(value: Any) -> Any:
    # YAML reads `PORT: 80` as an int; the environment only holds text.
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return value


def _env_value_fits_env_file(value: str) -> str:
    if "\n" in value or "\0" in value:
        raise ValueError("the value holds a newline or NUL, which env files cannot carry")
    return value


def _check_mount(value: str) -> str:
    parse_mount(value)
    return value


def _check_env_name(name: str) -> str:
    if not ENV_NAME.match(name):
        raise ValueError("not a valid variable name: use letters, digits and _, not starting with a digit")
    return name


EnvName = Annotated[str, AfterValidator(_check_env_name)]
EnvValue = Annotated[str, BeforeValidator(_env_text), AfterValidator(_env_value_fits_env_file)]
Mount = Annotated[str, AfterValidator(_check_mount)]


class LaunchSpec(_Strict):
    master_addr: str = Field("auto", min_length=1)
    master_port: int = Field(29500, ge=1024, le=65535)
    launcher: Literal["torchrun", "deepspeed"] = "torchrun"
    env: dict[EnvName, EnvValue] = Field(default_factory=dict)
    env_file: str | None = None
    mounts: list[Mount] = Field(default_factory=list)
    # /var/tmp survives reboots (FHS) and is writable by any user. ``{host}`` is
    # replaced by the node's host name, for nodes that share one filesystem.
    remote_dir: str = "/var/tmp/dzctl"
    python: str = "python3"  # the interpreter for ``runtime: process``

    @field_validator("env", mode="before")
    @classmethod
    def _env_keys_are_text(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, str):
                    # YAML 1.1 reads unquoted ON/YES/NO/1 as booleans or numbers.
                    raise ValueError(f"variable name {key!r} was read by YAML as {type(key).__name__}: quote it")
        return value

    @field_validator("remote_dir")
    @classmethod
    def _remote_dir_is_absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must be an absolute path on the nodes")
        return value


# What the slurm: keys (and their launch --slurm options) may hold. Each value is written on an
# #SBATCH line, which sbatch reads itself (blanks split it, quotes and "#" are its syntax, a line
# break starts the script's next line): so a value is held to the form Slurm gives it, checked the
# same way whether it came from the spec or the command line (slurm_value_problem).
SLURM_FORMS: dict[str, tuple[str, str]] = {
    "partition": (
        r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*",
        "a partition name (letters, digits, _ . -), or several separated by commas",
    ),
    "account": (r"[A-Za-z0-9_.-]+", "an account name (letters, digits, _ . -)"),
    "time": (
        r"[0-9]+(:[0-9]{1,2}){0,2}|[0-9]+-[0-9]+(:[0-9]{1,2}){0,2}|(?i:unlimited|infinite)",
        "a time limit as sbatch --time takes it: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, "
        "DAYS-HOURS, DAYS-HOURS:MINUTES, DAYS-HOURS:MINUTES:SECONDS or UNLIMITED",
    ),
}


def slurm_value_problem(key: str, value: str) -> str | None:
    """What is wrong with ``value`` for the slurm key ``key`` (its allowed form), or None."""
    pattern, form = SLURM_FORMS[key]
    return None if re.fullmatch(pattern, value) else f"must be {form}"


def _slurm_form(key: str) -> AfterValidator:
    def check(value: str | None) -> str | None:
        problem = None if value is None else slurm_value_problem(key, value)
        if problem:
            raise ValueError(problem)
        return value

    return AfterValidator(check)


def _one_printable_line(value: str | None) -> str | None:
    if value is not None and not value.isprintable():
        raise ValueError("must be one line of printable text (a path, no line breaks or control characters)")
    return value


class SlurmSpec(_Strict):
    """Where ``dzctl launch --slurm`` asks Slurm for nodes (each key also a ``launch --slurm`` option)."""

    partition: Annotated[str | None, _slurm_form("partition")] = None
    nodes: int = Field(1, ge=1)
    gpus_per_node: int | None = Field(None, ge=1)  # default: the GPU job's slots (1 for a CPU job)
    time: Annotated[str | None, _slurm_form("time")] = None
    account: Annotated[str | None, _slurm_form("account")] = None
    # pyxis: the trainer runs in the job's image through `srun --container-image` (enroot), no docker.
    container: Literal["none", "pyxis"] = "none"
    # Each GPU's memory for the memory planner: the job is planned before Slurm picks the nodes.
    gpu_mem_gib: float | None = Field(None, gt=0)
    # The Python with dzctl that the allocation's own steps run (node wrapper, preflight); it must be
    # at this path on every node (a shared filesystem). Default: the interpreter that submits.
    python: Annotated[str | None, AfterValidator(_one_printable_line)] = None


class JobSpec(_Strict):
    version: Literal[1] = 1
    name: str = Field(pattern=JOB_NAME)
    # A docker reference (name[:tag][@digest], or an image ID) starts with a letter or
    # digit. One starting with "-" would sit where `docker run` still reads options
    # and turn into one (`--privileged`), so it is refused here.
    image: str = Field("dzctl:latest", pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")
    runtime: Literal["docker", "process"] = "docker"
    accelerator: Literal["gpu", "cpu"] = "gpu"
    model: ModelSpec
    data: DataSpec
    train: TrainSpec = Field(default_factory=TrainSpec)
    zero: ZeroSpec = Field(default_factory=ZeroSpec)
    launch: LaunchSpec = Field(default_factory=LaunchSpec)
    slurm: SlurmSpec | None = None  # launch through Slurm (sbatch) instead of over SSH to a hostfile
    restart: RestartSpec | None = None  # unattended restarts after a fault (backends/recovery)
    notify: NotifySpec | None = None  # a webhook told of failed / restarted / succeeded
    stall: StallSpec = Field(default_factory=StallSpec)  # when running ranks count as hung (observe/stall.py)


def parse_mount(mount: str) -> tuple[str, str, str]:
    """``HOST:CONTAINER[:ro|rw]`` → (host, container, mode); ValueError if malformed."""
    parts = mount.split(":")
    if len(parts) == 2:
        parts.append("rw")
    if len(parts) != 3 or parts[2] not in ("ro", "rw"):
        raise ValueError(f"{mount!r}: expected HOST_PATH:CONTAINER_PATH[:ro|rw]")
    if not (parts[0].startswith("/") and parts[1].startswith("/")):
        raise ValueError(f"{mount!r}: both paths must be absolute")
    return parts[0], parts[1], parts[2]


@dataclass(frozen=True)
class LoadedJob:
    """A validated spec plus where it came from, for located errors later on."""

    spec: JobSpec
    path: Path
    lines: LineMap
    overrides: tuple[str, ...] = ()
    # The file was a LLaMA-Factory or axolotl YAML: what it became, key by key (spec/foreign.py).
    converted: Conversion | None = None

    def where(self, dotted: str) -> str:
        """``file:line`` of a key (or ``--set`` when an override set it)."""
        for item in self.overrides:
            if item.split("=", 1)[0] == dotted:
                return f"--set {shown_override(item)}"
        return self.lines.where(tuple(dotted.split(".")))

    def resolve_local(self, value: str) -> Path:
        """A path from the spec, relative to the job file's folder."""
        candidate = Path(value).expanduser()
        return candidate if candidate.is_absolute() else self.path.parent / candidate


def load_job(
    path: str | Path,
    overrides: tuple[str, ...] | list[str] = (),
    runtime: str | None = None,
) -> LoadedJob:
    """Load, override (``--set``, ``--runtime``) and validate a job file."""
    path = Path(path)
    data, lines = load_yaml_with_lines(path)
    if data is None:
        raise SpecError(f"{path}:1: the job file is empty", fix="see jobs/tiny-cpu.yaml for an example")
    if not isinstance(data, dict):
        raise SpecError(f"{path}:1: a job file is a mapping of keys (name:, model:, ...), not a {type(data).__name__}")
    # Another tool's YAML becomes a dzctl job here, before --set (which then sets dzctl's keys) and validation.
    converted = foreign.convert(data, lines, path) if foreign.detect(data) else None
    if converted is not None:
        data, lines = converted.data, converted.lines
    overrides = tuple(overrides)
    for item in overrides:
        apply_override(data, item)
    if converted is not None and (refused := converted.refused(overrides)):
        raise foreign.refusal_error(converted, refused)
    if runtime is not None:
        overrides += (f"runtime={runtime}",)
        data["runtime"] = runtime
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_format_validation(exc, lines, overrides)) from None
    loaded = LoadedJob(spec=spec, path=path, lines=lines, overrides=overrides, converted=converted)
    if spec.data.dataset is not None:
        loaded = _with_registry_sources(loaded)
    _check_fused_loss(loaded)
    _check_pure_bf16(loaded)
    _check_eval(loaded)
    return loaded


def _with_registry_sources(loaded: LoadedJob) -> LoadedJob:
    """data.dataset (LLaMA-Factory's registry names) expanded into data.sources (spec/registry.py)."""
    from . import registry  # it reads files: only jobs that name a registry pay for it

    where = loaded.where("data.dataset")
    data = loaded.spec.data.model_dump(mode="json", exclude_none=True, exclude_defaults=False)
    data["_format_given"] = "format" in loaded.spec.data.model_fields_set
    expanded = registry.expand(data, loaded.path.parent, where)
    try:
        spec = loaded.spec.model_copy(update={"data": DataSpec.model_validate(expanded)})
    except ValidationError as exc:
        raise registry.validation_error(exc, where, str(loaded.spec.data.dataset_info)) from None
    return LoadedJob(
        spec=spec, path=loaded.path, lines=loaded.lines, overrides=loaded.overrides, converted=loaded.converted
    )


def _check_eval(loaded: LoadedJob) -> None:
    """The keys that act on evaluation need eval data, and early stopping needs evals to count."""
    spec = loaded.spec
    train = spec.train
    asked = [
        key
        for key, on in (
            ("train.eval_steps", train.eval_steps is not None),
            ("train.early_stopping", train.early_stopping is not None),
            ("train.save_best", train.save_best),
        )
        if on
    ]
    if asked and not spec.data.has_eval:
        raise SpecError(
            f"{loaded.where(asked[0])}: {asked[0]} needs eval data, and this job has none",
            fix="hold out rows of the training data with data.eval_split (0.05: 5% of them; 200: 200 rows), "
            f"or give data.eval (its own path or sources); or remove {', '.join(asked)}",
        )
    if train.early_stopping is not None and train.eval_steps is None:
        raise SpecError(
            f"{loaded.where('train.early_stopping')}: train.early_stopping counts evals, and without "
            "train.eval_steps there is only the one at the end",
            fix="set train.eval_steps (evaluate every N steps), or remove train.early_stopping",
        )
    if train.save_best and not train.save:
        raise SpecError(
            f"{loaded.where('train.save_best')}: train.save_best keeps a checkpoint, and train.save is false",
            fix="set train.save: true, or remove train.save_best",
        )


# zero.offload values that move the optimizer to the hosts (NVMe holds it too).
OPTIMIZER_OFFLOADS = ("optimizer", "all", "nvme")


def _check_pure_bf16(loaded: LoadedJob) -> None:
    """``train.pure_bf16`` needs bf16 to run in, and an optimizer on the GPUs (docs/memory-planner.md says why)."""
    spec = loaded.spec
    if not spec.train.pure_bf16:
        return
    where = loaded.where("train.pure_bf16")
    precision = spec.train.precision
    not_bf16 = {"fp16": "fp16", "fp32": "fp32"}.get(precision)
    if precision == "auto" and spec.accelerator == "cpu":
        not_bf16 = "auto, which is fp32 on accelerator: cpu"
    if not_bf16:
        raise SpecError(
            f"{where}: train.pure_bf16 keeps the weights, gradients and AdamW states in bf16, and this job's "
            f"train.precision is {not_bf16}",
            fix="set train.precision: bf16 (or auto on GPUs with bf16), or remove train.pure_bf16",
        )
    if spec.zero.offload in OPTIMIZER_OFFLOADS:
        # DeepSpeed would need its CPU Adam built to keep bf16 moments (fp32_optimizer_states=False), a path
        # dzctl has neither planned (host RAM, the host's AdamW rate are fp32's) nor run.
        raise SpecError(
            f"{where}: train.pure_bf16 keeps the optimizer on the GPUs, and zero.offload: {spec.zero.offload} "
            "moves it to the hosts",
            fix="set zero.offload: none (or auto: the planner then never offloads), or remove train.pure_bf16 "
            "to offload fp32 optimizer states",
        )


def _check_fused_loss(loaded: LoadedJob) -> None:
    # Liger's kernels are Triton: a CPU job asking for them would fail on every rank at its first step.
    if loaded.spec.train.fused_loss == "liger" and loaded.spec.accelerator == "cpu":
        raise SpecError(
            f"{loaded.where('train.fused_loss')}: train.fused_loss: liger needs CUDA GPUs (Triton kernels), "
            "and this job has accelerator: cpu",
            fix="set train.fused_loss: chunked (or auto, which is chunked on CPU)",
        )


def shown_override(item: str) -> str:
    """``--set`` text as it may appear in a message: control characters escaped, so a
    newline in a value cannot split one error into lines that look like others, and
    the value of a secret-named key replaced by ``***``."""
    dotted, sep, _ = item.partition("=")
    if sep and is_secret_name(dotted.rsplit(".", 1)[-1]):
        item = f"{dotted}=***"
    return printable(item)


def printable(text: str) -> str:
    """``text`` with control characters (newlines, NEL, NUL, ...) escaped: one message stays one line."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``KEY=VALUE`` (dotted key, YAML-typed value) to raw spec data."""
    if "=" not in item:
        raise SpecError(f"--set {shown_override(item)}: expected KEY=VALUE, e.g. --set train.max_steps=10")
    dotted, raw = item.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise SpecError(f"--set {shown_override(item)}: empty key segment in {dotted!r}")
    for key in keys:
        # Plain names only: a space or newline in a key would make it match no spec key
        # and put it, unescaped, into the messages that name it.
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]*", key):
            raise SpecError(f"--set {shown_override(item)}: {key!r} is not a key name (letters, digits, _ and -)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw  # not YAML (e.g. "a: b: c"): take the text as it is
    node: Any = data
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            where = ".".join(keys[: depth + 1])
            raise SpecError(f"--set {shown_override(item)}: {where} is a value, not a section")
        node = child
    node[keys[-1]] = value


def _format_validation(exc: ValidationError, lines: LineMap, overrides: tuple[str, ...]) -> str:
    messages = []
    for error in _one_per_key(exc.errors()):
        loc = _clean_loc(error)
        keyed = (error.get("ctx") or {}).get("error")
        if isinstance(keyed, KeyedValueError):  # a section's check about one of its keys: located at that key
            loc = (*loc, *keyed.key)
        # A key is the user's text: one holding a line break must not split the message into lines.
        dotted = ".".join(printable(str(p)) for p in loc)
        if error["type"] == "extra_forbidden":
            text = f"{dotted}: unknown key"
            suggestion = _did_you_mean(loc)
            known = ", ".join(_known_keys(loc[:-1]))
            text += f"; did you mean {suggestion}?" if suggestion else f"; known keys: {known}"
        elif error["type"] == "missing":
            text = f"{dotted}: required key is missing"
        else:
            got = error.get("input")
            shown = "" if isinstance(got, (dict, list)) or _is_secret_loc(loc) else f" (got {got!r})"
            text = f"{dotted}: {_short(error['msg'])}{shown}"
        source = _override_for(dotted, overrides)
        prefix = f"--set {shown_override(source)}" if source else lines.where(loc)
        messages.append(f"{prefix}: {text}")
    # One line per problem, in file order, so each names its own line.
    return "\n".join(dict.fromkeys(messages))


def _one_per_key(errors: list[dict]) -> list[dict]:
    """One error per key: a value that fits no branch of a union (``int | 'auto'``) fails each branch.

    pydantic reports each branch's failure on its own; the user made one mistake, so
    the branches' expectations become one message ("an integer or 'auto'").
    """
    by_key: dict[KeyPath, list[dict]] = {}
    for error in errors:
        by_key.setdefault(_clean_loc(error), []).append(error)
    merged = []
    for group in by_key.values():
        if len(group) == 1 or any(e["type"] in ("extra_forbidden", "missing") for e in group):
            merged += group
            continue
        expected = " or ".join(dict.fromkeys(_expected(e) for e in group))
        merged.append({**group[0], "type": "union", "msg": f"must be {expected}"})
    return merged


def _expected(error: dict) -> str:
    """What one union branch wanted, in a few words."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "an integer"
    if kind in ("float_parsing", "float_type"):
        return "a number"
    if kind in ("bool_parsing", "bool_type"):
        return "true or false"
    if kind == "literal_error" and "expected" in ctx:
        return str(ctx["expected"])
    return _short(error["msg"]).removeprefix("Input should be ")


def _is_secret_loc(loc: KeyPath) -> bool:
    # launch.env.<NAME>: a rejected secret must not be echoed in the error that rejects it.
    return len(loc) >= 3 and loc[:2] == ("launch", "env") and is_secret_name(str(loc[2]))


def _override_for(dotted: str, overrides: tuple[str, ...]) -> str | None:
    for item in overrides:
        key = item.split("=", 1)[0]
        if dotted == key or dotted.startswith(key + "."):
            return item
    return None


def _short(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def _clean_loc(error: dict) -> KeyPath:
    # pydantic adds union branch names ("int", "constrained-int", "literal['auto']") to locations.
    # An unknown key is the user's own text and may look like one (`a[b:`): it is kept whole.
    loc = tuple(error["loc"])
    users_key = loc[-1:] if error["type"] == "extra_forbidden" else ()
    parents = loc[: len(loc) - len(users_key)]
    return tuple(p for p in parents if not (isinstance(p, str) and _is_branch_name(p))) + users_key


def _is_branch_name(part: str) -> bool:
    return "[" in part or part.startswith("constrained-") or part in ("int", "bool", "str", "float")


def _model_at(path: KeyPath) -> type[BaseModel] | None:
    model: type[BaseModel] | None = JobSpec
    for key in path:
        if model is None or key not in model.model_fields:
            return None
        model = _as_model(model.model_fields[key].annotation)
    return model


def _as_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is not None:
        for arg in get_args(annotation):
            found = _as_model(arg)
            if found is not None:
                return found
    return None


def _known_keys(parent: KeyPath) -> list[str]:
    model = _model_at(parent)
    return list(model.model_fields) if model else []


def _did_you_mean(loc: KeyPath) -> str | None:
    candidates = _known_keys(loc[:-1])
    typed = str(loc[-1])
    # An abbreviation by initials (lr, mbs, gas) is what people type; spelling is the fallback
    # (by spelling alone `lr` is closest to `lora`).
    initials = [key for key in candidates if len(typed) > 1 and "".join(w[:1] for w in key.split("_")) == typed]
    if len(initials) == 1:
        return initials[0]
    match = difflib.get_close_matches(typed, candidates, n=1, cutoff=0.6)
    return match[0] if match else None


def is_secret_name(name: str) -> bool:
    """Env names whose values must never be printed or put in argv."""
    return bool(SECRET_NAME.search(name))


def read_env_file(path: Path, display: str) -> dict[str, str]:
    """Parse a ``KEY=VALUE`` env file (docker's format: no quoting, ``#`` comments)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(
            f"{display}: launch.env_file not found: {path}", fix="create it or remove launch.env_file"
        ) from None
    values: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not ENV_NAME.match(name):
            raise SpecError(f"{path}:{number}: expected NAME=VALUE (NAME of letters, digits, _)")
        values[name] = value
    return values
