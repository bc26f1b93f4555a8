"""The step-time model: ``communication`` (what ZeRO-3 sends per micro-step, and how long it takes over the
links) and ``steptime`` (compute beside it, the overlap rule, the bound). Pure; ``planning/speed/zerochoice.py``
uses it to choose hpZ and bucket sizes.
"""
