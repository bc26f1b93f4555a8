"""Preference training's pure side (``train.stage: dpo | kto``, docs/preference.md): its rows, and its reference."""
