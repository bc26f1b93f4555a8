"""What every rank loads where it runs, checked on every node: the model's weights (``weights``) and the
DeepSpeed ops the plan needs (``ops``)."""
