"""The DeepSpeed ZeRO-3 config of a job, built from the spec and the resolved choices (pure: no torch).

The controller (``dzctl plan``/``launch``), the memory planner and the in-container
trainer all call this module, so it imports nothing heavier than the spec.

API (stable; callers rely on it):

- ``Resolved``: the concrete choices a config needs. ``micro_batch_size``,
  ``gradient_checkpointing``, ``offload_optimizer``, ``offload_param``,
  ``reduce_bucket_size``, ``prefetch_bucket_size``, ``param_persistence_threshold``
  (``None`` = leave ``"auto"`` for the HF Trainer, which sizes them from the
  model's hidden size) and ``precision`` (``bf16``/``fp16``/``fp32``).
- ``resolve_defaults(spec, *, bf16_supported=True) -> Resolved``: the choices when
  no planner result is given (``auto`` resolved conservatively: micro-batch 1,
  checkpointing on for GPUs, no offload).
- ``bucket_sizes(hidden_size) -> (reduce, prefetch, persistence)``: the sizes the
  planner should put into ``Resolved`` once it knows the hidden size.
- ``build_ds_config(spec, resolved, world_size) -> dict``: the generated config,
  with ``zero.overrides`` merged in last.
- ``load_user_config(loaded_job) -> dict | None``: ``zero.config`` read (JSON), errors
  naming the file.
- ``refuse_unsupported(loaded_job, user)``: raises ``InputError`` for a DeepSpeed setting of the job's own
  (``zero.config``, already read, or ``zero.overrides``) known not to run under dzctl: ``zero_optimization.zenflow``.
- ``merge(base, overrides) -> dict``: deep merge, overrides win.
- ``fill_auto(ds, resolved, world_size, spec) -> dict``: replace ``"auto"`` values
  with the resolved ones, for a config that must be concrete before launch.
- ``with_pure_bf16(ds, spec) -> dict``: ``train.pure_bf16`` as DeepSpeed's two bf16 keys
  (``PURE_BF16_KEYS``), where the config leaves them open; ``pure_bf16_of(ds) -> bool``: whether
  a config keeps bf16 master weights, gradients and optimizer states; ``bf16_section_to_run(spec, user,
  precision) -> dict``: that section of ``ds_config_for``'s config alone.
- ``auto_filled(user, final, overrides) -> list[(key, value)]``: which of ``zero.config``'s
  ``"auto"`` values the job's config filled, and with what (``launch --dry-run`` shows them);
  ``auto_left(final) -> list[key]``: those still ``"auto"`` (the HF Trainer fills them).
- ``ds_config_for(spec, user_config, resolved, world_size) -> dict``: the one entry point:
  ``zero.config`` (if given, already read) or the generated config, plus ``zero.overrides``;
  ``job_ds_config(loaded_job, resolved, world_size)`` reads ``zero.config`` first.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import InputError, SpecError
from ..spec.job import JobSpec, LoadedJob, shown_override

Precision = Literal["bf16", "fp16", "fp32"]


@dataclass(frozen=True)
class Resolved:
    """Concrete values for every ``auto`` in the spec that the DeepSpeed config depends on."""

    micro_batch_size: int
    gradient_checkpointing: bool
    offload_optimizer: bool
    offload_param: bool
    reduce_bucket_size: int | None
    prefetch_bucket_size: int | None
    param_persistence_threshold: int | None
    precision: Precision
    # train.fused_loss as the planner resolved it (orchestrator/planning/fusedloss.py); None: not resolved here.
    fused_loss: str | None = None
    # offload: nvme (ZeRO-Infinity): both offloads go to this folder instead of host RAM.
    nvme_path: str | None = None
    # Elements of one parameter swap buffer; DeepSpeed needs it to hold the largest weight.
    nvme_buffer_elements: int | None = None
    # ZeRO++ hpZ: a secondary copy of the weights within groups of this many GPUs (one node);
    # 1 = off. Chosen by planning/speed/zerochoice.py for multi-node jobs.
    hpz_partition_size: int = 1
    # train.gradient_checkpointing: N: the first N decoder layers recompute (None: all, when on).
    checkpointed_layers: int | None = None

    @property
    def checkpointing_setting(self) -> bool | int:
        """What ``train.gradient_checkpointing`` says for these choices in a resolved job file."""
        if self.gradient_checkpointing and self.checkpointed_layers is not None:
            return self.checkpointed_layers
        return self.gradient_checkpointing


def bucket_sizes(hidden_size: int) -> tuple[int, int, int]:
    """ZeRO-3 bucket/prefetch/persistence sizes from the hidden size.

    The same rule the HF integration applies to ``"auto"`` (hidden², 0.9·hidden²,
    10·hidden): buckets about one weight matrix large keep the all-gathers and
    reduce-scatters big enough to run at link speed without holding much memory.
    """
    return hidden_size * hidden_size, int(0.9 * hidden_size * hidden_size), 10 * hidden_size


# bf16 tensor cores arrived with Ampere (compute capability 8.0); V100 (7.0) and T4 (7.5)
# have none, and torch.cuda.is_bf16_supported() says False there.
BF16_MIN_COMPUTE_CAPABILITY = 8.0


def bf16_supported_by(compute_capability: float | None) -> bool:
    """Whether GPUs of this compute capability train in bf16; unknown (``None``) counts as yes."""
    return compute_capability is None or compute_capability >= BF16_MIN_COMPUTE_CAPABILITY


def resolve_precision(spec: JobSpec, *, bf16_supported: bool = True) -> Precision:
    """``auto``: bf16 where the GPU has it, else fp16 (dynamic loss scaling); fp32 on CPU."""
    chosen = spec.train.precision
    if chosen != "auto":
        return chosen
    if spec.accelerator == "cpu":
        # DeepSpeed's CPU path is for tests and small runs; fp32 keeps its results exact.
        return "fp32"
    if not bf16_supported and spec.train.pure_bf16:
        # The spec's own check (spec/job.py) cannot know the GPUs: preflight's compute capability decides here.
        raise SpecError(
            "train.pure_bf16: these GPUs have no bf16 (compute capability below 8.0), so train.precision: auto "
            "is fp16 on them, and pure_bf16 keeps bf16 states",
            fix="remove train.pure_bf16 (fp16 mixed precision keeps fp32 master weights), or use GPUs with bf16",
        )
    return "bf16" if bf16_supported else "fp16"


def resolve_defaults(spec: JobSpec, *, bf16_supported: bool = True) -> Resolved:
    """The choices used when no planner result is given: safe rather than fast."""
    train = spec.train
    micro = train.micro_batch_size if train.micro_batch_size != "auto" else 1
    layers: int | None = None
    if train.gradient_checkpointing == "auto":
        # On GPUs activations are what runs out first; tiny CPU models do not need it.
        checkpointing = spec.accelerator == "gpu"
    elif isinstance(train.gradient_checkpointing, bool):
        checkpointing = train.gradient_checkpointing
    else:  # N layers
        checkpointing = train.gradient_checkpointing > 0
        layers = train.gradient_checkpointing or None
    offload = spec.zero.offload if spec.zero.offload != "auto" else "none"
    hidden = (spec.model.config or {}).get("hidden_size")
    vocab = (spec.model.config or {}).get("vocab_size")
    sizes: tuple[int | None, int | None, int | None] = (None, None, None)
    if isinstance(hidden, int) and hidden > 0:
        sizes = bucket_sizes(hidden)
    return Resolved(
        micro_batch_size=micro,
        gradient_checkpointing=checkpointing,
        offload_optimizer=offload in ("optimizer", "all", "nvme"),
        offload_param=offload in ("all", "nvme"),
        reduce_bucket_size=sizes[0],
        prefetch_bucket_size=sizes[1],
        param_persistence_threshold=sizes[2],
        precision=resolve_precision(spec, bf16_supported=bf16_supported),
        nvme_path=spec.zero.nvme_path if offload == "nvme" else None,
        nvme_buffer_elements=hidden * vocab if isinstance(hidden, int) and isinstance(vocab, int) else None,
        checkpointed_layers=layers,
    )


# DeepSpeed's defaults for ZeRO-Infinity (docs: "Parameter offloading", "Asynchronous I/O"),
# written out so a plan shows them: 5 pinned parameter buffers of at least 1e8 elements,
# 4 optimizer swap buffers, and libaio reads/writes of 1 MiB blocks, 8 deep.
NVME_PARAM_BUFFERS = 5
NVME_MIN_BUFFER_ELEMENTS = 100_000_000
NVME_OPTIMIZER_BUFFERS = 4
# The optimizer steps one sub-group at a time, swapping its fp32 states in and out of
# NVMe; 1e8 elements (DeepSpeed's ZeRO-Infinity examples) keeps those pinned buffers at
# 1.6 GB instead of the 16 GB of the default 1e9.
NVME_SUB_GROUP_SIZE = 100_000_000
AIO_CONFIG = {
    "block_size": 1_048_576,
    "queue_depth": 8,
    "thread_count": 1,
    "single_submit": False,
    "overlap_events": True,
}


def nvme_buffer_size(resolved: Resolved) -> int:
    """Elements per parameter swap buffer: the default, or the largest weight where that is larger."""
    return max(NVME_MIN_BUFFER_ELEMENTS, resolved.nvme_buffer_elements or 0)


def nvme_sections(resolved: Resolved) -> dict[str, Any]:
    """The ``zero_optimization`` entries of ZeRO-Infinity: parameters and optimizer states on NVMe."""
    path = resolved.nvme_path
    return {
        "offload_param": {
            "device": "nvme",
            "nvme_path": path,
            "pin_memory": True,
            "buffer_count": NVME_PARAM_BUFFERS,
            "buffer_size": nvme_buffer_size(resolved),
        },
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": path,
            "pin_memory": True,
            "buffer_count": NVME_OPTIMIZER_BUFFERS,
        },
        "sub_group_size": NVME_SUB_GROUP_SIZE,
    }


def _auto(value: int | None) -> int | str:
    return "auto" if value is None else value


# DeepSpeed's keys of the "bf16" section (runtime/precision_config.py) that ``train.pure_bf16`` sets: the ZeRO
# optimizer's master weights and gradient partitions in bf16, and AdamW's m and v with them. Both or neither:
# DeepSpeed refuses the states alone, and wants its CPU Adam on offloaded states for the master weights alone.
PURE_BF16_KEYS = ("bf16_master_weights_and_grads", "bf16_optimizer_states")


def with_pure_bf16(config: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    """``config`` with ``train.pure_bf16`` in its enabled bf16 section, where the section leaves a key open.

    Open: absent, or ``"auto"``. A value the user's ``zero.config`` writes stays (as ``fill_auto`` keeps every
    other written value); a config that does not run bf16 gets no key (the planner then refuses the job).
    """
    section = config.get("bf16")
    if not isinstance(section, dict) or section.get("enabled") is not True:
        return config
    out = copy.deepcopy(config)
    for key in PURE_BF16_KEYS:
        if out["bf16"].get(key, "auto") == "auto" and (spec.train.pure_bf16 or key in out["bf16"]):
            out["bf16"][key] = spec.train.pure_bf16
    return out


def bf16_section_to_run(spec: JobSpec, user: dict[str, Any] | None, precision: Precision) -> dict[str, Any]:
    """The ``bf16`` section of the config ``ds_config_for`` makes (the user's ``zero.config`` or the generated one,
    ``enabled`` resolved, ``train.pure_bf16``'s keys where it leaves them open, ``zero.overrides`` last), without
    building the rest: the planner reads it before it plans, and a launch builds the whole config once."""
    if user is None:  # build_ds_config's section
        config: dict[str, Any] = {"bf16": {"enabled": precision == "bf16"}}
    else:  # fill_auto's: only an "auto" is resolved
        config = {key: value for key, value in user.items() if key == "bf16"}
        section = config.get("bf16")
        if isinstance(section, dict) and section.get("enabled") == "auto":
            config["bf16"] = {**section, "enabled": precision == "bf16"}
    return merge(with_pure_bf16(config, spec), spec.zero.overrides)


def pure_bf16_of(ds: dict[str, Any]) -> bool:
    """Whether a config keeps bf16 master weights, gradients and optimizer states (``train.pure_bf16``)."""
    section = ds.get("bf16")
    return isinstance(section, dict) and all(section.get(key) is True for key in ("enabled", *PURE_BF16_KEYS))


def build_ds_config(spec: JobSpec, resolved: Resolved, world_size: int) -> dict[str, Any]:
    """The generated ZeRO-3 config for ``world_size`` ranks, ``zero.overrides`` merged last."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    train = spec.train
    accumulation = train.gradient_accumulation_steps
    zero: dict[str, Any] = {
        "stage": 3,
        # Overlapping communication with compute is what makes ZeRO-3 fast on NVLink.
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": _auto(resolved.reduce_bucket_size),
        "stage3_prefetch_bucket_size": _auto(resolved.prefetch_bucket_size),
        "stage3_param_persistence_threshold": _auto(resolved.param_persistence_threshold),
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        # Without this, save_model under ZeRO-3 writes empty tensors (the classic bug):
        # the consolidated model needs the partitions gathered at save time.
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if resolved.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if resolved.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if resolved.nvme_path is not None:
        zero.update(nvme_sections(resolved))
    if resolved.hpz_partition_size > 1:
        # The backward's all-gather then stays within each node (ZeRO++ hpZ). Only hpZ: qwZ
        # and qgZ are never written (planning/speed/zerochoice.py says why).
        zero["zero_hpz_partition_size"] = resolved.hpz_partition_size
    config_optimizer: dict[str, Any] | None = None
    if resolved.offload_optimizer:
        # With the optimizer offloaded DeepSpeed needs its own CPU Adam (a JIT-built op).
        config_optimizer = {
            "type": "AdamW",
            "params": {
                "lr": train.learning_rate,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": train.weight_decay,
            },
        }
    # Otherwise no "optimizer" section: the HF Trainer then hands DeepSpeed torch's
    # fused AdamW (one kernel over ZeRO's flat fp32 partitions). Measured on 2xH200
    # (Qwen3-8B shape, seq 4096, micro-batch 4; benchmarks/results/h200x2-20261130):
    # torch's multi-tensor AdamW ("torch_adam") gave 6,245 tokens/s/GPU and ~120 GiB
    # reserved, fused 6,352 and ~114 GiB. DeepSpeed's FusedAdam would need a JIT op
    # build (a compiler and a minute in every fresh container).
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": resolved.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": resolved.micro_batch_size * accumulation * world_size,
        "gradient_clipping": train.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": resolved.precision == "bf16"},  # train.pure_bf16's keys: with_pure_bf16, below
        "fp16": {
            "enabled": resolved.precision == "fp16",
            # loss_scale 0 = dynamic loss scaling, needed for fp16 to not under/overflow.
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "steps_per_print": 1_000_000,  # the trainer's progress.jsonl reports; DeepSpeed's prints are noise
        "wall_clock_breakdown": False,
    }
    if config_optimizer is not None:
        config["optimizer"] = config_optimizer
    if resolved.nvme_path is not None:
        config["aio"] = dict(AIO_CONFIG)
    return merge(with_pure_bf16(config, spec), spec.zero.overrides)


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, any other value in ``overrides`` replaces."""
    result = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def load_user_config(loaded: LoadedJob) -> dict[str, Any] | None:
    """``zero.config`` as a dict (``None`` when the spec names none). Errors name the file."""
    name = loaded.spec.zero.config
    if name is None:
        return None
    path = loaded.resolve_local(name)
    where = loaded.where("zero.config")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(
            f"{where}: zero.config: file not found: {path}", fix="fix the path (relative to the job file)"
        ) from None
    except OSError as exc:
        raise SpecError(f"{where}: zero.config: cannot read {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}:1: a DeepSpeed config is a JSON object, not a {type(data).__name__}")
    stage = data.get("zero_optimization", {}).get("stage", 3) if isinstance(data.get("zero_optimization"), dict) else 3
    if stage != 3:
        raise SpecError(
            f"{path}: zero_optimization.stage is {stage}; dzctl runs ZeRO stage 3 only",
            fix='set "stage": 3 or remove it',
        )
    return data


def refuse_unsupported(loaded: LoadedJob, user: dict[str, Any] | None) -> None:
    """Raise ``InputError`` (exit 2) for a DeepSpeed setting of the job's own that is known not to run under dzctl,
    naming the user's key, where it was given and the fix; return otherwise.

    ``user``: ``zero.config`` as ``load_user_config`` read it (``None``: none); ``zero.overrides`` is merged over it,
    as the job will run. ``planning/inputs.py::read_inputs`` calls this, so ``dzctl plan``, ``launch`` (its dry run
    too) and ``tune`` refuse before any host is touched. Refused:

    - ``zero_optimization.zenflow`` (DeepSpeed's ZenFlow). Measured: two launches on one H100 80GB (DeepSpeed
      0.19.8, torch 2.11, transformers 5.17, the 18-layer Qwen3-8B shape, the optimizer offloaded to the CPU,
      ``zenflow: {topk_ratio: 0.05, update_interval: 4, overlap_step: true}``) both failed in the first forward:
      with Liger's kernels in its RMSNorm ("Cannot launch Triton kernel since n = 151936 exceeds the recommended
      Triton blocksize"), without them (``train.fused_loss: none``) in transformers' Qwen3RMSNorm ("The size of
      tensor a (4096) must match the size of tensor b (151936) at non-singleton dimension 2";
      ``benchmarks/results/plans-h100x1-20261207e/off-zenflow-noliger-1.log``): the first decoder layer got hidden
      states as wide as the vocabulary. Why, in DeepSpeed 0.19.8's source:

      * ``runtime/zero/parameter_offload.py``, ``DeepSpeedZeRoOffload.pre_sub_module_forward_function`` (and
        ``post_sub_module_forward_function``, and the two backward ones): with ZenFlow on, every parameter a
        module has gathered whose ``ds_shape`` is 2-D is transposed (``param.data = param.data.t()``) before the
        module runs and again after.
      * ``runtime/zenflow/engine_stage3.py``, ``_initialize_zenflow_stage3_prologue`` (called from
        ``DeepSpeedZeroOptimizer_Stage3.__init__`` before ``initialize_ds_offload``): this is meant to store each
        2-D weight transposed first (``p.data = p.data.t().contiguous() if len(p.shape) != 1``), so that the
        hooks above turn it back. But a model loaded under ZeRO-3 is built inside ``zero.Init`` (transformers'
        ``from_pretrained``/``from_config`` when ZeRO-3 is configured; ``train/run.py`` always), whose
        parameters are already partitioned: ``p.data`` is the empty 1-D placeholder ``free_param`` leaves
        (``runtime/zero/partition_parameters.py``, ``torch.empty(0)``), so the prologue skips every one and
        ``ds_shape`` stays the weight's own shape.

      So every 2-D weight reaches its module's forward transposed; the first, the input embedding's
      ``[vocab, hidden]``, is looked up as ``[hidden, vocab]`` and gives rows 151,936 wide. Reproduced on the CPU
      with DeepSpeed 0.19.8: an ``nn.Embedding(100, 8)`` built in ``zero.Init`` under ``DeepSpeedZeRoOffload(...,
      zenflow=True)`` returns ``[1, 3, 100]`` for three tokens. Under ZeRO-1/2 ZenFlow takes another path
      (``runtime/zenflow/zenflow_stage_1_and_2.py``), but dzctl runs stage 3 only.

    - ``zero_optimization.stage`` other than 3 in ``zero.overrides`` (a ``zero.config`` file's is refused as it is
      read, ``load_user_config``): the planner, the memory estimate and the trainer are ZeRO-3's, and DeepSpeed
      would run the overridden stage.
    """
    _refuse_overridden_stage(loaded)
    _refuse_zenflow(loaded, user)


_STAGE_KEY = "zero.overrides.zero_optimization.stage"
_ZENFLOW_KEY = "zero.overrides.zero_optimization.zenflow"


def _refuse_overridden_stage(loaded: LoadedJob) -> None:
    zero = loaded.spec.zero.overrides.get("zero_optimization")
    stage = zero.get("stage", 3) if isinstance(zero, dict) else 3
    if stage != 3:
        raise InputError(
            f"{_overrides_where(loaded, _STAGE_KEY)}: zero.overrides: zero_optimization.stage is {stage!r}; dzctl "
            "plans, estimates and trains ZeRO stage 3 only, and DeepSpeed would run the stage the override names",
            fix="remove zero_optimization.stage from zero.overrides (or set it to 3)",
        )


_ZENFLOW_PROBLEM = (
    "DeepSpeed's ZenFlow under ZeRO-3 (the only stage dzctl runs) failed in the first forward on both launches "
    "measured (one H100, DeepSpeed 0.19.8, the 18-layer Qwen3-8B shape, optimizer offloaded to the CPU): the input "
    "embedding's weight was kept transposed, [hidden, vocab], so the first decoder layer got hidden states 151,936 "
    "wide (the vocabulary) instead of 4,096 (ZenFlow's hooks transpose each gathered 2-D weight for its forward, "
    "expecting it stored transposed, which it is not in a model built partitioned by zero.Init, as dzctl builds "
    "every model)"
)


def _refuse_zenflow(loaded: LoadedJob, user: dict[str, Any] | None) -> None:
    overrides = loaded.spec.zero.overrides
    zero = merge(user or {}, overrides).get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("zenflow") is None:
        return
    overridden = overrides.get("zero_optimization")
    if isinstance(overridden, dict) and "zenflow" in overridden:
        where = f"{_overrides_where(loaded, _ZENFLOW_KEY)}: zero.overrides: zero_optimization.zenflow"
        source = "from zero.overrides"
    else:
        path = loaded.resolve_local(loaded.spec.zero.config or "")
        where = f"{path}: zero_optimization.zenflow (the job's zero.config, {loaded.where('zero.config')})"
        source = f"from {path}"
    raise InputError(
        f"{where}: {_ZENFLOW_PROBLEM}",
        fix=f"remove the zenflow section ({source}); for a faster step with the optimizer offloaded, keep part of "
        "it on the GPUs with zero_optimization.offload_optimizer.ratio (DeepSpeed's partial offload, e.g. 0.5), "
        "or set train.pure_bf16: true (bf16 optimizer states, kept on the GPUs)",
    )


def _overrides_where(loaded: LoadedJob, key: str) -> str:
    """Where ``key`` (dotted, under ``zero.overrides``) was given: the last ``--set`` that set it, a section
    holding it or a key inside it, else the job file's line of it."""
    for item in reversed(loaded.overrides):
        dotted = item.split("=", 1)[0].strip()
        if dotted == key or key.startswith(f"{dotted}.") or dotted.startswith(f"{key}."):
            return f"--set {shown_override(item)}"
    return loaded.lines.where(tuple(key.split(".")))


def fill_auto(ds: dict[str, Any], resolved: Resolved, world_size: int, spec: JobSpec) -> dict[str, Any]:
    """Replace the ``"auto"`` values that the resolved choices decide; others stay ``"auto"``.

    The HF Trainer resolves the remaining ones (learning rate, scheduler) from its
    arguments, which come from the same spec, so both ends agree.
    """
    out = copy.deepcopy(ds)
    accumulation = spec.train.gradient_accumulation_steps
    top = {
        "train_micro_batch_size_per_gpu": resolved.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": resolved.micro_batch_size * accumulation * world_size,
        "gradient_clipping": spec.train.max_grad_norm,
    }
    for key, value in top.items():
        if out.get(key) == "auto":
            out[key] = value
    zero = out.get("zero_optimization")
    if isinstance(zero, dict):
        sizes = {
            "reduce_bucket_size": resolved.reduce_bucket_size,
            "stage3_prefetch_bucket_size": resolved.prefetch_bucket_size,
            "stage3_param_persistence_threshold": resolved.param_persistence_threshold,
        }
        for key, value in sizes.items():
            if zero.get(key) == "auto" and value is not None:
                zero[key] = value
    for name in ("bf16", "fp16"):
        section = out.get(name)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            section["enabled"] = resolved.precision == name
    return with_pure_bf16(out, spec)


def _auto_paths(config: Any, prefix: str = "") -> list[str]:
    """The dotted keys of a config whose value is ``"auto"``, in the config's own order."""
    if config == "auto":
        return [prefix]
    if not isinstance(config, dict):
        return []
    paths: list[str] = []
    for key, value in config.items():
        paths += _auto_paths(value, f"{prefix}.{key}" if prefix else key)
    return paths


def _at(config: Any, dotted: str) -> tuple[bool, Any]:
    for key in dotted.split("."):
        if not isinstance(config, dict) or key not in config:
            return False, None
        config = config[key]
    return True, config


def auto_filled(
    user: dict[str, Any] | None, final: dict[str, Any], overrides: dict[str, Any] | None = None
) -> list[tuple[str, Any]]:
    """The ``"auto"`` values of ``zero.config`` that the job's config fills, as (dotted key, value filled in).

    A key ``zero.overrides`` sets is the user's own value, not a fill; one still ``"auto"`` is left to the
    HF Trainer (``auto_left``). No ``zero.config``: nothing of the user's was ``"auto"``.
    """
    filled = []
    for key in _auto_paths(user or {}):
        if _at(overrides or {}, key)[0]:
            continue
        present, value = _at(final, key)
        if present and value != "auto":
            filled.append((key, value))
    return filled


def auto_left(final: dict[str, Any]) -> list[str]:
    """The dotted keys still ``"auto"`` in a job's config: the HF Trainer fills them from its arguments."""
    return _auto_paths(final)


def ds_config_for(spec: JobSpec, user: dict[str, Any] | None, resolved: Resolved, world_size: int) -> dict[str, Any]:
    """The job's config: the user's ``zero.config`` (autos filled) or the generated one; overrides last."""
    if user is None:
        return build_ds_config(spec, resolved, world_size)
    config = merge(fill_auto(user, resolved, world_size, spec), spec.zero.overrides)
    zero = config.get("zero_optimization")
    if resolved.hpz_partition_size > 1 and isinstance(zero, dict) and "zero_hpz_partition_size" not in zero:
        # The step-time model chose hpZ for a config that leaves it unset: its predicted step needs it written.
        zero["zero_hpz_partition_size"] = resolved.hpz_partition_size
    return config


def job_ds_config(loaded: LoadedJob, resolved: Resolved, world_size: int) -> dict[str, Any]:
    """``ds_config_for`` with ``zero.config`` read from the job's folder (a trainer started on a job file by hand)."""
    return ds_config_for(loaded.spec, load_user_config(loaded), resolved, world_size)


def precision_of(ds: dict[str, Any]) -> Precision:
    """The precision a (possibly user-written) config asks for."""
    for name in ("bf16", "fp16"):
        section = ds.get(name)
        if isinstance(section, dict) and section.get("enabled") is True:
            return name  # type: ignore[return-value]
    return "fp32"


def offload_of(ds: dict[str, Any]) -> tuple[bool, bool]:
    """(optimizer offloaded, parameters offloaded) in a config."""
    zero = ds.get("zero_optimization") or {}

    def _on(section: Any) -> bool:
        return isinstance(section, dict) and section.get("device", "none") not in ("none", None)

    return _on(zero.get("offload_optimizer")), _on(zero.get("offload_param"))
