"""What runs a rank on a node: ``control`` builds the argv that start, inspect, follow and stop it
(docker or process runtime, pure), and ``process`` is the node side of ``runtime: process``.
"""
