"""axolotl's training YAML (``axolotl train FILE``) as a dzctl job: its key map.

The keys are those of its config schema (``src/axolotl/utils/schemas/``), read with its defaults
where dzctl's differ: ``sequence_len`` 512, micro-batch 1, the warmup it sets when none is given
(3% of the steps, at most 100), no packing, and the datasets concatenated. Each entry of
``datasets:`` becomes one ``data.sources`` entry; its keys get rows of their own (``datasets.0.type``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .keymap import (
    ALL_LINEAR_TARGETS,
    Builder,
    Handler,
    KeyRow,
    direct,
    ds_config_file,
    held_out_rows,
    ignored,
    map_pure_bf16,
    names,
    number,
    off,
    optimizer,
    per_gpu_batch,
    resume_from,
    scheduler,
    truthy,
    walk,
    whole,
)

TOOL = "axolotl"
# axolotl's chat_template names that are the model's own template (data.template: auto).
# Others (llama3, mistral, gemma3...) are axolotl's copies of those families' templates, which may differ from
# the model's own version: refused unless data.template is set.
OWN_TEMPLATES = frozenset({"tokenizer_default", "qwen3"})
# PEFT's default target_modules for Qwen and Llama models, what axolotl's LoRA trains without targets.
PEFT_DEFAULT_TARGETS = ["q_proj", "v_proj"]
# Plugins that replace the loss or kernels with the same math: dzctl fuses the loss itself.
SAME_MATH_PLUGINS = ("cut_cross_entropy", "CutCrossEntropyPlugin", "liger", "LigerPlugin")

LOGGING = "logging only"
SPEED = "speed or memory only: the same training"
NOT_TRAINING = "not part of training (preprocessing, caching, upload or inference)"


def _tokenizer(b: Builder, key: str, value: Any) -> None:
    if value in (None, b.value("base_model")):
        b.ignore(key, "the model's own tokenizer")
    else:
        b.map(key, "model.tokenizer", value)


def _model_config(b: Builder, key: str, value: Any) -> None:
    if value in (None, b.value("base_model")):
        b.ignore(key, "the model's own config")
    else:
        b.refuse(key, "another model's config for these weights: give it as model.config", "model.config")


def _adapter(b: Builder, key: str, value: Any) -> None:
    if value == "lora":
        b.map(key, "train.method", "lora")
    elif value in (None, ""):
        b.ignore(key, "none: every weight trains (train.method: full)")
    else:
        b.refuse(key, f"adapter {value!r}: dzctl trains LoRA on bf16/fp16/fp32 weights, not quantized (QLoRA) ones")


def _lora_only(target: str, kind: str) -> Handler:
    def handle(b: Builder, key: str, value: Any) -> None:
        if b.value("adapter") == "lora":
            got = whole(value) if kind == "int" else number(value)
            b.map(key, target, value if got is None else got)
        else:
            b.ignore(key, "read only with adapter: lora")

    return handle


def _target_linear(b: Builder, key: str, value: Any) -> None:
    if b.value("adapter") != "lora":
        b.ignore(key, "read only with adapter: lora")
    elif truthy(value):
        b.map(key, "train.lora.target_modules", list(ALL_LINEAR_TARGETS), _ALL_LINEAR)
    else:
        b.ignore(key, "false: lora_target_modules decides")


_ALL_LINEAR = "every linear layer but the output head; of a Qwen/Llama/Mistral model, these seven projections"


def _target_modules(b: Builder, key: str, value: Any) -> None:
    if b.value("adapter") != "lora":
        b.ignore(key, "read only with adapter: lora")
    elif truthy(b.value("lora_target_linear")):
        b.ignore(key, "lora_target_linear: true already targets every linear layer")
    else:
        b.map(key, "train.lora.target_modules", names(value))


_batch, _batch_note = per_gpu_batch("axolotl", "micro_batch_size", 1)


def _chat_template(b: Builder, key: str, value: Any) -> None:
    if value == "chatml":
        b.map(key, "data.template", "chatml")
    elif value in OWN_TEMPLATES:
        b.map(key, "data.template", "auto", f"{value}: the model's own chat template, which dzctl renders")
    elif value == "jinja":
        b.refuse(
            key, "an inline Jinja template: save it as a .jinja file and give it as data.template", "data.template"
        )
    else:
        b.refuse(key, f"chat_template {value!r} is axolotl's own; dzctl renders auto, chatml, plain or a Jinja file",
                 "data.template")  # fmt: skip


# axolotl documents bf16: full only as "'full' for bf16_full_eval"; its trainer builder then turns HF's bf16 (AMP) off
# on a model it loaded in bf16, so the weights and AdamW's states train in bf16 with no fp32 copy: what its
# bfloat16: true ("No AMP" in its config reference) also does, and what train.pure_bf16 keeps under ZeRO-3.
AXOLOTL_PURE_BF16 = "bf16 weights and AdamW states without AMP's fp32 copy, as axolotl trains them"


def _bf16(b: Builder, key: str, value: Any) -> None:
    if value == "auto":
        b.map(key, "train.precision", "auto", "bf16 where the GPUs have it, as axolotl's auto")
    elif value == "full":
        map_pure_bf16(b, key, AXOLOTL_PURE_BF16)
    elif truthy(value):
        b.map(key, "train.precision", "bf16")
    else:
        b.ignore(key, "false")


def _bfloat16(b: Builder, key: str, value: Any) -> None:
    if truthy(value):
        map_pure_bf16(b, key, AXOLOTL_PURE_BF16)
    else:
        b.ignore(key, "false")


def _fp16(b: Builder, key: str, value: Any) -> None:
    if truthy(value):
        b.map(key, "train.precision", "fp16")
    else:
        b.ignore(key, "false")


def _gradient_checkpointing(b: Builder, key: str, value: Any) -> None:
    b.ignore(key, SPEED + ": the same gradients; dzctl's planner decides checkpointing and offload")


def _output_dir(b: Builder, key: str, value: Any) -> None:
    if isinstance(value, str) and value.startswith("/"):
        b.map(key, "train.output_dir", value, "on every node")
    else:
        b.ignore(key, "relative to where axolotl ran; dzctl writes to <launch.remote_dir>/output/<name> on every "
                 "node (--set train.output_dir=/ABSOLUTE/PATH for another)")  # fmt: skip


def _packing(b: Builder, key: str, value: Any) -> None:
    if truthy(value):
        b.map(key, "train.packing", True, "dzctl's packing keeps the examples of a row apart, as axolotl's")
    else:
        b.map(key, "train.packing", False)


def _plugins(b: Builder, key: str, value: Any) -> None:
    other = [p for p in names(value) if not any(known in p for known in SAME_MATH_PLUGINS)]
    if other:
        b.refuse(key, f"plugins dzctl cannot run: {', '.join(other)}")
    else:
        b.ignore(key, SPEED + ": a fused loss or kernels; dzctl fuses the loss itself (train.fused_loss: auto)")


def _wandb_project(b: Builder, key: str, value: Any) -> None:
    if not value:
        b.ignore(key, "unset: no Weights & Biases run")
        return
    b.map(key, "train.report_to", ["wandb"], LOGGING)
    b.note(key, "launch.env.WANDB_PROJECT", str(value), "the run's project, through the ranks' environment")


def _tensorboard(b: Builder, key: str, value: Any) -> None:
    if truthy(value) and not b.value("wandb_project"):
        b.map(key, "train.report_to", ["tensorboard"], LOGGING)
    else:
        b.ignore(key, LOGGING)


def _rl(b: Builder, key: str, value: Any) -> None:
    stages = {"dpo": ("dpo", None), "ipo": ("dpo", "ipo"), "orpo": ("dpo", "orpo"), "simpo": ("dpo", "simpo")}
    if value in (None, ""):
        b.ignore(key, "unset: supervised fine-tuning (dzctl's default)")
    elif value == "kto":
        b.map(key, "train.stage", "kto")
    elif value in stages:
        stage, loss = stages[value]
        b.map(key, "train.stage", stage)
        if loss:
            b.note(key, "train.pref_loss", loss, f"axolotl's rl: {value} is DPO training with the {loss} loss")
    else:
        b.refuse(key, f"rl {value!r} is not a kind of training dzctl runs (it runs sft, dpo and kto)")


def _pref(target: str) -> Handler:
    def handle(b: Builder, key: str, value: Any) -> None:
        if b.value("rl"):
            b.map(key, target, number(value) if number(value) is not None else value)
        else:
            b.ignore(key, "read only with rl:")

    return handle


def _seed(b: Builder, key: str, value: Any) -> None:
    b.map(key, "train.seed", whole(value) if whole(value) is not None else value)


def _steps_pass(b: Builder, key: str, value: Any) -> None:
    pass  # read with the keys it goes with in _finish


def _best(b: Builder, key: str, value: Any) -> None:
    if truthy(value):
        b.map(key, "train.save_best", True, "the best eval loss's checkpoint is kept")
    else:
        b.ignore(key, "false")


def _special_tokens(b: Builder, key: str, value: Any) -> None:
    if not value:
        b.ignore(key, "none set")
    else:
        b.refuse(key, "special tokens change the tokenizer (and the vocabulary dzctl trains)")


def _batch_size(b: Builder, key: str, value: Any) -> None:
    b.refuse(
        key,
        "axolotl's total batch sets the accumulation from the micro-batch: give it as train.global_batch_size",
        "train.global_batch_size",
    )


KEYS: dict[str, Handler] = {
    # --- model ---
    "base_model": direct("model.name_or_path"),
    "base_model_config": _model_config,
    "model_type": ignored("dzctl loads the model's own class"),
    "tokenizer_type": ignored("dzctl loads the model's own tokenizer class"),
    "tokenizer_config": _tokenizer,
    "tokenizer_use_fast": ignored(NOT_TRAINING),
    "tokenizer_legacy": ignored(NOT_TRAINING),
    "trust_remote_code": ignored("dzctl loads the model through its transformers class"),
    "strict": ignored("axolotl's own check of its config"),
    "load_in_8bit": off("8-bit (quantized) base weights: dzctl trains bf16/fp16/fp32 weights"),
    "load_in_4bit": off("4-bit (QLoRA) base weights: dzctl trains bf16/fp16/fp32 weights"),
    "adapter": _adapter,
    "lora_model_dir": off("training on from an existing adapter: merge it into the model first", None),
    "lora_r": _lora_only("train.lora.r", "int"),
    "lora_alpha": _lora_only("train.lora.alpha", "float"),
    "lora_dropout": _lora_only("train.lora.dropout", "float"),
    "lora_target_linear": _target_linear,
    "lora_target_modules": _target_modules,
    "lora_modules_to_save": off("modules trained in full beside the adapters", None),
    "lora_fan_in_fan_out": off("transposed LoRA weights (GPT-2 style layers)"),
    "peft_use_dora": off("DoRA adapters"),
    "peft_use_rslora": off("rank-stabilised LoRA scales the adapters by alpha/sqrt(r)"),
    "peft_layers_to_transform": off("adapters on some layers only", None),
    "loraplus_lr_ratio": off("LoRA+ gives the B matrices another learning rate", None),
    "lora_mlp_kernel": ignored(SPEED),
    "lora_qkv_kernel": ignored(SPEED),
    "lora_o_kernel": ignored(SPEED),
    "lora_on_cpu": ignored(SPEED),
    "unfrozen_parameters": off("training some parameters only", None),
    # --- data ---
    "datasets": _steps_pass,
    "test_datasets": off("evaluation data of its own: give dzctl data.eval (path or sources)", None, "data.eval"),
    "dataset_prepared_path": ignored(NOT_TRAINING + ": dzctl keeps its tokenized data in data.cache_dir"),
    "push_dataset_to_hub": ignored(NOT_TRAINING),
    "dataset_processes": ignored(NOT_TRAINING),
    "dataset_num_proc": ignored(NOT_TRAINING),
    "dataset_keep_in_memory": ignored(NOT_TRAINING),
    "shuffle_merged_datasets": ignored("dzctl shuffles the rows"),
    "dataset_exact_deduplication": off("dropping duplicate rows changes the data"),
    "chat_template": _chat_template,
    "chat_template_jinja": off(
        "an inline Jinja template: save it as a .jinja file (data.template)", None, "data.template"
    ),
    "default_system_message": off("a system prompt added to every row changes the prompts", None),
    "val_set_size": held_out_rows,
    "sequence_len": direct("train.max_seq_len", "int", "tokens per example (longer ones are cut, as there)"),
    "sample_packing": _packing,
    "eval_sample_packing": ignored(SPEED + " (evaluation's batches)"),
    "pad_to_sequence_len": ignored(SPEED),
    "pretraining_dataset": off("streamed pretraining data: give the rows as data.format: text", None),
    "train_on_inputs": off("dzctl trains the answers, never the prompt"),
    "group_by_length": off("batches of like lengths change which rows train together"),
    "special_tokens": _special_tokens,
    "tokens": off("new tokens change the model's vocabulary", None),
    "added_tokens_overrides": off("renamed tokens change the tokenizer", None),
    # --- training ---
    "micro_batch_size": _batch,
    "batch_size": _batch_size,
    "eval_batch_size": ignored(SPEED + " (evaluation's batch)"),
    "gradient_accumulation_steps": direct("train.gradient_accumulation_steps", "int", "fixed, as there"),
    "num_epochs": direct("train.epochs", "float"),
    "max_steps": direct("train.max_steps", "int"),
    "learning_rate": direct("train.learning_rate", "float"),
    "lr_scheduler": scheduler,
    "lr_scheduler_kwargs": off("scheduler arguments dzctl's schedules do not take", None),
    "cosine_min_lr_ratio": off("a floor under the cosine schedule", None),
    "cosine_constant_lr_ratio": off("a constant phase in the cosine schedule", None),
    "warmup_ratio": _steps_pass,
    "warmup_steps": _steps_pass,
    "optimizer": optimizer,
    "optim_args": off("optimizer arguments", None),
    "weight_decay": direct("train.weight_decay", "float"),
    "adam_beta1": off("dzctl's AdamW uses beta1 0.9", 0.9),
    "adam_beta2": off("dzctl's AdamW uses beta2 0.999", 0.999),
    "adam_epsilon": off("dzctl's AdamW uses epsilon 1e-8", 1e-8),
    "max_grad_norm": direct("train.max_grad_norm", "float"),
    "bf16": _bf16,
    "fp16": _fp16,
    "tf32": ignored(SPEED + ": matmul precision of fp32 layers on the GPUs"),
    "bfloat16": _bfloat16,
    "float16": off("fp16 weights without fp32 master weights: dzctl keeps fp32 master weights"),
    "gradient_checkpointing": _gradient_checkpointing,
    "gradient_checkpointing_kwargs": ignored(SPEED),
    "activation_offloading": ignored(SPEED),
    "flash_attention": ignored(SPEED + "; dzctl picks the attention kernel"),
    "sdp_attention": ignored(SPEED + "; dzctl picks the attention kernel"),
    "xformers_attention": ignored(SPEED + "; dzctl picks the attention kernel"),
    "flex_attention": ignored(SPEED + "; dzctl picks the attention kernel"),
    "fused_attn_kernel": ignored(SPEED),
    "flash_attn_cross_entropy": ignored(SPEED),
    "flash_attn_rms_norm": ignored(SPEED),
    "flash_attn_fuse_mlp": ignored(SPEED),
    "s2_attention": off("shifted sparse attention (LongLoRA) changes the attention"),
    "liger_rope": ignored(SPEED),
    "liger_rms_norm": ignored(SPEED),
    "liger_glu_activation": ignored(SPEED),
    "liger_layer_norm": ignored(SPEED),
    "liger_fused_linear_cross_entropy": ignored(SPEED + "; dzctl fuses the loss itself (train.fused_loss: auto)"),
    "cut_cross_entropy": ignored(SPEED + "; dzctl fuses the loss itself (train.fused_loss: auto)"),
    "plugins": _plugins,
    "torch_compile": ignored(SPEED),
    "torch_compile_backend": ignored(SPEED),
    "sequence_parallel_degree": ignored(SPEED + ": the sequence split across GPUs"),
    "context_parallel_size": ignored(SPEED + ": the sequence split across GPUs"),
    "deepspeed": ds_config_file(""),
    "fsdp": off("FSDP: dzctl shards with DeepSpeed ZeRO-3", None),
    "fsdp_config": off("FSDP: dzctl shards with DeepSpeed ZeRO-3", None),
    "fsdp_version": ignored("read only with fsdp"),
    "ddp_timeout": ignored("dzctl sets the process group's timeouts per phase (train/hang/timeout.py)"),
    "ddp_bucket_cap_mb": ignored(SPEED),
    "ddp_broadcast_buffers": ignored(SPEED),
    "ddp_find_unused_parameters": ignored(SPEED),
    "dataloader_num_workers": ignored(SPEED),
    "dataloader_pin_memory": ignored(SPEED),
    "dataloader_prefetch_factor": ignored(SPEED),
    "low_cpu_mem_usage": ignored(SPEED),
    "gpu_memory_limit": ignored(SPEED),
    "device_map": ignored("dzctl places the model with ZeRO-3"),
    "max_memory": ignored("dzctl places the model with ZeRO-3"),
    "neftune_noise_alpha": off("NEFTune adds noise to the embeddings", None),
    "seed": _seed,
    # --- evaluation and saving ---
    "eval_steps": _steps_pass,
    "evals_per_epoch": _steps_pass,
    "eval_strategy": _steps_pass,
    "eval_table_size": ignored(LOGGING),
    "eval_max_new_tokens": ignored(NOT_TRAINING),
    "do_causal_lm_eval": ignored(NOT_TRAINING),
    "save_steps": direct("train.save_steps", "int"),
    "saves_per_epoch": ignored("when checkpoints are written: dzctl saves every train.save_steps"),
    "save_strategy": ignored("when checkpoints are written: dzctl saves every train.save_steps"),
    "save_total_limit": direct("train.save_total_limit", "int"),
    "save_only_model": ignored("dzctl's checkpoints keep the optimizer too, so a run can resume"),
    "save_safetensors": ignored(NOT_TRAINING),
    "save_first_step": ignored("when checkpoints are written"),
    "early_stopping_patience": direct("train.early_stopping.patience", "int", "evals without a better eval loss"),
    "load_best_model_at_end": _best,
    "metric_for_best_model": off("dzctl chooses the best checkpoint by the eval loss only", "eval_loss"),
    "output_dir": _output_dir,
    "resume_from_checkpoint": resume_from,
    "auto_resume_from_checkpoints": ignored("dzctl resumes from its last checkpoint (train.resume: auto)"),
    "logging_steps": direct("train.logging_steps", "int", LOGGING),
    "hub_model_id": ignored(NOT_TRAINING + ": dzctl export writes the model"),
    "hub_strategy": ignored(NOT_TRAINING),
    "hf_use_auth_token": ignored("a credential: dzctl reads HF_TOKEN from launch.env or launch.env_file"),
    "wandb_project": _wandb_project,
    "wandb_entity": ignored(LOGGING),
    "wandb_watch": ignored(LOGGING),
    "wandb_name": ignored(LOGGING),
    "wandb_run_id": ignored(LOGGING),
    "wandb_log_model": ignored(LOGGING),
    "wandb_mode": ignored(LOGGING),
    "use_tensorboard": _tensorboard,
    "mlflow_tracking_uri": ignored(LOGGING),
    "mlflow_experiment_name": ignored(LOGGING),
    "use_mlflow": ignored(LOGGING),
    "debug": ignored(LOGGING),
    "local_rank": ignored("dzctl sets each rank's place itself"),
    "include_tokens_per_second": ignored(LOGGING),
    # --- preference training ---
    "rl": _rl,
    "rl_beta": _pref("train.pref_beta"),
    "dpo_beta": _pref("train.pref_beta"),
    "orpo_alpha": _pref("train.pref_beta"),
    "simpo_gamma": _pref("train.simpo_gamma"),
    "kto_desirable_weight": _pref("train.kto_chosen_weight"),
    "kto_undesirable_weight": _pref("train.kto_rejected_weight"),
    "cpo_alpha": off("CPO's NLL weight", None),
    "dpo_label_smoothing": off("label smoothing of the DPO loss", 0.0),
    "dpo_use_weighting": off("WPO weighting of the DPO loss"),
}


# --- datasets[]: one data.sources entry each ----------------------------------------------------------

# axolotl's ``type`` -> dzctl's data format (``chat_template``: OpenAI-style messages rows).
FORMATS = {"alpaca": "alpaca", "chat_template": "messages", "sharegpt": "sharegpt", "completion": "text"}
SOURCE_FILE_ENDINGS = (".json", ".jsonl", ".parquet", ".arrow")


def _source_path(entry: dict[str, Any], path: Path) -> str:
    """A local file or folder as it is; anything else is a Hub dataset, read from the nodes' cache."""
    where = str(entry.get("path", ""))
    local = (
        entry.get("ds_type") in ("json", "parquet", "arrow")
        or where.startswith(("/", "./", "../"))
        or where.endswith(SOURCE_FILE_ENDINGS)
        or (path.parent / where).exists()
    )
    if local:
        return where
    split = entry.get("split")
    return f"hf:{where}" + (f":{split}" if split and split != "train" else "")


