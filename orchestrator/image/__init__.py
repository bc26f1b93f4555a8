"""The image every node runs: ``build`` (dzctl build), ``sources`` (pip's and apt's configured sources),
``layers`` (which layers a node holds), ``store`` (the controller's layer store), ``distribute``
(the same image ID on every node, streamed over SSH) and ``nodepipe`` (one node's end of that
stream, and when the node has stalled).
"""
