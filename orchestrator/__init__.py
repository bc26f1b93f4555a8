"""dzctl: launch DeepSpeed ZeRO-3 fine-tuning across GPU nodes, one container per node."""

__version__ = "0.1.0"
