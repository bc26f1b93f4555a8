"""Environment variables the trainer sets before torch and DeepSpeed start, each for a reason.

Only defaults: a value already set (by the image, the job's ``launch.env`` or the
user) always wins. Also what the start itself says: warnings dropped, DeepSpeed's op builds named
with their seconds (``announce_op_builds``).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path


def early_defaults(accelerator: str, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set what must be in place before ``import torch``/``deepspeed``; return what was set."""
    env = os.environ if env is None else env
    wanted = {
        # A rank that hits an NCCL error or timeout aborts instead of hanging the
        # whole job in a collective forever (the silent hang of the field).
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        # DeepSpeed JIT-builds ops (CPU Adam for optimizer offload) into this cache.
        # The job directory is mounted read-only, and $HOME may not be writable in a
        # container; a fixed path under the temp dir is both writable and reused by
        # later runs in the same container or host.
        "TORCH_EXTENSIONS_DIR": os.path.join(tempfile.gettempdir(), "dzctl-torch-extensions"),
        # Tokenizer worker threads fight the training ranks for cores and warn after fork.
        "TOKENIZERS_PARALLELISM": "false",
    }
    if accelerator == "cpu":
        # DeepSpeed picks its accelerator at import; without this it looks for CUDA.
        wanted["DS_ACCELERATOR"] = "cpu"
    else:
        # The auto plan fills the GPU up to the planner's margin, and ZeRO-3's gathers,
        # checkpoints and logits come in ever-changing sizes that fragment the default
        # caching allocator. Measured on 2xH200 (Qwen3-8B shape, micro-batch 6,
        # benchmarks/results/h200x2-20261130): default segments reserved 137.9 of
        # 140.4 GiB and had to flush the cache once; expandable segments reserved
        # 127.2 GiB with no flush, for about 1% of speed (6,644 and 6,631 against
        # 6,678 and 6,722 tokens/s/GPU in two device calls): headroom is worth it,
        # since real data of varying lengths fragments more than that benchmark.
        wanted["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return set_missing(env, wanted)


def set_missing(env: MutableMapping[str, str], wanted: dict[str, str]) -> dict[str, str]:
    """Set each wanted variable the environment does not have (a user's own value wins); return those set."""
    applied = {name: value for name, value in wanted.items() if name not in env}
    env.update(applied)
    return applied


def quiet_known_warnings() -> None:
    """Drop warnings that repeat every step and say nothing a user can act on.

    DeepSpeed 0.19 calls torch's deprecated collective names on every ZeRO-3
    step; left alone they bury the job's log (and `dzctl logs`) under thousands
    of identical FutureWarnings. The DataLoader's pin_memory warning on CPU runs
    is the same kind, and so are Liger's lines about optional backends (below).
    Anything else still shows.
    """
    import warnings

    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*'pin_memory' argument is set as true but no accelerator")
    logging.getLogger(LIGER_REGISTRY).addFilter(_drop_missing_optional_liger_backends)


# Liger-Kernel (0.8.5) probes every backend it ships the first time each op runs, and logs one
# warning per backend whose package is missing. Ascend (Huawei NPUs), the CuTe DSL and cuTile
# are optional alternatives it falls back from to its Triton kernels: on GPU nodes these lines
# repeat for every op and rank and read like a broken install. A Triton backend that fails to
# import is a real problem (no Liger on this GPU), and stays.
LIGER_REGISTRY = "liger_kernel.backends.registry"
_OPTIONAL_LIGER_BACKEND = re.compile(
    r"^Backend impl 'liger_kernel\.ops\.backends\._(ascend|cutedsl|cutile)\.[\w.]+' for op '\w+' "
    r"could not be imported: (ImportError|ModuleNotFoundError): "
)


def _drop_missing_optional_liger_backends(record: logging.LogRecord) -> bool:
    return not _OPTIONAL_LIGER_BACKEND.match(record.getMessage())


def cuda_arch_default(env: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``TORCH_CUDA_ARCH_LIST`` to the visible GPUs' compute capabilities (after torch import).

    DeepSpeed's op builder otherwise derives the list from torch's own build list,
    whose entries such as ``10.0a`` crash it (``invalid literal for int() with base
    10: '0a'``, seen with torch 2.11 + DeepSpeed 0.19.8), and building only for the
    GPUs present is also the fastest build.
    """
    env = os.environ if env is None else env
    if "TORCH_CUDA_ARCH_LIST" in env:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    archs = sorted({"{}.{}".format(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())})
    env["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    return env["TORCH_CUDA_ARCH_LIST"]


# -- DeepSpeed's op builds, said ------------------------------------------------------------------
# DeepSpeed builds an op it has no prebuilt copy of at the op's first use (``OpBuilder.jit_load``:
# ninja and the C++ compiler, into ``TORCH_EXTENSIONS_DIR``, above), and says nothing while it
# does: the first run of an offload plan sat 3¾ minutes without a word while ``cpu_adam`` built
# (4 m 02 s to the first step, against 28 s without offload). Wrapping ``jit_load`` gives one line
# before the build and one after, with the seconds; a build already in the extensions folder is
# said as loaded from there. Only local rank 0 speaks: a node's other ranks load the same op (they
# wait on torch's lock while one of them builds it).
TRAIN_LINE = "dzctl-train: "  # what the trainer's own lines start with (run.py, datasets.py)


def _say(text: str) -> None:
    print(f"{TRAIN_LINE}{text}", flush=True)


def announce_op_builds(say: Callable[[str], None] = _say) -> None:
    """Make every DeepSpeed op's JIT load say what it builds or loads, and in how many seconds (once a process)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    from deepspeed.ops.op_builder import builder

    classes = [builder.OpBuilder]
    try:  # a DeepSpeed installed from its source tree uses its own copy of the builders (cpu_accelerator.py)
        import op_builder  # type: ignore[import-not-found]

        if hasattr(op_builder, "__deepspeed__"):
            from op_builder import builder as source_builder  # type: ignore[import-not-found]

            classes.append(source_builder.OpBuilder)
    except ImportError:
        pass
    for cls in classes:
        if not getattr(cls.jit_load, "_dzctl_announces", False):
            cls.jit_load = _announcing(cls.jit_load, say)


def _announcing(jit_load, say: Callable[[str], None]):
    @functools.wraps(jit_load)
    def load(self, *args, **kwargs):
        folder = _build_folder(self.name)
        built_file = folder / f"{self.name}.so" if folder else None
        before = _mtime(built_file)
        if before is not None:
            say(f"DeepSpeed op {self.name}: loading its cached build ({folder})")
        else:
            where = f" into {folder}" if folder else ""
            say(
                f"DeepSpeed op {self.name}: building it{where} (a JIT build at its first use on this node "
                "with the C++ compiler: minutes for cpu_adam; later runs load it from there)"
            )
        started = time.monotonic()
        try:
            module = jit_load(self, *args, **kwargs)
        except BaseException:
            say(f"DeepSpeed op {self.name}: failed after {time.monotonic() - started:.1f} s")
            raise
        seconds = time.monotonic() - started
        after = _mtime(built_file)
        if before is not None and after == before:
            say(f"DeepSpeed op {self.name}: loaded cached {self.name} in {seconds:.1f} s")
        else:
            say(f"DeepSpeed op {self.name}: built in {seconds:.1f} s")
        return module

    load._dzctl_announces = True
    return load


def _build_folder(name: str) -> Path | None:
    """Where torch builds and keeps the op (``TORCH_EXTENSIONS_DIR``, else its default under the cache)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, verbose=False))
    except Exception:  # a private torch function: without it the lines only lose the cached/built word
        return None


def _mtime(path: Path | None) -> int | None:
    try:
        return path.stat().st_mtime_ns if path is not None else None
    except OSError:
        return None
