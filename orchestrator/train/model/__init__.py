"""What the trainer does to the model: ``attention`` (the packed attention kernels, registered with
transformers), ``loss`` (the fused losses of ``train.fused_loss``) and ``lora`` (PEFT adapters,
their saving and merging).
"""
