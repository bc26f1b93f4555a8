"""What the key maps of other tools' YAMLs share (``llamafactory``, ``axolotl``; ``foreign`` picks one).

A row per key the user wrote: mapped (to which dzctl key and value), ignored (and why: it does
not change what is trained) or refused (and why: it changes training in a way dzctl cannot do);
keys dzctl needs that the YAML cannot give get a default row of their own. The ``Builder`` the
maps write through keeps the dzctl data, the rows, and which user line set each dzctl key
(``ForeignLineMap``), so a validation error of the converted job names the user's own line and key.
Pure: no file is read here.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .yamlsource import KeyPath, LineMap

Outcome = Literal["mapped", "ignored", "refused", "default"]

# Attention and MLP projections of the Llama/Qwen/Mistral families: job.LORA_DEFAULT_TARGETS (not
# imported: job.py imports this module; tests/test_convert_yaml.py keeps the two equal).
ALL_LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|KEY", re.IGNORECASE)  # as job.SECRET_NAME


@dataclass(frozen=True)
class KeyRow:
    """What became of one key of the user's YAML (or, for a default, of one dzctl key it lacked)."""

    key: str  # the user's key (``datasets.0.type`` inside a list), or the dzctl key of a default
    value: Any
    line: int | None
    outcome: Outcome
    target: str | None = None  # the dzctl key it sets
    target_value: Any = None
    reason: str = ""
    # A refusal that a ``--set`` of this dzctl key answers (the user gave dzctl the value directly).
    lifted_by: str | None = None

    def shown_value(self) -> Any:
        return "***" if SECRET_NAME.search(self.key.rsplit(".", 1)[-1]) and self.value else self.value

    def as_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "value": self.shown_value(),
            "line": self.line,
            "outcome": self.outcome,
            "target": self.target,
            "target_value": self.target_value,
            "reason": self.reason,
        }


class ForeignLineMap(LineMap):
    """A dzctl key path -> the line of the user's key that set it, named beside the line.

    ``where(("train", "learning_rate"))`` reads ``qwen3.yaml:41 (learning_rate)``, so a
    validation error of the converted job points at the user's own key in the user's own file.
    """

    def __init__(self, source: str, origins: dict[KeyPath, tuple[int, str]]) -> None:
        super().__init__(source, {path: line for path, (line, _) in origins.items()})
        self._origins = origins

    def where(self, path: KeyPath) -> str:
        path = tuple(path)
        while path:
            if path in self._origins:
                line, key = self._origins[path]
                return f"{self.source}:{line} ({key})"
            path = path[:-1]
        return self.source


@dataclass
class Conversion:
    """A foreign YAML as a dzctl job: its raw data (not yet validated), the rows, the line map."""

    tool: str
    source: str
    data: dict[str, Any]
    rows: list[KeyRow]
    lines: ForeignLineMap

    def refused(self, overrides: tuple[str, ...] = ()) -> list[KeyRow]:
        """The refusals that stand after ``--set``: one whose ``lifted_by`` key was set is answered."""
        set_keys = [item.split("=", 1)[0].strip() for item in overrides]
        return [
            row
            for row in self.rows
            if row.outcome == "refused" and not (row.lifted_by and any(_covers(key, row.lifted_by) for key in set_keys))
        ]


def _covers(set_key: str, wanted: str) -> bool:
    return wanted == set_key or wanted.startswith(set_key + ".") or set_key.startswith(wanted + ".")


