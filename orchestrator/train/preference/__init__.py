"""Preference training on the nodes (``train.stage: dpo | kto``): rows → ids, TRL's trainers (docs/preference.md)."""
