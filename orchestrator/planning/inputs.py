"""A job's local inputs, read and checked once on this machine, before any host is touched.

A launch reads the job's own files in several places: the env file with its
secrets, the data set it ships, ``zero.config``, the model's shape for the memory
planner. Each of those is an input error, exit 2, with nothing on the nodes: found
only after preflight ran on every node, or after a job record was written, it would
leave both behind for a job that never started. So ``read_inputs`` reads them all
first, and what it returns (``JobInputs``) is what the planner and the job files
use afterwards: none of them reads the job's files again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..spec.job import HUB_PREFIX, DataSource, JobSpec, LoadedJob, is_secret_name, read_env_file
from . import datafiles, fusedloss
from .chattemplate import AUTO_TEMPLATE, ChatTemplate, resolve_chat_template
from .datarows import DataError, RowOptions
from .dsconfig import load_user_config, refuse_unsupported
from .evalsplit import EVAL_SPLIT_FIX, split_problem
from .fusedloss import FusedLoss
from .packing import resolve_packing
from .preference.rows import StageMismatch, check_row
from .shape import ModelShape, shape_for_job


@dataclass(frozen=True)
class JobInputs:
    """What the job's own files decide; the hardware decides the rest (``resolve.ResolvedJob``)."""

    job: LoadedJob
    secrets: dict[str, str]  # name -> value: secret-named launch.env values and all of launch.env_file
    shipped: tuple[ShippedData, ...]  # the local data files shipped with the job (none: on the nodes, or synthetic)
    user_ds_config: dict[str, Any] | None  # zero.config, read and checked (None: the spec names none)
    shape: ModelShape
    packing: bool  # train.packing, resolved
    fused_loss: FusedLoss  # train.fused_loss, resolved for the model type
    chat_template: ChatTemplate = AUTO_TEMPLATE  # data.template, a file read and checked

    @property
    def spec(self) -> JobSpec:
        return self.job.spec

    @property
    def secret_names(self) -> tuple[str, ...]:
        return tuple(self.secrets)

    @property
    def data_file(self) -> Path | None:
        """The first shipped data file (the one of ``data.path``)."""
        return self.shipped[0].local if self.shipped else None


@dataclass(frozen=True)
class ShippedData:
    """A data file next to the job file, copied into the job directory on every node."""

    index: int  # its place in data.sources (0 for data.path); with part "eval", in data.eval's sources
    local: Path  # here
    name: str  # relative to the job directory on the nodes: data/<file> (data.sources: data/<index>-<file>)
    size: int = 0  # bytes (the planner counts the mapped cache's pages from it)
    part: str = "train"  # train: data.path / data.sources; eval: data.eval's (data/eval-...)


def read_inputs(job: LoadedJob) -> JobInputs:
    """Read and check every local input of ``job``; raise the input error a launch would otherwise meet later."""
    secrets = job_secrets(job)
    shipped = check_data_sources(job)
    chat_template = resolve_chat_template(job)  # data.template: a file that exists and renders
    check_eval_split(job, shipped)
    user = load_user_config(job)  # zero.config: exists, JSON, stage 3
    refuse_unsupported(job, user)  # DeepSpeed settings known not to run (zero.config or zero.overrides): ZenFlow
    shape = shape_for_job(job)  # the memory planner needs the model's shape: config.json, catalogue or model.config
    spec = job.spec
    return JobInputs(
        job=job,
        secrets=secrets,
        shipped=shipped,
        user_ds_config=user,
        shape=shape,
        packing=resolve_packing(spec),
        fused_loss=fusedloss.resolve(spec.train.fused_loss, accelerator=spec.accelerator, model_type=shape.model_type),
        chat_template=chat_template,
    )


def env_file_values(job: LoadedJob) -> dict[str, str]:
    """``launch.env_file`` read locally (all its names are secret: that file is for secrets)."""
    if not job.spec.launch.env_file:
        return {}
    return read_env_file(job.resolve_local(job.spec.launch.env_file), job.where("launch.env_file"))


def secret_env(job: LoadedJob, env_file_values: dict[str, str]) -> dict[str, str]:
    """Secret-named ``launch.env`` values plus everything in ``launch.env_file``."""
    found = {k: v for k, v in job.spec.launch.env.items() if is_secret_name(k)}
    found.update(env_file_values)
    return dict(sorted(found.items()))


def job_secrets(job: LoadedJob) -> dict[str, str]:
    """The secrets the job's nodes get through their 0600 env file."""
    return secret_env(job, env_file_values(job))


def is_node_side(path: str) -> bool:
    """A source the nodes read where it is: an absolute path (shared storage) or a hub ID."""
    return path.startswith(HUB_PREFIX) or Path(path).is_absolute()


def shipped_data(job: LoadedJob) -> tuple[ShippedData, ...]:
    """The local data files to ship with the job: the sources given relative to the job file."""
    data = job.spec.data
    out = []
    parts = [("eval", data.eval_sources(), data.eval is not None and data.eval.sources is not None, "eval-")]
    if not data.synthetic:
        parts.insert(0, ("train", data.all_sources(), data.sources is not None, ""))
    for part, found, many, prefix in parts:
        for index, source in enumerate(found):
            if is_node_side(source.path):
                continue
            local = job.resolve_local(source.path)
            name = f"data/{prefix}{index}-{local.name}" if many else f"data/{prefix}{local.name}"
            out.append(ShippedData(index, local, name, part=part))
    return tuple(out)


