"""In-container training: ``python -m orchestrator.train JOB.yaml [--ds-config PATH]``.

The only package of dzctl that imports torch, deepspeed and transformers (the
``train`` extra). The controller never imports it. Modules:

- ``entry``: command line, environment, the one place errors become exit codes.
- ``environment``: variables the field learned to set before torch/DeepSpeed start.
- ``data/``: the rows: reading and encoding conversations, the tokenizer, packing, collation.
- ``model/``: the packed attention kernels, the fused losses, LoRA.
- ``checkpoints``: completeness, resume selection, consolidated-weights check (no torch).
- ``gang``: the watchdog that stops every rank when one fails; ``collective``: preflight's check.
- ``progress``: ``progress.jsonl`` events (no torch); ``rankprefix``: rank-prefixed output.
- ``run``: model, Trainer, DeepSpeed: the training itself.
"""