def _datasets(b: Builder, path: Path) -> None:
    entries = b.value("datasets")
    if entries is None:
        b.refuse("datasets", "no datasets: dzctl needs data (data.path, data.sources)", "data")
        return
    if not isinstance(entries, list) or not entries:
        b.refuse("datasets", "must be a list of datasets (path:, type:)", "data")
        return
    sources = []
    formats = set()
    for index, entry in enumerate(entries):
        here = f"datasets.{index}"
        if not isinstance(entry, dict) or "path" not in entry:
            b.refuse(here, "each dataset needs path:", "data", value_of=entry)
            continue
        source: dict[str, Any] = {"path": _source_path(entry, path)}
        for key, value in entry.items():
            _dataset_key(b, index, str(key), value, entry, source)
        formats.add(source.get("format"))
        sources.append(source)
    b.put("data.sources", sources, "datasets")
    count = f"{len(sources)} source(s)"
    b.rows.append(KeyRow("datasets", "[...]", b.line("datasets"), "mapped", "data.sources", count, "one per entry"))
    if len(sources) > 1:
        b.default("data.mix_strategy", "concat", "axolotl concatenates its datasets: every row of each")
    if formats == {"alpaca"} and not b.given("chat_template"):
        b.default(
            "data.template",
            "plain",
            "axolotl renders type: alpaca with the Alpaca prompt; dzctl's plain template is its ### Instruction: / "
            "### Response: layout, without axolotl's opening sentence and ### Input: heading",
        )