PEEK_ROWS = 5  # the rows of a local file read before any host is touched


def check_data_sources(job: LoadedJob) -> tuple[ShippedData, ...]:
    """Every shipped source is a readable file here whose first rows are in its format. Returns them."""
    shipped = shipped_data(job)
    checked = []
    for item in shipped:
        where = _source_key(job, item.index, item.part)
        sources = job.spec.data.all_sources() if item.part == "train" else job.spec.data.eval_sources()
        data_file = item.local
        if not data_file.exists():
            problem = "no such file"
        elif data_file.is_dir():
            problem = "is not a file but a folder (a save_to_disk folder is read on the nodes: give its absolute path)"
        elif not data_file.is_file():
            problem = "is not a file"
        else:
            try:
                with data_file.open("rb"):
                    pass
                check_first_rows(job, sources[item.index], data_file, where)
                checked.append(replace(item, size=data_file.stat().st_size))
                continue
            except OSError as exc:
                problem = f"cannot be read ({exc.strerror})"
        raise InputError(
            f"{where}: {data_file} {problem}",
            fix="give a file next to the job file, an absolute path that exists on every node, "
            "hf:ORG/NAME for a Hugging Face dataset in the nodes' cache, "
            "or synthetic:random (random full-length rows, to measure throughput)",
        )
    return tuple(checked)


def _source_key(job: LoadedJob, index: int, part: str = "train") -> str:
    data = job.spec.data
    if part == "eval":
        assert data.eval is not None
        if data.eval.sources is None:
            return f"{job.where('data.eval.path')}: data.eval.path"
        return f"{job.where(f'data.eval.sources.{index}.path')}: data.eval.sources[{index}].path"
    if data.sources is None:
        return f"{job.where('data.path')}: data.path"
    return f"{job.where(f'data.sources.{index}.path')}: data.sources[{index}].path"


def check_eval_split(job: LoadedJob, shipped: tuple[ShippedData, ...]) -> None:
    """``data.eval_split`` against the rows of the shipped files: refused here when it leaves nothing to train on.

    Only when every training source is shipped (the rows of node-side data are counted by the
    builder on the nodes, which refuses the same way). One source: its rows (``max_rows`` applied).
    Several: their sum, a bound on the mix (which takes at most that many), so this check never
    refuses a split the mix could train with; the builder checks the mix itself. Cost: one pass
    over each file's rows (JSON parsed as a stream, Parquet from its metadata).
    """
    split = job.spec.data.eval_split
    sources = job.spec.data.all_sources()
    mine = [item for item in shipped if item.part == "train"]
    if split is None or len(mine) != len(sources):
        return
    rows = 0
    for item in mine:
        counted = _count_rows(item.local, sources[item.index].path)
        if counted is None:
            return
        limit = sources[item.index].max_rows
        rows += min(counted, limit) if limit else counted
    problem = split_problem(split, rows)
    if problem:
        raise InputError(f"{job.where('data.eval_split')}: {problem}", fix=EVAL_SPLIT_FIX)


def _count_rows(path: Path, display: str) -> int | None:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:  # not a controller dependency: the nodes' builder counts
            return None
        return pq.ParquetFile(path).metadata.num_rows
    return sum(1 for _ in datafiles.iter_rows(path, display))


def check_first_rows(job: LoadedJob, source: DataSource, path: Path, where: str) -> None:
    """The first rows must be in the source's format: a mismatch is refused here, naming the row and the fix."""
    display = source.path
    try:
        rows = _first_rows(path, display)
    except DataError as exc:
        raise InputError(f"{where}: {exc.message}", fix=exc.fix) from None
    if rows is None:
        return
    problems = []
    for row_where, row in rows:
        try:
            if isinstance(row, datafiles.Malformed):
                raise DataError(f"{row_where}: {row.reason}")
            check_row(
                row, source.format or "alpaca", row_where, source.columns, job.spec.train.stage, RowOptions.of(source)
            )
        except StageMismatch as exc:  # another stage's rows: refused whatever data.on_error says
            raise InputError(f"{where}: {exc.message}", fix=exc.fix) from None
        except DataError as exc:
            problems.append(exc)
    # data.on_error: skip passes over bad rows, but not over a file whose first rows all fail.
    if problems and (job.spec.data.on_error == "fail" or len(problems) == len(rows)):
        first = problems[0]
        raise InputError(
            f"{where}: {first.message}",
            fix=first.fix or "fix the row, or set data.format (and data.columns) to what the file holds",
        )
    if not rows:
        raise InputError(f"{where}: {display} has no rows", fix="give a data file with rows")


def _first_rows(path: Path, display: str) -> list | None:
    if path.suffix != ".parquet":
        return datafiles.peek_rows(path, PEEK_ROWS, display)
    try:
        import pyarrow.parquet as pq
    except ImportError:  # not a controller dependency: the nodes' builder checks every row anyway
        return None
    try:
        batch = next(pq.ParquetFile(path).iter_batches(batch_size=PEEK_ROWS), None)
    except Exception as exc:  # ArrowInvalid and friends: not a Parquet file
        raise DataError(f"{display}: not a Parquet file ({exc})") from None
    rows = batch.to_pylist() if batch is not None else []
    return [(f"{display}:row {n}", row) for n, row in enumerate(rows, start=1)]
