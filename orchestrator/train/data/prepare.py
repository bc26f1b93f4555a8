"""The data a rank trains on: built once per node, then memory-mapped by every rank (no torch).

Local rank 0 of each node is the node's builder: it computes the cache key, takes the
key's lock, checks an existing cache (sizes and hashes) or builds a new one with every
core of the node, and tells the node's other ranks through this launch's run note
(``cache.RunNote``). Those ranks wait for it, then map the same files. Why local rank 0
and not a step before the ranks: it needs no change to how the nodes start (torchrun,
the deepspeed launcher, Slurm's srun, all the same), the waiting ranks have not started
their process group yet (no collective can time out meanwhile), and its failure is the
rank's failure, reported like any other. The cost: that rank's peak memory includes the
build (bounded, see ``build.py``).

The other ranks wait with a bound: ``DZCTL_DATA_WAIT_S`` (default 300 s) without a word
from the builder is an error naming the builder; a builder that failed makes every rank fail
with its reason. The builder's word is a heartbeat (``Heartbeat``): a thread that, for the
whole life of the build, rewrites the run note and touches the key's lock every few seconds,
whatever the builder is doing. Hashing the sources, counting a mix's rows, checking a cache,
packing and writing the manifest say nothing for minutes on a large data set; without the
thread, another node broke the live lock and the node's own ranks stopped waiting.

``data.eval`` (evaluation data of its own) is a second cache, built and mapped the same way
(``source_set="eval"``, with its own run note); ``data.eval_split`` holds rows out of the
training cache itself (``build.py``, ``holdout.py``).

What is built is a ``Recipe``: SFT's (``build.py``'s token files, ``MappedData``) or a preference
stage's (``train/preference/cache.py``: ``train.stage: dpo | kto``); the key, the lock, the heartbeat, the
check, the wait and the prune are the same for every recipe.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import DzError, RuntimeFailure
from ...planning.chattemplate import node_chat_template
from ...planning.datarows import DataError
from ...spec.job import LoadedJob
from . import cache, sources
from .build import BuildSettings, build
from .mapped import MappedData

WAIT_STALE_S = 300.0
POLL_S = 0.5
HEARTBEAT_S = 5.0  # at most; a quarter of the shorter bound when one is lowered (tests, DZCTL_DATA_*_S)
NOTE_SLACK_S = 120.0  # a note written this long before this rank started is an earlier launch's


@dataclass(frozen=True)
class Recipe:
    """What a cache holds and how: its key material, its builder and how a rank maps a built one.

    ``material(found, cache_dir)``: the key's material (everything that changes the content);
    ``build(found, folder, say, alive)``: write the files into ``folder``, return a ``BuildResult``
    (its ``info`` has ``examples``, ``tokens``, ``build_s`` and ``workers``); ``open(folder)``: the
    mapped data of a built cache."""

    material: Callable[[list[sources.Source], Path], dict[str, Any]]
    build: Callable[..., Any]
    open: Callable[[Path], Any]


@dataclass(frozen=True)
class Prepared:
    data: Any  # the recipe's mapped data (SFT: MappedData)
    key: str
    cached: bool
    seconds: float
    folder: Path


def wait_bound_s() -> float:
    return float(os.environ.get("DZCTL_DATA_WAIT_S", WAIT_STALE_S))


class Heartbeat:
    """The builder's pulse: the run note rewritten, and the key's lock touched, every ``interval``.

    ``beat(state, **values)`` says something new (written at once); the thread repeats the last
    thing said with a new time, so a silent phase still reads as alive to the node's waiting
    ranks (``DZCTL_DATA_WAIT_S``) and to other nodes (``DZCTL_DATA_LOCK_STALE_S``). A builder that
    dies stops it: its lock then goes stale, and its ranks' wait runs out, as they should.
    """

    def __init__(self, note: cache.RunNote) -> None:
        self.note = note
        self.lock: cache.KeyLock | None = None
        self.interval = min(HEARTBEAT_S, cache.lock_stale_s() / 4, wait_bound_s() / 4)
        self._said: tuple[str, dict[str, Any]] = ("building", {"stage": "starting"})
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dzctl-data-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self.beat("building", stage="starting")
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()

    def beat(self, state: str, **values: Any) -> None:
        with self._guard:
            self._said = (state, values)
            self.note.write(state, **values)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._guard:
                state, values = self._said
                self.note.write(state, **values)
                if self.lock is not None:
                    self.lock.refresh()


def cache_dir_for(loaded: LoadedJob, output_dir: Path) -> Path:
    configured = loaded.spec.data.cache_dir
    return Path(configured.replace("{host}", socket.gethostname())) if configured else output_dir / "data-cache"


def key_material(found: list[sources.Source], tokenizer: Any, settings: BuildSettings, cache_dir: Path) -> dict:
    fingerprints = cache.Fingerprints(cache_dir)
    material = {
        "layout": cache.CACHE_LAYOUT,
        "sources": [
            {
                "content": [fingerprints.of(path) for path in sources.content_files(s)],
                "format": s.spec.format,
                "columns": s.spec.columns or {},
                "weight": s.spec.weight if len(found) > 1 else 1.0,
                "max_rows": s.spec.max_rows,
                **_reading(s.spec),
            }
            for s in found
        ],
        **cache.tokenizer_identity(tokenizer),
        "max_seq_len": settings.max_seq_len,
        "packing": settings.packing,
        "window": settings.window if settings.packing else None,
        "seed": settings.seed if settings.packing else None,  # only packing's shuffle uses it
        "on_error": settings.on_error,
        # data.template and data.enable_thinking decide every label (the tokenizer's own template is above).
        "template": [settings.template.name, settings.template.digest] if settings.template else None,
        "enable_thinking": settings.enable_thinking,
    }
    if settings.mix not in ("weights", "concat") or (settings.mix == "concat" and len(found) > 1):
        material["mix"] = settings.mix  # data.sources' weighted mix keeps the key it always had
    if settings.eval_split is not None:
        # Only when set: the key of every cache built without it stays as it was.
        material["eval_split"] = {"split": settings.eval_split, "seed": settings.seed}
    fingerprints.save()
    return material


def _reading(source) -> dict:
    """What, beyond format and columns, changes how a source's rows become tokens: only what is set,
    so the key of a cache built before these keys existed stays as it was (messages, sharegpt)."""
    out = {}
    if source.format == "alpaca":
        out["alpaca_join"] = "\n"  # instruction and input joined by one newline (was a blank line)
    for key in ("tags", "roles_to_train", "train_on_eos", "message_field_training"):
        value = getattr(source, key, None)
        if value is not None:
            out[key] = value.model_dump() if hasattr(value, "model_dump") else value
    return out


def prepare(
    loaded: LoadedJob,
    tokenizer: Any,
    *,
    packing: bool,
    local_rank: int,
    cache_dir: Path,
    say: Callable[[str], None],
    source_set: str = "train",
) -> Prepared:
    """The node's cache of ``source_set``: the training data (``train``) or ``data.eval``'s own (``eval``)."""
    spec = loaded.spec
    split = spec.data.eval_split if source_set == "train" else None
    settings = BuildSettings(
        spec.train.max_seq_len,
        packing,
        spec.train.seed,
        spec.data.on_error,
        eval_split=split,
        template=node_chat_template(loaded),
        enable_thinking=spec.data.enable_thinking,
        mix=spec.data.mix if source_set == "train" else "weights",
    )
    recipe = Recipe(
        material=lambda found, folder: key_material(found, tokenizer, settings, folder),
        build=lambda found, folder, report, alive: build(found, tokenizer, settings, folder, report, alive),
        open=MappedData,
    )
    return prepare_with(recipe, loaded, local_rank=local_rank, cache_dir=cache_dir, say=say, source_set=source_set)


def prepare_with(
    recipe: Recipe,
    loaded: LoadedJob,
    *,
    local_rank: int,
    cache_dir: Path,
    say: Callable[[str], None],
    source_set: str = "train",
) -> Prepared:
    """The node's cache that ``recipe`` builds: local rank 0 builds (or checks) it, the others wait and map it."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    token = cache.launch_token()
    note = cache.RunNote(cache_dir, token if source_set == "train" else f"{token}-{source_set}")
    if local_rank != 0:
        return _wait_for_builder(note, cache_dir, say, recipe.open)
    try:
        with Heartbeat(note) as heartbeat:
            prepared = _as_builder(loaded, recipe, cache_dir, heartbeat, say, source_set)
    except BaseException as exc:
        reason = exc.message if isinstance(exc, DzError) else f"{type(exc).__name__}: {exc}"
        note.write("failed", reason=reason, fix=getattr(exc, "fix", None), input=isinstance(exc, DataError))
        raise
    note.write("ready", key=prepared.key)
    return prepared


