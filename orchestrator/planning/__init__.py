"""Pure planning: every ``auto`` of a job decided from the spec and the hardware, with no side effects.

- ``shape``: the model's shape (config.json, ``model.config`` or the catalogue);
- ``memory/``: per-GPU and host memory, the search over micro-batch, checkpointing and offload, the refusal;
- ``dsconfig``: the DeepSpeed config the plan runs with; ``fusedloss``, ``packing``: two more ``auto`` keys;
- ``launchplan``: per node the host, ranks, argv and env of its one launcher;
- ``trackers``: where each experiment tracker writes;
- ``resolve``: the one resolved job (``ResolvedJob``) every later stage reads.

Never imports transport, docker or torch: the trainer reads the same decisions on the nodes.
"""