def _dataset_key(b: Builder, index: int, key: str, value: Any, entry: dict[str, Any], source: dict[str, Any]) -> None:
    """One key of ``datasets[index]``: onto ``source`` (that entry's data.sources item), with its row."""
    here = f"datasets.{index}.{key}"
    line = b.line(here)

    def mapped(target: str, got: Any, reason: str = "") -> None:
        b.rows.append(KeyRow(here, value, line, "mapped", f"data.sources.{index}.{target}", got, reason))
        source[target] = got
        if line is not None:
            b.origins[("data", "sources", index, target)] = (line, here)

    def ignore(reason: str) -> None:
        b.rows.append(KeyRow(here, value, line, "ignored", reason=reason))

    def refuse(reason: str, lifted_by: str | None = None) -> None:
        b.refuse(here, reason, lifted_by, value_of=value)

    mappings = entry.get("message_property_mappings") or {}
    if key == "path":
        hub = source["path"].startswith("hf:")
        mapped("path", source["path"], "a Hub dataset, read from the nodes' cache" if hub else "relative to this YAML")
    elif key == "type":
        if isinstance(value, str) and value in FORMATS:
            mapped("format", FORMATS[value])
            if value == "completion":
                source["columns"] = {"text": entry.get("field") or "text"}
        else:
            refuse(f"type {value!r}: dzctl reads alpaca, chat_template, sharegpt and completion rows")
    elif key in ("ds_type", "data_files", "split"):
        ignore("where the rows are: read into path")
    elif key == "field_messages":
        mapped("columns", {**source.get("columns", {}), "messages": value}, "the column of the conversation")
    elif key == "message_property_mappings":
        columns = {k: v for k, v in mappings.items() if k in ("role", "content")}
        other = [k for k in mappings if k not in ("role", "content")]
        if other:
            refuse(f"message properties dzctl does not read: {', '.join(map(str, other))}")
        else:
            mapped("columns", {**source.get("columns", {}), **columns}, "each turn's role and text keys")
    elif key in ("message_field_role", "message_field_content"):
        name = key.removeprefix("message_field_")
        mapped("columns", {**source.get("columns", {}), name: value}, f"each turn's {name} key")
    elif key in ("roles_to_train", "train_on_eos", "message_field_training"):
        mapped(key, value)
    elif key == "field":
        ignore("read with type: completion (the text column)")
    elif key in ("chat_template", "roles", "drop_system_message", "shards", "name", "revision", "train_on_split"):
        off_key = {"chat_template": "data.template"}.get(key)
        if value in (None, False, "", b.value("chat_template")):
            ignore("unset")
        else:
            refuse(f"{key} on a dataset changes its rows or prompt in a way dzctl's sources do not", off_key)
    elif key == "trust_remote_code":
        ignore("dzctl reads data files, not dataset scripts")
    else:
        refuse(f"a dataset key dzctl does not know ({key})")


