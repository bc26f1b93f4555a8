"""The training rows (docs/data.md): ``prepare`` (local rank 0 builds the node's cache, the other
ranks wait and map it), ``sources`` (JSON, JSON lines, Parquet, ``save_to_disk`` folders, hub IDs),
``mix`` (how many rows each source gives), ``build`` (stream, encode with a pool of workers, pack,
write), ``cache`` (key, manifest and check, prune rule, lock, run notes), ``mapped`` (the cache as
examples or packed rows), ``conversations`` (a conversation → token ids and labels, loss on the
responses only; also the in-memory path the cache is held to), ``tokenizer``, ``packing`` and
``collate``. The row formats themselves are ``orchestrator/planning/datarows.py`` (the controller
checks the first rows with them too).
"""
