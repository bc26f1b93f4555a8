"""The training rows: ``conversations`` (alpaca / messages rows → token ids and labels, loss on
responses only), ``tokenizer`` (``builtin:byte-level`` or the model's own), ``packing`` (examples
packed into rows of ``max_seq_len``, no torch) and ``collate`` (a micro-batch of packed rows as one
flattened sequence).
"""