def convert(b: Builder, path: Path) -> None:
    walk(b, KEYS)
    _datasets(b, path)
    _finish(b)


def _finish(b: Builder) -> None:
    """Keys read together, and axolotl's defaults where dzctl's differ."""
    given = b.given
    if b.value("adapter") == "lora":
        if not given("lora_r"):
            b.default("train.lora.r", 8, "PEFT's default r (axolotl sets none)")
        if not given("lora_alpha"):
            b.default("train.lora.alpha", 8.0, "PEFT's default lora_alpha (axolotl sets none)")
        if not given("lora_dropout"):
            b.default("train.lora.dropout", 0.0, "axolotl's default")
        if not (truthy(b.value("lora_target_linear")) or given("lora_target_modules")):
            b.default("train.lora.target_modules", PEFT_DEFAULT_TARGETS, "PEFT's default targets of Qwen/Llama models")
    if not given("micro_batch_size"):
        b.default("train.micro_batch_size", 1, "axolotl's default micro_batch_size; " + _batch_note(b))
    if not given("gradient_accumulation_steps"):
        b.default("train.gradient_accumulation_steps", 1, "axolotl's default, fixed as there")
    if not given("sequence_len"):
        b.default("train.max_seq_len", 512, "axolotl's default sequence_len")
    if not given("sample_packing"):
        b.default("train.packing", False, "axolotl packs only with sample_packing: true")
    if not given("learning_rate"):
        b.refuse("learning_rate", "axolotl's config needs learning_rate", "train.learning_rate", value_of=None)
    bf16 = b.value("bf16")
    if not (truthy(bf16) or bf16 in ("auto", "full") or truthy(b.value("fp16")) or truthy(b.value("bfloat16"))):
        b.default("train.precision", "fp32", "neither bf16, fp16 nor bfloat16: axolotl trains in fp32")
    if "template" not in b.data.get("data", {}):
        b.default("data.template", "auto", "the tokenizer's own chat template (axolotl's tokenizer_default)")
    _warmup(b)
    _evaluation(b)


