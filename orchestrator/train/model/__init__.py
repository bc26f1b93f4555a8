"""What the trainer does to the model: ``attention`` (the packed attention kernels, registered with
transformers), ``loss`` (the fused losses of ``train.fused_loss``), ``checkpointing`` (activation
checkpointing in the names the installed transformers expects) and ``lora`` (PEFT adapters,
their saving and merging).
"""
