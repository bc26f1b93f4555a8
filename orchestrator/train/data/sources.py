"""Where a data set's rows come from on the node, and what identifies its content.

Kinds (from ``data.path`` / ``data.sources[].path``):

- ``json``: a ``.json`` array or ``.jsonl`` file, streamed (``planning/datafiles.py``);
- ``parquet``: a ``.parquet`` file, read a row group at a time with pyarrow;
- ``disk``: a folder written by ``datasets.save_to_disk`` (Arrow files, memory-mapped);
- ``hub``: ``hf:ORG/NAME[:SPLIT]``, loaded with ``datasets.load_dataset`` from the
  node's Hugging Face cache (``HF_DATASETS_OFFLINE=1`` reads only that cache).

Every kind yields ``(where, row)``, ``where`` naming the user's own file (``shipped_from``
when ``dzctl launch`` shipped it) and the row. ``content_files`` lists the files whose
bytes make up a source, for the cache key (``cache.py`` hashes them).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...planning import datafiles
from ...planning.datarows import DataError
from ...spec.job import HUB_PREFIX, DataSource, LoadedJob

BATCH = 1024  # rows per Arrow batch read


@dataclass(frozen=True)
class Source:
    index: int  # its place in data.sources (0 for data.path)
    spec: DataSource  # format and columns filled in (DataSpec.all_sources)
    location: str  # the path on this node, or the hub id
    kind: str  # json | parquet | disk | hub

    @property
    def display(self) -> str:
        """The name the user knows this source by."""
        return self.spec.shipped_from or self.spec.path

    @property
    def label(self) -> str:
        """For the data summary line: ``source 2 (file.parquet)``."""
        return f"source {self.index + 1} ({self.display})"


def resolve_sources(loaded: LoadedJob, source_set: str = "train") -> list[Source]:
    """The training data's sources (``train``), or ``data.eval``'s (``eval``)."""
    data = loaded.spec.data
    out = []
    for index, spec in enumerate(data.all_sources() if source_set == "train" else data.eval_sources()):
        if spec.path.startswith(HUB_PREFIX):
            out.append(Source(index, spec, spec.path[len(HUB_PREFIX) :], "hub"))
            continue
        path = loaded.resolve_local(spec.path)
        kind = "disk" if path.is_dir() else "parquet" if path.suffix == ".parquet" else "json"
        out.append(Source(index, spec, str(path), kind))
    return out


def hub_name_split(location: str) -> tuple[str, str]:
    name, _, split = location.partition(":")
    return name, split or "train"


def _missing(source: Source) -> DataError:
    node = f" (on this node: {source.location})" if source.location != source.display else ""
    return DataError(
        f"{source.display}: data file not found{node}",
        fix="check data.path: a path relative to the job file is shipped with it; an absolute one must exist "
        "on every node",
    )


def _arrow_dataset(source: Source):
    import datasets

    if source.kind == "disk":
        try:
            loaded = datasets.load_from_disk(source.location)
        except FileNotFoundError as exc:
            raise DataError(
                f"{source.display}: not a folder written by datasets.save_to_disk ({exc})",
                fix="give the folder save_to_disk wrote (it holds dataset_info.json or dataset_dict.json)",
            ) from None
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(
                    f"{source.display}: a DatasetDict without a 'train' split (it has {', '.join(loaded)})",
                    fix="point data.path at one split's folder",
                )
            loaded = loaded["train"]
        return loaded
    name, split = hub_name_split(source.location)
    try:
        return datasets.load_dataset(name, split=split)
    except (ConnectionError, FileNotFoundError, ValueError) as exc:
        raise DataError(
            f"{source.display}: cannot load {name} split {split!r} from the Hugging Face datasets cache on this "
            f"node: {str(exc).splitlines()[0]}",
            fix="download it into the nodes' cache (HF_HOME) first, or make the hub reachable from the nodes",
        ) from None


def iter_rows(source: Source, position: list[int] | None = None) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for every row of the source, in its order (``position``: see datafiles.iter_rows)."""
    if source.kind == "json":
        path = Path(source.location)
        if not path.is_file():
            raise _missing(source)
        yield from datafiles.iter_rows(path, source.display, position)
        return
    if source.kind == "parquet":
        yield from _parquet_rows(source)
        return
    dataset = _arrow_dataset(source)
    number = 0
    for batch in dataset.iter(batch_size=BATCH):
        columns = list(batch)
        for values in zip(*(batch[c] for c in columns), strict=True):
            number += 1
            yield f"{source.display}:row {number}", dict(zip(columns, values, strict=True))


def _parquet_rows(source: Source) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    path = Path(source.location)
    if not path.is_file():
        raise _missing(source)
    try:
        reader = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends for a file that is not Parquet
        raise DataError(f"{source.display}: not a Parquet file ({exc})") from None
    number = 0
    for batch in reader.iter_batches(batch_size=BATCH):
        for row in batch.to_pylist():
            number += 1
            yield f"{source.display}:row {number}", row


def count_rows(source: Source) -> int:
    """How many rows the source has (for the mix): metadata where there is some, else a pass."""
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        if not Path(source.location).is_file():
            raise _missing(source)
        return pq.ParquetFile(source.location).metadata.num_rows
    if source.kind in ("disk", "hub"):
        return len(_arrow_dataset(source))
    return sum(1 for _ in iter_rows(source))


def content_files(source: Source) -> list[Path]:
    """The files whose bytes are this source's content (hashed into the cache key)."""
    if source.kind in ("json", "parquet"):
        path = Path(source.location)
        if not path.is_file():
            raise _missing(source)
        return [path]
    if source.kind == "disk":
        folder = Path(source.location)
        if not folder.is_dir():
            raise _missing(source)
        return sorted(p for p in folder.rglob("*") if p.is_file())
    return sorted(Path(f["filename"]) for f in _arrow_dataset(source).cache_files)
