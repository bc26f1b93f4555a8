"""The export plan: which files come from which node, how many bytes, and what the controller needs (pure).

DeepSpeed's ZeRO-3 → fp32 consolidation reads, from ``global_step<N>/``, every
rank's ``*_model_states.pt`` (shapes; for LoRA the frozen base's fragments) and
``*_optim_states.pt`` (the fp32 master partition, with Adam's two moments beside
it), and ``latest``. Node 0 also sends the checkpoint's small files: the model's
config, the tokenizer and its chat template, ``trainer_state.json``, the adapter's
config. Left out: the 16-bit copy the HF Trainer writes beside the shards
(``model.safetensors``, ``adapter_model.safetensors``: the export rebuilds them from
the shards), the RNG states, the scheduler and the training arguments.

Bytes moved from a node: its ranks' share of the optimizer states (12 bytes per
trained parameter: fp32 master, Adam m and v; 6 in bf16 with ``train.pure_bf16``) and of the
model states (for LoRA, 2 bytes per frozen bf16 parameter), so about (12·trained + 2·frozen) / nodes.
Controller RAM: DeepSpeed's consolidation, called whole (``get_fp32_state_dict_from_zero_checkpoint``),
holds the whole fp32 model, 4 bytes per parameter (72B: 288 GB). The export calls it lazily
instead (its optimizer files memory-mapped, each parameter stitched from the ranks' parts when
written) and writes one shard at a time; what it holds is in ``ram_needed``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InputError
from .choose import Chosen
from .survey import SHARD, NodeSurvey

# The checkpoint's files the export does not need (see the module's notes).
LEFT_OUT = re.compile(r"^(?:[^/]*\.safetensors|[^/]*\.bin|[^/]*\.pth|[^/]*\.pt|[^/]*\.py)$")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SHARD_BYTES = 5 * 10**9  # the largest safetensors file written (transformers' default max_shard_size)
# Bytes of the optimizer files per trained parameter: the master copy, Adam's m and v, each fp32 (4 bytes) or,
# with train.pure_bf16, bf16 (2 bytes).
OPTIMIZER_FILE_BYTES = {False: 12, True: 6}


@dataclass(frozen=True)
class NodeFiles:
    host: str
    node_rank: int
    folder: str  # the checkpoint folder on that node
    files: tuple[tuple[str, int], ...]  # (path relative to the folder, size)

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.files)


TAR_BLOCK = 512
TAR_RECORD = 20 * TAR_BLOCK  # GNU tar's default blocking factor


def tar_bytes(files: tuple[tuple[str, int], ...]) -> int:
    """The size of ``tar -cf -`` of these files: a header block each, the data padded to blocks, two
    end blocks, all padded to a whole record. What the stream's progress counts against."""
    data = sum(TAR_BLOCK + -(-size // TAR_BLOCK) * TAR_BLOCK for _, size in files) + 2 * TAR_BLOCK
    return -(-data // TAR_RECORD) * TAR_RECORD


@dataclass(frozen=True)
class ExportPlan:
    job_id: str
    checkpoint: str  # checkpoint-N
    step: int
    world_size: int
    tag: str  # the shards' folder, global_step<N>
    nodes: tuple[NodeFiles, ...]
    method: str  # full | lora
    adapter: bool  # --adapter: the PEFT adapter alone
    dtype: str  # what the model trained in: float32 | bfloat16 | float16
    storage: str  # shared | node-local
    base: str | None = None  # LoRA: the model the adapter was trained on (a folder on node 0, or a hub name)
    optimizer_bytes_per_param: int = OPTIMIZER_FILE_BYTES[False]  # what the optimizer files hold per trained one

    @property
    def nbytes(self) -> int:
        return sum(n.nbytes for n in self.nodes)

    @property
    def stream_bytes(self) -> int:
        """What the nodes' tar streams carry in all: the files and tar's own framing."""
        return sum(tar_bytes(n.files) for n in self.nodes)

    def to_dict(self) -> dict:
        return {
            "job_id": self.job_id,
            "checkpoint": self.checkpoint,
            "step": self.step,
            "world_size": self.world_size,
            "storage": self.storage,
            "method": self.method,
            "adapter": self.adapter,
            "dtype": self.dtype,
            "base": self.base,
            "bytes": self.nbytes,
            "nodes": [
                {"host": n.host, "node_rank": n.node_rank, "folder": n.folder, "files": len(n.files), "bytes": n.nbytes}
                for n in self.nodes
            ],
        }


PRECISION_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def make_plan(
    chosen: Chosen, surveys: list[NodeSurvey], *, job_id: str, spec: dict, adapter: bool, storage: str
) -> ExportPlan:
    """Per node, the files of ``chosen`` it sends: node 0 its shards and the small files, the others their shards."""
    train = spec.get("train", {})
    method = train.get("method", "full")
    if adapter and method != "lora":
        raise InputError(
            f"--adapter: job {job_id} trained with train.method: {method}, so it has no adapter",
            fix="leave out --adapter to export the full weights",
        )
    by_rank = {s.node_rank: s for s in surveys}
    name = f"checkpoint-{chosen.step}"
    tag = shard_tag(chosen)
    nodes = []
    for node_rank, part in sorted(chosen.parts.items()):
        survey = by_rank[node_rank]
        mine = {str(r) for r in part.ranks}
        files = []
        for rel, size in sorted(part.files.items()):
            folder, _, base = rel.rpartition("/")
            shard = SHARD.match(base)
            if folder == tag and shard:
                if shard.group(1) in mine:
                    files.append((rel, size))
            elif node_rank == min(chosen.parts) and "/" not in rel and not LEFT_OUT.match(rel):
                files.append((rel, size))
        nodes.append(NodeFiles(survey.host, node_rank, f"{survey.output_dir.rstrip('/')}/{name}", tuple(files)))
    precision = str(train.get("precision", "bf16"))
    return ExportPlan(
        job_id=job_id,
        checkpoint=name,
        step=chosen.step,
        world_size=chosen.world_size,
        tag=tag,
        nodes=tuple(nodes),
        method=method,
        adapter=adapter,
        dtype=PRECISION_DTYPE.get(precision, "bfloat16"),
        storage=storage,
        base=lora_base(spec, surveys[0].output_dir) if method == "lora" else None,
        optimizer_bytes_per_param=OPTIMIZER_FILE_BYTES[train.get("pure_bf16") is True],
    )


def lora_base(spec: dict, node0_output_dir: str) -> str:
    """What a LoRA job's adapter was trained on, as the trainer names it (``train/model/lora.py::base_name``).

    The HF Trainer saves a PEFT model's ZeRO-3 checkpoint without the frozen base
    (``exclude_frozen_parameters``): the export takes the base from there. A random
    base (``model.init: random``) is the one the run wrote to ``<output_dir>/base``.
    """
    model = spec.get("model", {})
    if model.get("init") == "random":
        return f"{node0_output_dir.rstrip('/')}/base"
    return str(model.get("name_or_path"))


def shard_tag(chosen: Chosen) -> str:
    """The folder the shards lie in (DeepSpeed's tag, ``global_step<N>``), from the manifests."""
    tags = {
        rel.rpartition("/")[0]
        for part in chosen.parts.values()
        for rel in part.files
        if "/" in rel and SHARD.match(rel.rpartition("/")[2])
    }
    if len(tags) != 1:
        raise InputError(
            f"checkpoint-{chosen.step}: its manifests name {len(tags)} shard folders ({sorted(tags)}), not one",
            fix="export another checkpoint; this one was not written by dzctl's trainer",
        )
    return tags.pop()


def in_place(plan: ExportPlan, sizes: dict[str, int | None]) -> bool:
    """Whether this machine sees every planned file at its node path and size (shared storage mounted here)."""
    return all(sizes.get(f"{n.folder}/{rel}") == size for n in plan.nodes for rel, size in n.files)


def parameters(plan: ExportPlan) -> int:
    """The model's parameters, from the shards' sizes: Adam's optimizer files hold 12 bytes per trained
    parameter (fp32 master, m, v; 6 in bf16); the model-state files hold the frozen ones (LoRA's base) in the dtype."""
    model = sum(size for n in plan.nodes for rel, size in n.files if rel.endswith("_model_states.pt"))
    frozen = model // DTYPE_BYTES[plan.dtype] if plan.method == "lora" else 0
    return trained_parameters(plan) + frozen


def trained_parameters(plan: ExportPlan) -> int:
    """The trained parameters, from the optimizer files' sizes."""
    optim = sum(size for n in plan.nodes for rel, size in n.files if rel.endswith("_optim_states.pt"))
    return optim // plan.optimizer_bytes_per_param


def ram_needed(plan: ExportPlan) -> int:
    """Controller RAM an export needs, in bytes.

    The shards are consolidated lazily and written one shard at a time (``SHARD_BYTES``),
    so writing needs one shard; the check then loads the written model with
    ``from_pretrained`` (the model in its dtype), and a LoRA merge holds the PEFT model
    besides (the model in its dtype once more). An adapter alone: the base, for the check.
    """
    model = parameters(plan) * DTYPE_BYTES[plan.dtype]
    if plan.method == "lora" and not plan.adapter:
        return 2 * model + SHARD_BYTES
    return model + min(model, SHARD_BYTES)


def disk_needed(plan: ExportPlan, reading_in_place: bool) -> int:
    """Disk beside ``--out``: the gathered files (none when read in place) and the written model in its dtype."""
    gathered = 0 if reading_in_place else plan.nbytes
    written = (trained_parameters(plan) if plan.adapter else parameters(plan)) * DTYPE_BYTES[plan.dtype]
    return gathered + written
