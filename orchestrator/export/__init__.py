"""``dzctl export``: a checkpoint of a launched job out as Hugging Face weights.

- ``survey``: what each node holds (a node-side script and the parse of its answer; pure).
- ``choose``: which checkpoint ``N|latest|best`` names, complete on every node that holds a part (pure).
- ``plan``: which files come from which node, how many bytes, where they go (pure).
- ``gather``: the side effects: ask the nodes, stream each node's files as one tar over SSH.

The consolidation itself (DeepSpeed's ZeRO-3 → fp32, safetensors, the check with
``from_pretrained``) needs torch: it is ``orchestrator.train.export``, run as its own
process on the controller, so the controller's own process never imports torch.
"""
