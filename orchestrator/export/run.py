"""One export, step by step: check ``--out``, ask the nodes, choose, plan, gather, consolidate, check, move in place.

Nothing is written to ``--out`` until the weights are written and checked: they are
made in a hidden folder beside it (same filesystem), renamed to ``--out`` at the end,
and that folder and the gathered shards are removed whatever happens. The nodes are
only read (``tar``, ``stat``): an export never changes a checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError, RuntimeFailure
from ..observe.store import JobRecord
from ..transport.pool import HostPool
from . import convert, gather
from .choose import choose
from .plan import ExportPlan, disk_needed, in_place, make_plan, ram_needed


@dataclass
class Progress:
    """What the export reports as it goes (the command renders it)."""

    phase: Callable[[str], None] = lambda text: None
    gathered: Callable[[int, int], None] = lambda done, total: None  # bytes so far, bytes planned
    written: Callable[[int, int], None] = lambda done, total: None
    note: Callable[[str], None] = lambda text: None


@dataclass
class Exported:
    plan: ExportPlan
    out: Path
    source: str  # ssh | in-place
    carriers: dict[str, str] = field(default_factory=dict)
    result: dict = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            **self.plan.to_dict(),
            "out": str(self.out),
            "source": self.source,
            "carriers": self.carriers,
            "files": self.result.get("files", []),
            "carried": self.result.get("carried", []),
            "tensors": self.result.get("tensors"),
            "bytes_written": self.result.get("bytes_written"),
            "verified": True,
            "seconds": self.seconds,
        }


def check_out(out: Path) -> None:
    """``--out`` must be new or an empty folder: an export never mixes its files with others."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file", fix="name a new folder (it is created)")
    if out.is_dir() and any(out.iterdir()):
        raise InputError(
            f"--out {out} already exists and is not empty: an export never writes over other files",
            fix=f"name a new folder, or empty {out} first",
        )
    parent = out.parent if out.parent != Path("") else Path(".")
    if not parent.is_dir():
        raise InputError(f"--out {out}: its parent folder {parent} does not exist", fix=f"mkdir -p {parent}")


def storage_of(record: JobRecord) -> str:
    """Where the job's checkpoints lie: the launch's answer (``train.output_storage``), else from the paths."""
    found = record.spec.get("train", {}).get("output_storage")
    if found in ("shared", "node-local"):
        return found
    dirs = {n["output_dir"] for n in record.plan["nodes"]}
    return "shared" if len(dirs) == 1 and len(record.plan["nodes"]) == 1 else "node-local"


def available_ram() -> int | None:
    """MemAvailable of this machine, in bytes (None where /proc/meminfo says nothing)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def refuse_short_machine(plan: ExportPlan, folder: Path, reading_in_place: bool) -> None:
    """Refuse before anything moves when this machine's free RAM or disk is short of what the export needs."""
    needed, have = ram_needed(plan), available_ram()
    if have is not None and needed > have:
        held = "the PEFT model and the merged model" if plan.method == "lora" and not plan.adapter else "the model"
        raise RuntimeFailure(
            f"exporting {plan.checkpoint} needs about {needed / 2**30:.1f} GiB of RAM here ({held} in {plan.dtype} "
            f"for the from_pretrained check, one shard being written), and {have / 2**30:.1f} GiB is free",
            fix=f"run dzctl export on a machine with at least {needed / 2**30:.0f} GiB free (a node of the job "
            "will do: install dzctl with the train extra there), or free memory here",
        )
    space, free = disk_needed(plan, reading_in_place), shutil.disk_usage(folder).free
    if space > free:
        raise RuntimeFailure(
            f"exporting {plan.checkpoint} needs about {space / 2**30:.1f} GiB free in {folder} (the gathered shards "
            f"and the written model), and {free / 2**30:.1f} GiB is free",
            fix="free space there, or give --out on a larger disk",
        )


def export_checkpoint(
    record: JobRecord, pool: HostPool | None, which: int | str, out: Path, *, adapter: bool, progress: Progress
) -> Exported:
    out = out.absolute()
    check_out(out)
    seconds: dict[str, float] = {}
    started = time.monotonic()
    # Before any node is asked: this Python must be able to consolidate at all.
    convert.require_train_extra(record.spec.get("train", {}).get("method", "full"))
    storage = "shared" if pool is None else storage_of(record)
    asked = 1 if storage == "shared" else len(record.hosts)
    progress.phase(f"asking {asked} node(s) which checkpoints of {record.job_id} they hold ({storage} storage)")
    surveys = gather.survey_nodes(record, pool, first_only=storage == "shared")
    chosen = choose(which, surveys, storage, record.job_id)
    plan = make_plan(chosen, surveys, job_id=record.job_id, spec=record.spec, adapter=adapter, storage=storage)
    reading_in_place = storage == "shared" and in_place(plan, gather.local_sizes(plan))
    refuse_short_machine(plan, out.parent, reading_in_place)
    seconds["survey_s"] = round(time.monotonic() - started, 3)
    work = out.parent / f".{out.name}.dzctl-export-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.mkdir(parents=True)
        carriers: dict[str, str] = {}
        step_started = time.monotonic()
        if pool is None and not reading_in_place:
            raise InputError(
                f"{plan.checkpoint} of Slurm job {record.job_id} is not readable here at {plan.nodes[0].folder}",
                fix="run dzctl export on a machine that mounts the job's shared directory (the submit host)",
            )
        if reading_in_place:
            source, checkpoint_dir = "in-place", Path(plan.nodes[0].folder)
            progress.phase(f"reading {plan.checkpoint} in place: {checkpoint_dir} (shared storage seen here)")
        else:
            source, checkpoint_dir = "ssh", work / "shards"
            progress.phase(f"gathering {plan.checkpoint} from {len(plan.nodes)} node(s)")
            done = [0]

            def on_bytes(n: int) -> None:
                done[0] += n
                progress.gathered(done[0], plan.stream_bytes)

            carriers = gather.fetch(plan, pool, checkpoint_dir, on_bytes)
        seconds["gather_s"] = round(time.monotonic() - step_started, 3)
        step_started = time.monotonic()
        weights = work / "weights"
        what = "the adapter" if adapter else "merged weights" if plan.method == "lora" else "the weights"
        progress.phase(f"consolidating {plan.checkpoint} (DeepSpeed's zero_to_fp32) and writing {what} as {plan.dtype}")

        def on_event(event: dict) -> None:
            if event.get("event") == "write":
                progress.written(int(event["done"]), int(event["total"]))
            elif event.get("event") == "check":
                progress.phase(f"checking: {event.get('what')} on this machine's CPU, every tensor against the shards")

        base = None
        if plan.base is not None:
            base = gather.base_model(plan, pool, work / "base", lambda n: None)
        request = convert.request_for(plan, checkpoint_dir, weights, base)
        result = convert.consolidate(request, work, on_event, progress.note)
        seconds["consolidate_s"] = round(time.monotonic() - step_started, 3)
        if out.is_dir():
            out.rmdir()  # empty (check_out): the checked weights take its place
        weights.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds["total_s"] = round(time.monotonic() - started, 3)
    return Exported(plan, out, source, carriers, result, seconds)