def _as_builder(loaded, recipe: Recipe, cache_dir: Path, heartbeat: Heartbeat, say, source_set) -> Prepared:
    started = time.monotonic()
    heartbeat.beat("building", stage="key")
    found = sources.resolve_sources(loaded, source_set)
    key = cache.cache_key(recipe.material(found, cache_dir))
    folder = cache_dir / key
    lock = cache.KeyLock(cache_dir, key)
    heartbeat.beat("building", stage="waiting for another node's build", key=key)
    waited = False
    while not lock.try_take():
        if not waited:
            say(f"data: {lock.holder()} is building cache {key} on this storage: waiting for it")
            waited = True
        time.sleep(POLL_S * 2)
    heartbeat.lock = lock
    try:
        heartbeat.beat("building", stage="checking the cache", key=key)
        cached = False
        if folder.exists():
            checked = cache.check(folder)
            if checked.ok:
                cached = True
            else:
                say(f"data: cache {key} failed its check ({checked.reason}): rebuilding it")
                shutil.rmtree(folder)
        if not cached:
            cached = _build_into(folder, found, recipe, heartbeat, key, say)
        cache.touch_used(folder)
    finally:
        heartbeat.lock = None
        lock.release()
    removed = cache.prune(cache_dir, key)
    if removed:
        say(f"data: pruned {len(removed)} old cache(s) of {cache_dir}: {', '.join(removed)}")
    data = recipe.open(folder)
    seconds = time.monotonic() - started
    if cached:
        say(
            f"data: cached: mapped {data.info['examples']:,} examples ({data.info['tokens']:,} tokens) "
            f"from {folder} in {seconds:.1f} s"
        )
    return Prepared(data, key, cached, seconds, folder)