def _warmup(b: Builder) -> None:
    steps, ratio = b.value("warmup_steps"), b.value("warmup_ratio")
    max_steps = whole(b.value("max_steps")) or -1
    if b.given("warmup_ratio"):
        if steps is not None:
            b.ignore("warmup_ratio", "warmup_steps is given and wins, as in axolotl")
        else:
            b.map("warmup_ratio", "train.warmup_ratio", number(ratio) if number(ratio) is not None else ratio)
    if steps is not None:
        count = whole(steps)
        if count == 0:
            b.map("warmup_steps", "train.warmup_ratio", 0.0, "no warmup")
        elif max_steps > 0 and count is not None:
            b.map("warmup_steps", "train.warmup_ratio", count / max_steps, f"{count} of max_steps {max_steps}")
        else:
            b.refuse(
                "warmup_steps",
                "dzctl's warmup is a fraction of the run (train.warmup_ratio); without max_steps the number of "
                "steps depends on the data and the GPUs",
                lifted_by="train.warmup_ratio",
            )
    elif ratio is None:
        b.default(
            "train.warmup_ratio",
            0.03,
            "axolotl warms up 3% of the steps when neither warmup_steps nor warmup_ratio is given "
            "(at most 100 steps: the same below 3,334 steps)",
        )


def _evaluation(b: Builder) -> None:
    has_eval = bool(number(b.value("val_set_size")))
    for key in ("eval_steps", "evals_per_epoch", "eval_strategy"):
        if b.given(key) and not has_eval:
            b.ignore(key, "no eval data (val_set_size is 0)")
    if not has_eval:
        return
    if b.given("eval_strategy"):
        b.ignore("eval_strategy", "dzctl evaluates every train.eval_steps, and at the end")
    every = b.value("eval_steps")
    if every is not None:
        count = whole(every)
        if count is not None and count >= 1:
            b.map("eval_steps", "train.eval_steps", count)
        else:
            b.refuse("eval_steps", "a fraction of the run: dzctl's train.eval_steps counts steps", "train.eval_steps")
    per_epoch = whole(b.value("evals_per_epoch"))
    if b.given("evals_per_epoch"):
        max_steps = whole(b.value("max_steps")) or -1
        if every is not None:
            b.ignore("evals_per_epoch", "eval_steps is given and wins")
        elif per_epoch and max_steps > 0 and (number(b.value("num_epochs")) or 1) == 1:
            steps = max(1, max_steps // per_epoch)
            b.map("evals_per_epoch", "train.eval_steps", steps, f"max_steps {max_steps} / {per_epoch}")
        else:
            b.refuse(
                "evals_per_epoch",
                "dzctl evaluates every train.eval_steps steps, and the steps of an epoch depend on the data and GPUs",
                "train.eval_steps",
            )
