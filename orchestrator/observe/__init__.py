"""Watching a job: the local record (``store``), what the hosts say (``hosts``), the state derived from it
(``status``), and how a person sees it (``watchstate``, ``view``, ``lines``, ``plot``).
"""
