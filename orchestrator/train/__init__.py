"""In-container training: ``python -m orchestrator.train JOB.yaml [--ds-config PATH]``.

The only package of dzctl that imports torch, deepspeed and transformers (the
``train`` extra). The controller never imports it. Modules:

- ``entry``: command line, environment, the one place errors become exit codes.
- ``environment``: variables the field learned to set before torch/DeepSpeed start.
- ``tokenizer``: ``builtin:byte-level`` and loading a model's tokenizer.
- ``data``: alpaca / messages rows → token ids and labels (loss on responses only).
- ``checkpoints``: completeness, resume selection, consolidated-weights check (no torch).
- ``packing``: examples packed into rows of ``max_seq_len`` (no torch).
- ``collate``: a micro-batch of packed rows as one flattened sequence.
- ``attention``: the packed attention kernels, registered with transformers.
- ``progress``: ``progress.jsonl`` events (no torch).
- ``run``: model, Trainer, DeepSpeed: the training itself.
"""
