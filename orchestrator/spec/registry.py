"""LLaMA-Factory's dataset registry (``dataset_info.json``) → ``data.sources`` (reads only that file and folder).

``data.dataset_info`` names the registry (the file, or the folder that holds ``dataset_info.json``:
LLaMA-Factory's ``dataset_dir``); ``data.dataset`` names entries of it. When the job is loaded, each
name becomes one source of ``data.sources`` (a ``file_name`` folder: one source per data file in it),
with LLaMA-Factory's meaning of the entry's keys:

- ``file_name``: a file, or a folder of data files, relative to the registry's folder;
  ``hf_hub_url`` (with ``split``): ``hf:NAME:SPLIT``, read from the nodes' Hugging Face cache;
- ``formatting``: ``alpaca`` (default), ``sharegpt`` or ``openai`` (sharegpt with OpenAI's role
  and key names, an assistant turn's ``tool_calls`` read too); ``columns`` renames the fields
  (alpaca: prompt, query, response, history, system; sharegpt: messages, system, tools);
  ``tags``: sharegpt's role and text keys and role names (``data.tags``);
- ``ranking: true`` (chosen / rejected answers) and ``columns.kto_tag`` set those columns
  (preference training reads them);
- ``images``, ``videos``, ``audios`` columns are refused: dzctl trains text models.

The mix is ``data.mix_strategy`` (concat by default, as LLaMA-Factory's ``mix_strategy``), written
into the expanded spec so the nodes read it without the registry. Keys that would change the
rows and that dzctl cannot honour (``subset``, ``folder``, ``num_samples``, ``ms_hub_url`` alone,
``script_url``, ``cloud_file_name``) are refused by name, never dropped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import SpecError

REGISTRY_FILE = "dataset_info.json"
DATA_SUFFIXES = (".json", ".jsonl", ".parquet")
MULTIMODAL = ("images", "videos", "audios")
# Entry keys read below; file_sha1 (older registries) is a checksum only: it changes no row.
KNOWN_KEYS = {"file_name", "hf_hub_url", "formatting", "ranking", "split", "columns", "tags", "file_sha1"}
REFUSED_KEYS = {
    "subset": "a dataset's subset (configuration) is not read: save that subset with datasets.save_to_disk and give "
    "the folder as file_name",
    "folder": "a folder inside a hub dataset is not read: download it and give its files as file_name",
    "num_samples": "sampling N rows is not done: give the dataset in data.sources with max_rows (its first N rows)",
    "ms_hub_url": "ModelScope is not read: give hf_hub_url, or file_name of a local copy",
    "om_hub_url": "Modelers is not read: give hf_hub_url, or file_name of a local copy",
    "script_url": "a loading script is not run: give file_name of the data it loads",
    "cloud_file_name": "cloud storage is not read: copy the file next to the registry and give file_name",
}
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": "history",
                  "system": "system"}  # fmt: skip
SHAREGPT_COLUMNS = {"messages": "conversations", "system": "system", "tools": "tools"}
PREFERENCE_COLUMNS = ("chosen", "rejected", "kto_tag")
OPENAI_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
               "observation_tag": "tool", "function_tag": "function_call", "system_tag": "system"}  # fmt: skip


def registry_path(value: str, job_folder: Path) -> Path:
    path = Path(value).expanduser()
    path = path if path.is_absolute() else job_folder / path
    return path / REGISTRY_FILE if path.is_dir() else path


def expand(data: dict[str, Any], job_folder: Path, where: str) -> dict[str, Any]:
    """``data`` (the section as validated, dumped) with data.dataset expanded into data.sources."""
    registry = registry_path(data["dataset_info"], job_folder)
    absolute = Path(data["dataset_info"]).expanduser().is_absolute()
    shown = str(registry) if absolute else os.path.relpath(registry, job_folder)
    try:
        entries = json.loads(registry.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(
            f"{where}: data.dataset_info: {registry} not found",
            fix="give LLaMA-Factory's dataset_info.json, or the folder that holds it (its dataset_dir)",
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SpecError(f"{where}: data.dataset_info: {registry} is not a readable JSON file: {exc}") from None
    if not isinstance(entries, dict):
        raise SpecError(f"{where}: data.dataset_info: {registry} holds a {type(entries).__name__}, not a mapping")
    # Paths stay relative to the job file where the registry is (so its files are shipped with the job);
    # a registry given by an absolute path names files on the nodes' storage.
    text = data.get("format") == "text" and data.get("_format_given")
    sources = []
    for name in data["dataset"]:
        if name not in entries:
            known = ", ".join(sorted(entries)[:20])
            raise SpecError(
                f"{where}: data.dataset: {name!r} is not in {shown}",
                fix=f"use one of its names ({known}{', ...' if len(entries) > 20 else ''}), or add it there",
            )
        sources += _entry_sources(
            name, entries[name], registry, job_folder, absolute, f"{where}: data.dataset {name!r} ({shown})", text
        )
    if data.get("mix_strategy", "concat").startswith("interleave") and data.get("interleave_probs"):
        if len(data["interleave_probs"]) != len(data["dataset"]):
            raise SpecError(
                f"{where}: data.interleave_probs has {len(data['interleave_probs'])} values for "
                f"{len(data['dataset'])} datasets (data.dataset)"
            )
        by_name = dict(zip(data["dataset"], data["interleave_probs"], strict=True))
        for source in sources:
            source["weight"] = by_name[source.pop("_name")]
        if len(sources) != len(data["dataset"]):
            raise SpecError(
                f"{where}: data.interleave_probs: a file_name folder of several files is one dataset of several "
                "sources, which an interleave cannot weigh as one",
                fix="list its files as datasets of their own in the registry, or use mix_strategy: concat",
            )
    for source in sources:
        source.pop("_name", None)
        # data.max_rows is LLaMA-Factory's max_samples: the first N rows of each dataset, not of the mix.
        if data.get("max_rows") and "max_rows" not in source:
            source["max_rows"] = data["max_rows"]
    out = {k: v for k, v in data.items() if k not in ("dataset", "dataset_info", "path", "_format_given")}
    out["sources"] = sources
    out["mix_strategy"] = data.get("mix_strategy") or "concat"
    out.pop("interleave_probs", None)
    return out


def _entry_sources(
    name: str, entry: Any, registry: Path, job_folder: Path, absolute: bool, at: str, text: bool
) -> list[dict[str, Any]]:
    if not isinstance(entry, dict):
        raise SpecError(f"{at}: an entry is a mapping (file_name, formatting, columns, ...), got {entry!r}")
    for key in entry:
        if key in REFUSED_KEYS:
            raise SpecError(f"{at}: {key!r}: {REFUSED_KEYS[key]}")
        if key not in KNOWN_KEYS:
            raise SpecError(f"{at}: unknown key {key!r} (read: {', '.join(sorted(KNOWN_KEYS))})")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt", "openai"):
        raise SpecError(f"{at}: formatting {formatting!r}: LLaMA-Factory's are alpaca, sharegpt and openai")
    openai = formatting == "openai"
    if openai:
        # LLaMA-Factory's openai formatting is sharegpt's reader with OpenAI's names (and tool_calls turns).
        formatting = "sharegpt"
        entry = {**entry, "tags": {**OPENAI_TAGS, **(entry.get("tags") or {})}}
        entry["columns"] = {"messages": "messages", **(entry.get("columns") or {})}
    columns_in = entry.get("columns") or {}
    if not isinstance(columns_in, dict):
        raise SpecError(f"{at}: columns must be a mapping")
    table = ALPACA_COLUMNS if formatting == "alpaca" else SHAREGPT_COLUMNS
    columns: dict[str, str] = {}
    for key, column in columns_in.items():
        if key in MULTIMODAL:
            raise SpecError(
                f"{at}: columns.{key}: {column!r} holds {key}: dzctl trains text models (no image, video or audio "
                "input)",
                fix=f"remove the {key} column from the entry and its rows' placeholders, or use a multimodal trainer",
            )
        if key in PREFERENCE_COLUMNS:
            columns[key] = column
        elif key in table:
            columns[table[key]] = column
        else:
            raise SpecError(f"{at}: columns.{key}: not a {formatting} column (its columns: {', '.join(table)})")
    if entry.get("ranking"):
        columns.setdefault("chosen", "chosen")
        columns.setdefault("rejected", "rejected")
    source: dict[str, Any] = {"format": "text" if text else formatting, "_name": name}
    if text:
        columns = {"text": columns_in.get("prompt", "text")}
    source["columns"] = {field: column for field, column in columns.items() if field != column}
    if entry.get("tags") is not None and not text:
        if formatting != "sharegpt":
            raise SpecError(f"{at}: tags are sharegpt's (this entry is {formatting})")
        source["tags"] = entry["tags"]
    if "hf_hub_url" in entry:
        return [{**source, "path": f"hf:{entry['hf_hub_url']}:{entry.get('split', 'train')}"}]
    if "file_name" not in entry:
        raise SpecError(f"{at}: no file_name or hf_hub_url: nothing to read")
    target = registry.parent / entry["file_name"]
    if target.is_dir():
        files = sorted(p for p in target.iterdir() if p.is_file() and not p.name.startswith("."))
        if not files:
            raise SpecError(f"{at}: file_name {entry['file_name']!r} is an empty folder")
    elif target.is_file() or absolute:
        files = [target]
    else:
        raise SpecError(f"{at}: file_name {entry['file_name']!r} not found in {registry.parent}")
    for file in files:
        if file.suffix not in DATA_SUFFIXES:
            raise SpecError(
                f"{at}: {file.name}: a {file.suffix or 'suffix-less'} file: dzctl reads "
                f"{', '.join(DATA_SUFFIXES)} files of rows",
                fix="convert it to JSON lines, or list only such files",
            )
    out = []
    for file in files:
        path = str(file) if absolute else os.path.relpath(file, job_folder)
        out.append({**source, "path": path})
    return out


def validation_error(exc: ValidationError, where: str, registry: str) -> SpecError:
    problems = "; ".join(
        f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}" for error in exc.errors(include_url=False)
    )
    return SpecError(f"{where}: data.dataset (from {registry}) gives data that does not validate: {problems}")
