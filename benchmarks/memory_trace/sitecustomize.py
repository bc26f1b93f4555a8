"""Records the CUDA caching allocator's history in a training rank, for ``benchmarks/cuda_memory_peak.py``.

Put this folder first on ``PYTHONPATH`` and set ``DZCTL_BENCH_MEMORY_TRACE`` to a folder: every process that
torchrun starts as a rank (``LOCAL_RANK`` set) records every allocation and free from its start, with the
Python stack of each allocation, and at exit (the trainer's ``exit_rank`` runs the exit handlers) writes
what was live at its highest allocated moment, grouped by the code that allocated it, and the same for the
highest moment inside a backward and outside one: each ``Tensor.backward`` (DeepSpeed's ``engine.backward``
calls it) allocates a marker block as it begins and as it ends, from a function whose name
``cuda_memory_peak.py`` looks for in the allocation's stack. Any other process
(dzctl itself, torchrun) is left alone. A benchmark tool, never on a job's path.
"""

import atexit
import os

_OUT = os.environ.get("DZCTL_BENCH_MEMORY_TRACE")

if _OUT and "LOCAL_RANK" in os.environ:
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # the rank's own GPU, before anything allocates
        _MAX = int(os.environ.get("DZCTL_BENCH_TRACE_MAX", "4000000"))
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=_MAX)
        _backward = torch.Tensor.backward

        def _backward_begins() -> None:
            torch.empty(1, device="cuda")  # a block allocated and freed: its stack marks the moment

        def _backward_ends() -> None:
            torch.empty(1, device="cuda")

        def _marked_backward(self, *args, **kwargs):
            _backward_begins()
            try:
                return _backward(self, *args, **kwargs)
            finally:
                _backward_ends()

        torch.Tensor.backward = _marked_backward

        def _write() -> None:
            import json
            import sys

            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            from cuda_memory_peak import peak_live

            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            summary = peak_live(snapshot)
            summary["max_allocated_by_torch"] = torch.cuda.max_memory_allocated()
            path = os.path.join(_OUT, f"peak-live-rank{os.environ.get('RANK', '0')}-{os.getpid()}.json")
            os.makedirs(_OUT, exist_ok=True)
            with open(path, "w", encoding="utf-8") as out:
                json.dump(summary, out, indent=1)

        atexit.register(_write)