@dataclass
class Builder:
    """Writes the dzctl data and the rows as a tool's key map walks the user's YAML."""

    tool: str
    source: str
    raw: dict[str, Any]
    user_lines: LineMap
    data: dict[str, Any] = field(default_factory=dict)
    rows: list[KeyRow] = field(default_factory=list)
    origins: dict[KeyPath, tuple[int, str]] = field(default_factory=dict)

    def line(self, key: str) -> int | None:
        return self.user_lines.line_of(tuple(int(p) if p.isdigit() else p for p in key.split(".")))

    def value(self, key: str) -> Any:
        return self.raw.get(key)

    def given(self, key: str) -> bool:
        return key in self.raw

    def put(self, target: str, value: Any, key: str | None = None) -> None:
        """Set the dzctl key ``target`` (dotted) in the data; ``key``: the user's key it came from."""
        node = self.data
        parts = target.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        if key is not None:
            line = self.line(key)
            if line is not None:
                self.origins[tuple(parts)] = (line, key)

    def map(self, key: str, target: str, value: Any, reason: str = "", *, value_of: Any = ...) -> None:
        self.put(target, value, key)
        raw = self.raw.get(key) if value_of is ... else value_of
        self.rows.append(KeyRow(key, raw, self.line(key), "mapped", target, value, reason))

    def note(self, key: str, target: str, value: Any, reason: str) -> None:
        """A second dzctl key set by a key already mapped (``template: qwen3_nothink`` -> enable_thinking)."""
        self.put(target, value, key)
        self.rows.append(KeyRow(key, self.raw.get(key), self.line(key), "mapped", target, value, reason))

    def mapped_only(self, key: str, target: str, value: Any, reason: str) -> None:
        """A mapped key whose dzctl value is dzctl's default: named in the table, not written in the job."""
        self.rows.append(KeyRow(key, self.raw.get(key), self.line(key), "mapped", target, value, reason))

    def ignore(self, key: str, reason: str, *, value_of: Any = ...) -> None:
        raw = self.raw.get(key) if value_of is ... else value_of
        self.rows.append(KeyRow(key, raw, self.line(key), "ignored", reason=reason))

    def refuse(self, key: str, reason: str, lifted_by: str | None = None, *, value_of: Any = ...) -> None:
        raw = self.raw.get(key) if value_of is ... else value_of
        self.rows.append(KeyRow(key, raw, self.line(key), "refused", reason=reason, lifted_by=lifted_by))

    def default(self, target: str, value: Any, reason: str) -> None:
        """A dzctl key the YAML does not give, set to what the tool would do (or dzctl's own choice)."""
        self.put(target, value)
        self.rows.append(KeyRow(target, None, None, "default", target, value, reason))

    def unknown(self, key: str, known: frozenset[str] | set[str]) -> None:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        hint = f"; did you mean {close[0]}?" if close else ""
        self.refuse(key, f"not a {self.tool} key dzctl knows, so it cannot tell what it changes{hint}")

    def conversion(self) -> Conversion:
        return Conversion(self.tool, self.source, self.data, self.rows, ForeignLineMap(self.source, self.origins))


# --- what both tools' values look like ------------------------------------------------------------


def number(value: Any) -> float | None:
    """A number as HF's argument parser reads it: YAML reads ``1e-4`` (no dot) as text."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def whole(value: Any) -> int | None:
    got = number(value)
    return int(got) if got is not None and got == int(got) else None


def truthy(value: Any) -> bool:
    """A flag as the tools read it: YAML's true, or the text ``true`` HF's parser also takes."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "1")
    return bool(value)


def names(value: Any) -> list[str]:
    """``a,b`` or ``[a, b]`` as a list of names (LLaMA-Factory's comma lists)."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    if isinstance(value, list):
        return [str(item).strip() for item in value]
    return []


def job_name(path: Path) -> str:
    """dzctl's ``name`` from the file name: lower case, other characters as ``-``, at most 63."""
    name = re.sub(r"[^a-z0-9_.-]+", "-", path.stem.lower()).strip("-._")[:63]
    return name or "job"


# --- the kinds of rows a key map is made of ---------------------------------------------------------

Handler = Callable[[Builder, str, Any], None]


def _as_kind(value: Any, kind: str) -> Any:
    """The user's value as the dzctl key takes it; left as it was when it is not one (validation names it)."""
    if kind == "float":
        got = number(value)
    elif kind == "int":
        got = whole(value)
    elif kind == "bool":
        got = truthy(value) if isinstance(value, (bool, str)) else None
    else:
        return value
    return value if got is None else got


def direct(target: str, kind: str = "any", reason: str = "") -> Handler:
    """The key sets ``target`` with its value (as ``kind``: float, int, bool or any)."""

    def handle(b: Builder, key: str, value: Any) -> None:
        b.map(key, target, _as_kind(value, kind), reason)

    return handle


def ignored(reason: str) -> Handler:
    """A key that does not change what is trained (logging, caching, speed, inference)."""

    def handle(b: Builder, key: str, value: Any) -> None:
        b.ignore(key, reason)

    return handle


def off(reason: str, default: Any = False, lifted_by: str | None = None) -> Handler:
    """A key that dzctl can only run at the tool's default: ignored there (or unset), refused otherwise."""

    def handle(b: Builder, key: str, value: Any) -> None:
        if value in (None, {}, [], "") or value == default or (default is False and not truthy(value)):
            b.ignore(key, f"{value!r} is {key}'s default: nothing to change")
        else:
            b.refuse(key, reason, lifted_by)

    return handle


def map_pure_bf16(b: Builder, key: str, reason: str) -> None:
    """A tool's switch for bf16 training without an fp32 copy: ``train.pure_bf16`` (DeepSpeed keeps the master
    weights, gradients and AdamW's states in bf16), which trains in bf16."""
    b.map(key, "train.pure_bf16", True, reason)
    b.note(key, "train.precision", "bf16", "pure bf16 trains in bf16")


