"""dzctl's own evaluation on the nodes: the per-token eval loss (``loss``), when it runs and what it
writes (``runner``), and early stopping and the best checkpoint (``policy``, pure)."""
