"""LLaMA-Factory's training YAML (``llamafactory-cli train FILE``) as a dzctl job: its key map.

The keys are those of its argument classes (``src/llamafactory/hparams/``: ``ModelArguments``,
``DataArguments``, ``FinetuningArguments`` and HF's ``Seq2SeqTrainingArguments``), read with their
defaults where dzctl's differ: HF's per-device batch of 8, learning rate 5e-5, 3 epochs and linear
schedule; ``finetuning_type: lora`` with rank 8 and alpha twice the rank; no packing for SFT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .keymap import (
    ALL_LINEAR_TARGETS,
    Builder,
    Handler,
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
    report_to,
    resume_from,
    scheduler,
    truthy,
    walk,
    whole,
)

TOOL = "LLaMA-Factory"

# LLaMA-Factory's template names whose prompt is the model's own chat template, which dzctl renders
# (data.template: auto, the tokenizer's own); the value: data.enable_thinking to pass with it. Others
# differ from the model's own in ways a table cannot promise away (``llama3`` leaves out Llama 3.1's
# date block, ``qwen`` adds Qwen2.5's default system prompt): they are refused unless data.template is set.
OWN_TEMPLATES: dict[str, bool | None] = {"qwen3": None, "qwen3_nothink": False}
# ``qwen`` adds "You are Qwen, created by Alibaba Cloud. ..." to rows without a system turn: so does
# Qwen2.5's own template, and Qwen3's does not.
QWEN25_ONLY = "qwen"
BUILTIN_TEMPLATES = {"chatml": "chatml", "empty": "plain"}


def _from_scratch(b: Builder, key: str, value: Any) -> None:
    if truthy(value):
        b.map(key, "model.init", "random", "random weights of the model's config, as LLaMA-Factory does")
    else:
        b.ignore(key, "false: the pretrained weights, as dzctl's default")


def _stage(b: Builder, key: str, value: Any) -> None:
    if value == "sft":
        # Not written: dzctl trains SFT unless train.stage says otherwise (issue 44's key).
        b.mapped_only(key, "train.stage", "sft", "supervised fine-tuning: dzctl's default")
    elif value in ("dpo", "kto"):
        b.map(key, "train.stage", value)
    elif value == "pt":
        b.refuse(key, "continued pretraining: dzctl trains plain-text rows as data.format: text in its own job YAML")
    else:
        b.refuse(key, f"stage {value!r} (reward model, PPO) is not a kind of training dzctl runs")


def _finetuning(b: Builder, key: str, value: Any) -> None:
    if value in ("full", "lora"):
        b.map(key, "train.method", value)
    else:
        b.refuse(key, f"finetuning_type {value!r}: dzctl trains every weight (full) or LoRA adapters (lora)")


def _pref(target: str) -> Handler:
    def handle(b: Builder, key: str, value: Any) -> None:
        if b.value("stage") in ("dpo", "kto"):
            b.map(key, target, value if isinstance(value, str) else number(value))
        else:
            b.ignore(key, "read only for stage: dpo or kto")

    return handle


def _lora_only(target: str, kind: str) -> Handler:
    def handle(b: Builder, key: str, value: Any) -> None:
        if _is_lora(b):
            got = whole(value) if kind == "int" else number(value)
            b.map(key, target, value if got is None else got)
        else:
            b.ignore(key, "read only with finetuning_type: lora")

    return handle


def _is_lora(b: Builder) -> bool:
    return b.value("finetuning_type") in (None, "lora")  # LoRA is LLaMA-Factory's default


def _lora_target(b: Builder, key: str, value: Any) -> None:
    if not _is_lora(b):
        b.ignore(key, "read only with finetuning_type: lora")
    elif names(value) == ["all"]:
        b.map(key, "train.lora.target_modules", list(ALL_LINEAR_TARGETS), _ALL_TARGETS)
    else:
        b.map(key, "train.lora.target_modules", names(value))


_ALL_TARGETS = "all: every linear layer but the output head; of a Qwen/Llama/Mistral model, these seven projections"


_batch, _batch_note = per_gpu_batch("LLaMA-Factory", "per_device_train_batch_size", 8)


def _template(b: Builder, key: str, value: Any) -> None:
    name = str(value)
    if name in BUILTIN_TEMPLATES:
        b.map(key, "data.template", BUILTIN_TEMPLATES[name])
    elif name == QWEN25_ONLY and "qwen2.5" in str(b.value("model_name_or_path")).lower():
        b.map(key, "data.template", "auto", "qwen: Qwen2.5's own chat template, with its default system prompt")
    elif name == QWEN25_ONLY:
        b.refuse(
            key,
            "qwen adds Qwen2.5's system prompt (You are Qwen, created by Alibaba Cloud...) to rows without one, and "
            "this model's own template may not (Qwen3's does not): set data.template (auto: the model's own; "
            "or a Jinja file)",
            lifted_by="data.template",
        )
    elif name in OWN_TEMPLATES:
        b.map(key, "data.template", "auto", f"{name}: the model's own chat template, which dzctl renders")
        thinking = OWN_TEMPLATES[name]
        if thinking is not None and "enable_thinking" not in b.raw:
            b.note(key, "data.enable_thinking", thinking, f"{name}: the template without thinking")
    else:
        b.refuse(
            key,
            f"template {name!r} is LLaMA-Factory's own prompt format; dzctl renders the model's chat template "
            "(auto), chatml, plain or a Jinja file",
            lifted_by="data.template",
        )


def _eval_steps(b: Builder, key: str, value: Any) -> None:
    pass  # read with eval_strategy in _finish


def _warmup_steps(b: Builder, key: str, value: Any) -> None:
    pass  # read with max_steps in _finish


def _precision(name: str) -> Handler:
    def handle(b: Builder, key: str, value: Any) -> None:
        if truthy(value):
            b.map(key, "train.precision", name)
        else:
            b.ignore(key, "false")

    return handle


def _pure_bf16(b: Builder, key: str, value: Any) -> None:
    if truthy(value):
        # LLaMA-Factory itself refuses pure_bf16 under DeepSpeed ZeRO-3 (hparams/parser.py); what it means
        # (bf16 weights and AdamW states, no fp32 copy: its trainable parameters are not upcast) is what
        # DeepSpeed's bf16_master_weights_and_grads and bf16_optimizer_states keep under ZeRO-3.
        map_pure_bf16(b, key, "bf16 weights, gradients and AdamW states, no fp32 master copy")
    else:
        b.ignore(key, "false")


def _output_dir(b: Builder, key: str, value: Any) -> None:
    if isinstance(value, str) and value.startswith("/"):
        b.map(key, "train.output_dir", value, "on every node")
    else:
        b.ignore(
            key,
            "relative to where llamafactory-cli ran; dzctl writes to <launch.remote_dir>/output/<name> on every "
            "node (--set train.output_dir=/ABSOLUTE/PATH for another)",
        )


def _do_train(b: Builder, key: str, value: Any) -> None:
    if truthy(value):
        b.ignore(key, "dzctl trains")
    else:
        b.refuse(key, "do_train: false trains nothing; dzctl only trains")


def _packing(b: Builder, key: str, value: Any) -> None:
    if value is None:
        b.ignore(key, "unset: packing only for stage pt, as in LLaMA-Factory")
        return
    b.map(key, "train.packing", truthy(value), _PACKING if truthy(value) else "")


_PACKING = (
    "dzctl's packing keeps the examples of a row apart (their own positions, no attention across them), "
    "as LLaMA-Factory's neat_packing"
)


def _neat_packing(b: Builder, key: str, value: Any) -> None:
    if truthy(value):
        b.map(key, "train.packing", True, _PACKING)
    else:
        b.ignore(key, "false")


def _seed(b: Builder, key: str, value: Any) -> None:
    b.map(key, "train.seed", whole(value) if whole(value) is not None else value)


def _data_seed(b: Builder, key: str, value: Any) -> None:
    if value is None or value == b.value("seed"):
        b.ignore(key, "the same as seed: dzctl shuffles with train.seed")
    else:
        b.refuse(key, "dzctl shuffles the data with train.seed; a separate data seed changes the order", "train.seed")


def _metric(b: Builder, key: str, value: Any) -> None:
    if value in (None, "loss", "eval_loss"):
        b.ignore(key, "the eval loss: what dzctl's best checkpoint is chosen by")
    else:
        b.refuse(key, "dzctl chooses the best checkpoint by the eval loss only")


def _best(b: Builder, key: str, value: Any) -> None:
    if truthy(value):
        b.map(key, "train.save_best", True, "the best eval loss's checkpoint is kept (and named in dzctl-best.json)")
    else:
        b.ignore(key, "false")


def _dataset(b: Builder, key: str, value: Any) -> None:
    b.map(key, "data.dataset", names(value), "names in the dataset_info.json registry, concatenated")


def _dataset_dir(b: Builder, key: str, value: Any) -> None:
    b.map(key, "data.dataset_info", value, "the folder holding dataset_info.json, relative to this YAML")


def _interleave_probs(b: Builder, key: str, value: Any) -> None:
    b.map(key, "data.interleave_probs", [number(p) if number(p) is not None else p for p in names(value)])


def _max_samples(b: Builder, key: str, value: Any) -> None:
    if value is None:
        b.ignore(key, "unset: every row")
    else:
        b.map(key, "data.max_rows", whole(value) if whole(value) is not None else value, "the first N rows of each")


def _eval_strategy(b: Builder, key: str, value: Any) -> None:
    pass  # read with eval_steps in _finish


LOGGING = "logging only"
SPEED = "speed or memory only: the same training"
NOT_TRAINING = "not part of training (preprocessing, caching, inference or export)"
MULTIMODAL = "read only for image, video or audio rows (dzctl trains text models and refuses such rows)"

KEYS: dict[str, Handler] = {
    # --- model (ModelArguments) ---
    "model_name_or_path": direct("model.name_or_path"),
    "train_from_scratch": _from_scratch,
    "trust_remote_code": ignored("dzctl loads the model through its transformers class"),
    "cache_dir": ignored(NOT_TRAINING),
    "model_revision": off("a revision other than main: download it and give the folder as the model", "main"),
    "use_fast_tokenizer": ignored(NOT_TRAINING),
    "resize_vocab": off("resizing the vocabulary changes the model"),
    "split_special_tokens": off("changes how special tokens are tokenized"),
    "add_tokens": off("new tokens change the model's vocabulary", None),
    "add_special_tokens": off("new special tokens change the model's vocabulary", None),
    "new_special_tokens": off("new special tokens change the model's vocabulary", None),
    "low_cpu_mem_usage": ignored(SPEED),
    "rope_scaling": off(
        "RoPE scaling changes the model's positions: set it in model.config (rope_scaling: {...})",
        None,
        "model.config",
    ),
    "flash_attn": ignored(SPEED + "; dzctl picks the attention kernel"),
    "attn": ignored(SPEED + "; dzctl picks the attention kernel"),
    "shift_attn": off("shift short attention (LongLoRA) changes the attention"),
    "mixture_of_depths": off("mixture of depths changes the model", None),
    "use_unsloth": ignored(SPEED),
    "use_unsloth_gc": ignored(SPEED),
    "enable_liger_kernel": ignored(SPEED + "; dzctl fuses the loss itself (train.fused_loss: auto)"),
    "moe_aux_loss_coef": off("dzctl keeps the model's own router loss coefficient", None),
    "disable_gradient_checkpointing": ignored(SPEED + "; dzctl's planner decides checkpointing"),
    "use_reentrant_gc": ignored(SPEED),
    "upcast_layernorm": off("upcasting layer norms changes the numerics dzctl trains with"),
    "upcast_lmhead_output": off("upcasting the output head changes the numerics dzctl trains with"),
    "hf_hub_token": ignored("a credential: dzctl reads HF_TOKEN from launch.env or launch.env_file"),
    "ms_hub_token": ignored(NOT_TRAINING),
    "om_hub_token": ignored(NOT_TRAINING),
    "print_param_status": ignored(LOGGING),
    "use_kv_cache": ignored(NOT_TRAINING),
    "infer_backend": ignored(NOT_TRAINING),
    "infer_dtype": ignored(NOT_TRAINING),
    "offload_folder": ignored(NOT_TRAINING),
    "quantization_bit": off("quantized (QLoRA) training: dzctl trains bf16/fp16/fp32 weights", None),
    "quantization_method": ignored("read only with quantization_bit"),
    "quantization_type": ignored("read only with quantization_bit"),
    "double_quantization": ignored("read only with quantization_bit"),
    "quantization_device_map": ignored("read only with quantization_bit"),
    "adapter_name_or_path": off("training on from an existing adapter: merge it into the model first", None),
    "adapter_folder": ignored("read only with adapter_name_or_path"),
    "image_max_pixels": ignored(MULTIMODAL),
    "image_min_pixels": ignored(MULTIMODAL),
    "image_do_pan_and_scan": ignored(MULTIMODAL),
    "video_max_pixels": ignored(MULTIMODAL),
    "video_min_pixels": ignored(MULTIMODAL),
    "video_fps": ignored(MULTIMODAL),
    "video_maxlen": ignored(MULTIMODAL),
    "audio_sampling_rate": ignored(MULTIMODAL),
    "use_audio_in_video": ignored(MULTIMODAL),
    "crop_to_patches": ignored(MULTIMODAL),
    "freeze_vision_tower": ignored(MULTIMODAL),
    "freeze_multi_modal_projector": ignored(MULTIMODAL),
    "media_dir": ignored(MULTIMODAL),
    # --- method (FinetuningArguments) ---
    "stage": _stage,
    "finetuning_type": _finetuning,
    "do_train": _do_train,
    "do_eval": ignored("dzctl evaluates when there is eval data (val_size)"),
    "do_predict": off("prediction is not training"),
    "predict_with_generate": ignored(NOT_TRAINING),
    "lora_rank": _lora_only("train.lora.r", "int"),
    "lora_alpha": _lora_only("train.lora.alpha", "float"),
    "lora_dropout": _lora_only("train.lora.dropout", "float"),
    "lora_target": _lora_target,
    "additional_target": off("modules trained in full beside the adapters", None),
    "loraplus_lr_ratio": off("LoRA+ gives the B matrices another learning rate", None),
    "loraplus_lr_embedding": ignored("read only with loraplus_lr_ratio"),
    "use_rslora": off("rank-stabilised LoRA scales the adapters by alpha/sqrt(r)"),
    "use_dora": off("DoRA adapters"),
    "pissa_init": off("PiSSA initialises the adapters from the weights"),
    "pissa_iter": ignored("read only with pissa_init"),
    "pissa_convert": ignored("read only with pissa_init"),
    "create_new_adapter": off("read only with adapter_name_or_path"),
    "freeze_trainable_layers": ignored("read only with finetuning_type: freeze"),
    "freeze_trainable_modules": ignored("read only with finetuning_type: freeze"),
    "freeze_extra_modules": ignored("read only with finetuning_type: freeze"),
    "freeze_language_model": off("a frozen language model trains nothing dzctl can train"),
    "use_llama_pro": off("LLaMA Pro adds blocks to the model"),
    "use_adam_mini": off("Adam-mini is another optimizer"),
    "use_muon": off("Muon is another optimizer"),
    "use_galore": off("GaLore projects the gradients"),
    "use_apollo": off("APOLLO is another optimizer"),
    "use_badam": off("BAdam trains one block at a time"),
    "disable_shuffling": off("dzctl shuffles the rows"),
    "compute_accuracy": ignored(LOGGING),
    "plot_loss": ignored(LOGGING + ": dzctl plots the loss itself (dzctl logs --plot)"),
    "include_effective_tokens_per_second": ignored(LOGGING),
    "pref_beta": _pref("train.pref_beta"),
    "pref_ftx": _pref("train.pref_ftx"),
    "pref_loss": _pref("train.pref_loss"),
    "simpo_gamma": _pref("train.simpo_gamma"),
    "kto_chosen_weight": _pref("train.kto_chosen_weight"),
    "kto_rejected_weight": _pref("train.kto_rejected_weight"),
    "pref_bco_weight": off("the BCO term of the preference loss", 0.0),
    "dpo_label_smoothing": off("label smoothing of the DPO loss", 0.0),
    "ld_alpha": off("LD-DPO's length weighting", None),
    "ref_model": off("a reference model other than the trained model's start", None),
    "ref_model_adapters": ignored("read only with ref_model"),
    "ref_model_quantization_bit": ignored("read only with ref_model"),
    "reward_model": ignored("read only for stage: ppo"),
    "reward_model_type": ignored("read only for stage: ppo"),
    # --- data (DataArguments) ---
    "dataset": _dataset,
    "dataset_dir": _dataset_dir,
    "eval_dataset": off("evaluation on registry datasets: give dzctl data.eval (path or sources)", None, "data.eval"),
    "template": _template,
    "cutoff_len": direct("train.max_seq_len", "int", "tokens per example (longer ones are cut, as there)"),
    "train_on_prompt": off("dzctl trains the answers, never the prompt"),
    "mask_history": off("dzctl trains every answer of a conversation, not the last only"),
    "streaming": off("dzctl reads and tokenizes the whole data set before training"),
    "buffer_size": ignored("read only with streaming"),
    "mix_strategy": direct("data.mix_strategy"),
    "interleave_probs": _interleave_probs,
    "overwrite_cache": ignored(NOT_TRAINING),
    "preprocessing_batch_size": ignored(NOT_TRAINING),
    "preprocessing_num_workers": ignored(NOT_TRAINING),
    "max_samples": _max_samples,
    "eval_num_beams": ignored(NOT_TRAINING),
    "ignore_pad_token_for_loss": ignored("dzctl never trains padding"),
    "val_size": held_out_rows,
    "eval_on_each_dataset": off("dzctl evaluates the held-out rows together"),
    "packing": _packing,
    "neat_packing": _neat_packing,
    "tool_format": off("dzctl renders tool calls with the model's own chat template", None, "data.template"),
    "default_system": off("a system prompt added to every row changes the prompts", None),
    "enable_thinking": direct("data.enable_thinking", "bool", "passed to the chat template, as there"),
    "tokenized_path": off("dzctl tokenizes the rows itself (LLaMA-Factory's saved tokens are not read)", None),
    "data_shared_file_system": ignored(NOT_TRAINING),
    # --- training (HF TrainingArguments) ---
    "output_dir": _output_dir,
    "overwrite_output_dir": ignored("dzctl resumes from what is there (train.resume: auto)"),
    "per_device_train_batch_size": _batch,
    "per_device_eval_batch_size": ignored(SPEED + " (evaluation's batch)"),
    "gradient_accumulation_steps": direct("train.gradient_accumulation_steps", "int", "fixed, as there"),
    "eval_accumulation_steps": ignored(SPEED),
    "learning_rate": direct("train.learning_rate", "float"),
    "weight_decay": direct("train.weight_decay", "float"),
    "adam_beta1": off("dzctl's AdamW uses beta1 0.9", 0.9),
    "adam_beta2": off("dzctl's AdamW uses beta2 0.999", 0.999),
    "adam_epsilon": off("dzctl's AdamW uses epsilon 1e-8", 1e-8),
    "max_grad_norm": direct("train.max_grad_norm", "float"),
    "num_train_epochs": direct("train.epochs", "float"),
    "max_steps": direct("train.max_steps", "int"),
    "lr_scheduler_type": scheduler,
    "lr_scheduler_kwargs": off("scheduler arguments dzctl's schedules do not take", None),
    "warmup_ratio": direct("train.warmup_ratio", "float"),
    "warmup_steps": _warmup_steps,
    "logging_steps": direct("train.logging_steps", "int", LOGGING),
    "logging_strategy": ignored(LOGGING),
    "logging_first_step": ignored(LOGGING),
    "logging_dir": ignored(LOGGING),
    "eval_strategy": _eval_strategy,
    "evaluation_strategy": _eval_strategy,
    "eval_steps": _eval_steps,
    "save_strategy": ignored("when checkpoints are written: dzctl saves every train.save_steps"),
    "save_steps": direct("train.save_steps", "int"),
    "save_total_limit": direct("train.save_total_limit", "int"),
    "save_only_model": ignored("dzctl's checkpoints keep the optimizer too, so a run can resume"),
    "save_safetensors": ignored(NOT_TRAINING),
    "load_best_model_at_end": _best,
    "metric_for_best_model": _metric,
    "greater_is_better": off("the eval loss is better lower"),
    "early_stopping_steps": direct("train.early_stopping.patience", "int", "evals without a better eval loss"),
    "seed": _seed,
    "data_seed": _data_seed,
    "bf16": _precision("bf16"),
    "fp16": _precision("fp16"),
    "pure_bf16": _pure_bf16,
    "tf32": ignored(SPEED + ": matmul precision of fp32 layers on the GPUs"),
    "gradient_checkpointing": ignored(SPEED + ": the same gradients; dzctl's planner decides checkpointing"),
    "gradient_checkpointing_kwargs": ignored(SPEED),
    "deepspeed": ds_config_file(" (LLaMA-Factory reads it from where it was started)"),
    "optim": optimizer,
    "ddp_timeout": ignored("dzctl sets the process group's timeouts per phase (train/hang/timeout.py)"),
    "ddp_find_unused_parameters": ignored(SPEED),
    "ddp_backend": ignored("dzctl picks NCCL on GPUs, gloo on CPUs"),
    "dataloader_num_workers": ignored(SPEED),
    "dataloader_pin_memory": ignored(SPEED),
    "dataloader_persistent_workers": ignored(SPEED),
    "dataloader_prefetch_factor": ignored(SPEED),
    "report_to": report_to,
    "run_name": ignored(LOGGING),
    "resume_from_checkpoint": resume_from,
    "torch_compile": ignored(SPEED),
    "include_num_input_tokens_seen": ignored(LOGGING),
    "include_tokens_per_second": ignored(LOGGING),
    "disable_tqdm": ignored(LOGGING),
    "remove_unused_columns": ignored(NOT_TRAINING),
    "push_to_hub": ignored(NOT_TRAINING + ": dzctl export writes the model"),
    "hub_model_id": ignored(NOT_TRAINING),
    "hub_strategy": ignored(NOT_TRAINING),
    "hub_token": ignored("a credential, read only to push to the hub"),
    "label_smoothing_factor": off("label smoothing changes the loss", 0.0),
    "neftune_noise_alpha": off("NEFTune adds noise to the embeddings", None),
    "group_by_length": off("batches of like lengths change which rows train together"),
    "max_new_tokens": ignored(NOT_TRAINING),
    "do_sample": ignored(NOT_TRAINING),
    "temperature": ignored(NOT_TRAINING),
    "top_p": ignored(NOT_TRAINING),
    "top_k": ignored(NOT_TRAINING),
}


def convert(b: Builder, path: Path) -> None:
    walk(b, KEYS)
    _finish(b)


def _finish(b: Builder) -> None:
    """Keys read together, and LLaMA-Factory's defaults where dzctl's differ."""
    given = b.given
    if not given("finetuning_type"):
        b.default("train.method", "lora", "LLaMA-Factory's default finetuning_type: lora")
    if _is_lora(b):
        rank = whole(b.value("lora_rank")) or 8
        if not given("lora_rank"):
            b.default("train.lora.r", 8, "LLaMA-Factory's default lora_rank")
        if not given("lora_alpha"):
            b.default("train.lora.alpha", float(rank * 2), "LLaMA-Factory's default lora_alpha: twice the rank")
        if not given("lora_target"):
            b.default(
                "train.lora.target_modules",
                list(ALL_LINEAR_TARGETS),
                f"LLaMA-Factory's default lora_target {_ALL_TARGETS}",
            )
    if not given("per_device_train_batch_size"):
        b.default("train.micro_batch_size", 8, "HF's default per_device_train_batch_size; " + _batch_note(b))
    if not given("gradient_accumulation_steps"):
        b.default("train.gradient_accumulation_steps", 1, "HF's default, fixed as there")
    for key, target, value, what in (
        ("learning_rate", "train.learning_rate", 5e-5, "HF's default learning_rate"),
        ("lr_scheduler_type", "train.lr_scheduler", "linear", "HF's default lr_scheduler_type"),
    ):
        if not given(key):
            b.default(target, value, what)
    if not given("num_train_epochs") and (whole(b.value("max_steps")) or -1) <= 0:
        b.default("train.epochs", 3.0, "HF's default num_train_epochs")
    if not any(truthy(b.value(key)) for key in ("bf16", "fp16", "pure_bf16")):
        b.default("train.precision", "fp32", "neither bf16, fp16 nor pure_bf16 is true: LLaMA-Factory trains in fp32")
    if not given("packing") and not truthy(b.value("neat_packing")):
        b.default("train.packing", False, "LLaMA-Factory packs only for stage pt")
    if not given("template"):
        b.default("data.template", "auto", "no template: the tokenizer's own chat template")
    if given("dataset") and not given("dataset_dir"):
        b.default("data.dataset_info", "data", "LLaMA-Factory's default dataset_dir, read beside this YAML")
    _warmup(b)
    _evaluation(b)


def _warmup(b: Builder) -> None:
    if not b.given("warmup_steps"):
        return
    steps = whole(b.value("warmup_steps"))
    max_steps = whole(b.value("max_steps")) or -1
    if not steps:
        b.ignore("warmup_steps", "0: no warmup steps (warmup_ratio decides)")
    elif max_steps > 0:
        b.map("warmup_steps", "train.warmup_ratio", steps / max_steps, f"{steps} of max_steps {max_steps}")
    else:
        b.refuse(
            "warmup_steps",
            "dzctl's warmup is a fraction of the run (train.warmup_ratio); without max_steps the number of steps "
            "depends on the data and the GPUs",
            lifted_by="train.warmup_ratio",
        )


def _evaluation(b: Builder) -> None:
    key = "eval_strategy" if b.given("eval_strategy") else "evaluation_strategy"
    strategy = b.value(key) or "no"
    if b.given(key):
        if strategy == "steps":
            b.ignore(key, "steps: dzctl evaluates every train.eval_steps (see eval_steps)")
        elif strategy == "no":
            b.ignore(key, "no: no evaluation during the run")
        else:
            b.refuse(key, f"{strategy!r}: dzctl evaluates every train.eval_steps steps", lifted_by="train.eval_steps")
    if strategy == "steps":
        every = whole(b.value("eval_steps")) or whole(b.value("logging_steps")) or 500
        if b.given("eval_steps"):
            b.map("eval_steps", "train.eval_steps", every)
        else:
            b.default("train.eval_steps", every, "eval_strategy: steps without eval_steps: HF uses logging_steps")
    elif b.given("eval_steps"):
        b.ignore("eval_steps", f"read only with eval_strategy: steps (this YAML: {strategy})")
