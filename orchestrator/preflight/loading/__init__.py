"""What every rank loads where it runs, checked on every node: the DeepSpeed ops the plan needs (``ops``)."""