def _build_into(folder: Path, found, recipe: Recipe, heartbeat: Heartbeat, key: str, say) -> bool:
    """Build the cache into ``folder``. True when another node's build got there first (then used)."""
    building = folder.parent / f"building-{key}-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir(parents=True)
    say(f"data: building cache {key} in {folder.parent} ({len(found)} source(s))")

    def alive(progress: dict[str, Any]) -> None:
        heartbeat.beat("building", key=key, **progress)

    try:
        result = recipe.build(found, building, say, alive)
        result.info["skipped_lines"] = result.skipped_lines
        heartbeat.beat("building", stage="writing the manifest", key=key)
        cache.write_manifest(building, result.files, result.info)  # last: a folder with it is whole
        if _put_in_place(building, folder, key, say):
            return True
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    info = result.info
    say(
        f"data: built {info['examples']:,} examples ({info['tokens']:,} tokens) in {info['build_s']:.1f} s "
        f"with {info['workers']} worker(s), {info['examples'] / max(info['build_s'], 1e-9):,.0f} examples/s"
    )
    return False


def _put_in_place(building: Path, folder: Path, key: str, say) -> bool:
    """Rename the finished build to its key. True when a whole cache of the key was there already.

    It can be: this builder's lock was broken (it went silent past the bound: a stopped VM, a
    storage stall) and another node built the same key meanwhile. The same key is the same
    content, so that cache is used and this build dropped; a cache that fails its check is replaced.
    """
    try:
        os.rename(building, folder)
        return False
    except OSError:  # ENOTEMPTY or EEXIST: the folder is there
        if not folder.exists():
            raise
    if cache.check(folder).ok:
        say(f"data: another node finished cache {key} first: using it, this build dropped")
        shutil.rmtree(building, ignore_errors=True)
        return True
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(building, folder)
    return False


def _wait_for_builder(note: cache.RunNote, cache_dir: Path, say, open_data: Callable[[Path], Any]) -> Prepared:
    started_wall, started = time.time(), time.monotonic()
    bound = wait_bound_s()
    last_word = started
    last_time = None
    while True:
        state = note.read()
        if state is not None and state.get("time", 0) >= started_wall - NOTE_SLACK_S:
            if state["time"] != last_time:
                last_time, last_word = state["time"], time.monotonic()
            if state["state"] == "ready":
                folder = cache_dir / state["key"]
                data = open_data(folder)
                return Prepared(data, state["key"], True, time.monotonic() - started, folder)
            if state["state"] == "failed":
                error = DataError if state.get("input") else RuntimeFailure
                raise error(f"this node's data builder (local rank 0) failed: {state['reason']}", fix=state.get("fix"))
        if time.monotonic() - last_word > bound:
            raise RuntimeFailure(
                f"waited {bound:.0f} s for this node's data builder (local rank 0) without a word from it "
                f"({note.path} {'not written' if last_time is None else 'not updated'})",
                fix="see local rank 0's log for why it stopped; DZCTL_DATA_WAIT_S sets this bound",
            )
        time.sleep(POLL_S)
