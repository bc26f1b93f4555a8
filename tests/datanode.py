"""One node's data preparation as a process of its own: ``python tests/datanode.py JOB CACHE_DIR LOCAL_RANK``.

What ``orchestrator.train.run`` does on a node before the process group starts, and nothing
else: load the job, build or wait for the data cache (``train/data/prepare.py``) with the
byte-level tokenizer. It prints when it starts preparing, every line the builder says and
when it ended, then ``result {json}`` or ``error: MESSAGE``, and exits 0, or the error's exit
code (a crash: Python's traceback, exit 1).
``tests/test_data_cache_shared.py`` runs several at once on one cache folder, as nodes
sharing storage do.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.errors import DzError  # noqa: E402
from orchestrator.spec.job import load_job  # noqa: E402
from orchestrator.train.data import prepare  # noqa: E402
from orchestrator.train.data.tokenizer import build_byte_level_tokenizer  # noqa: E402


def main(job: str, cache_dir: str, local_rank: str) -> int:
    loaded = load_job(Path(job), [])
    tokenizer = build_byte_level_tokenizer()
    print(f"preparing at {time.time()}", flush=True)  # the test measures how long this rank waited
    try:
        got = prepare.prepare(
            loaded,
            tokenizer,
            packing=False,
            local_rank=int(local_rank),
            cache_dir=Path(cache_dir),
            say=lambda line: print(line, flush=True),
        )
    except DzError as exc:
        print(f"error: {exc.message}", flush=True)
        return exc.exit_code
    finally:
        print(f"ended at {time.time()}", flush=True)
    print("result " + json.dumps({"key": got.key, "cached": got.cached, "examples": got.data.examples}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