def refused(reason: str, lifted_by: str | None = None) -> Handler:
    def handle(b: Builder, key: str, value: Any) -> None:
        b.refuse(key, reason, lifted_by)

    return handle


def ds_config_file(note: str) -> Handler:
    """``deepspeed: FILE`` becomes ``zero.config`` (the path read relative to the tool's YAML, ``note`` saying how
    the tool reads it); an inline config is refused."""

    def handle(b: Builder, key: str, value: Any) -> None:
        if isinstance(value, str):
            b.map(key, "zero.config", value, f"a ds_config read relative to this YAML's folder{note}")
        else:
            b.refuse(key, "an inline DeepSpeed config: give it as a file", lifted_by="zero.config")

    return handle


def walk(b: Builder, keys: dict[str, Handler]) -> None:
    """Every top-level key of the user's YAML through its handler; one the map lacks is refused."""
    for key, value in b.raw.items():
        handler = keys.get(str(key))
        if handler is None:
            b.unknown(str(key), set(keys))
        else:
            handler(b, str(key), value)


# --- keys both tools pass to the HF Trainer, read the same way --------------------------------------

SCHEDULERS = ("cosine", "linear", "constant", "constant_with_warmup")
# The update dzctl's trainer runs (train/run.py: HF's adamw_torch, fused on CUDA); these names are that same AdamW.
SAME_ADAMW = frozenset({"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused"})
TRACKERS = ("tensorboard", "wandb", "mlflow")


def scheduler(b: Builder, key: str, value: Any) -> None:
    if value in SCHEDULERS:
        b.map(key, "train.lr_scheduler", value)
    else:
        b.refuse(
            key,
            f"dzctl's schedules are {', '.join(SCHEDULERS)}; {value!r} changes the learning rate of every step",
            lifted_by="train.lr_scheduler",
        )


def optimizer(b: Builder, key: str, value: Any) -> None:
    if value is None or value in SAME_ADAMW:
        b.ignore(key, "dzctl trains with HF's AdamW (adamw_torch, fused on GPUs): the same update")
    else:
        b.refuse(key, f"dzctl trains with AdamW only; {value!r} is another optimizer")


def per_gpu_batch(tool: str, micro_key: str, micro_default: int) -> tuple[Handler, Callable[[Builder], str]]:
    """The handler of a tool's per-GPU micro-batch key, and the note that says the global batch grows with the GPUs.

    Both tools read the batch per GPU (micro x accumulation x GPUs), so a job moved to more nodes trains a
    larger batch there; the note gives dzctl's fix, a global batch that holds on any GPUs."""

    def note(b: Builder) -> str:
        micro = b.value(micro_key) or micro_default
        accumulation = b.value("gradient_accumulation_steps") or 1
        return (
            f"per GPU, as in {tool}: the global batch is {micro} x {accumulation} x the number of GPUs, so it "
            "grows with the GPUs; for N rows on any GPUs: --set train.global_batch_size=N "
            "--set train.micro_batch_size=auto"
        )

    def handler(b: Builder, key: str, value: Any) -> None:
        b.map(key, "train.micro_batch_size", whole(value) if whole(value) is not None else value, note(b))

    return handler, note


def held_out_rows(b: Builder, key: str, value: Any) -> None:
    """``val_size`` (LLaMA-Factory) and ``val_set_size`` (axolotl): a share below 1, else a number of rows."""
    got = number(value)
    if not got:
        b.ignore(key, "0: no rows held out")
    else:
        held = got if got < 1 else int(got)
        b.map(key, "data.eval_split", held, "rows held out of the training data (and evaluated at the end too)")


def resume_from(b: Builder, key: str, value: Any) -> None:
    """Both tools' ``resume_from_checkpoint``: unset is dzctl's own resume, a path is ``train.resume``."""
    if value in (None, False, ""):
        b.ignore(key, "unset: dzctl resumes from its own last checkpoint (train.resume: auto)")
    else:
        b.map(key, "train.resume", str(value))


def report_to(b: Builder, key: str, value: Any) -> None:
    wanted = names(value) if value is not None else []
    kept = [name for name in wanted if name in TRACKERS]
    left = [name for name in wanted if name not in TRACKERS and name not in ("none", "all")]
    if not kept:
        b.ignore(key, "logging only: no tracker" + (f" dzctl has ({', '.join(left)} is not one)" if left else ""))
        return
    b.map(key, "train.report_to", kept, f"logging only; {', '.join(left)}: not a dzctl tracker" if left else "")
