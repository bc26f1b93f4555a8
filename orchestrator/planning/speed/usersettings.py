"""The ZeRO-3 settings of a user's own DeepSpeed config that change the predicted step, and where each came from (pure).

A job's ``zero.config`` (a hand-written config, or another tool's such as LLaMA-Factory's
``ds_z3_config.json``) and its ``zero.overrides`` win over what dzctl would write. Where they set a
key the step-time model has a parameter for, the model predicts with the user's value, and the plan
says which file and key it took it from: LLaMA-Factory's ZeRO-3 configs set ``overlap_comm: false``,
which by the model's own formula adds every collective to the compute (about 40 % slower on a
100 Gbit/s link for Qwen3-8B on 2 × 8 H100).

``"auto"`` is no setting of the user's: the planner fills it (``dsconfig.fill_auto``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The keys of ``zero_optimization`` the step-time model reads, and what the user's value does there.
SPEED_KEYS: dict[str, str] = {
    "overlap_comm": "",  # worded by value: see UserSetting.effect
    "reduce_bucket_size": "the gradient reduce-scatter's bucket, in elements (not chosen by the model)",
    "stage3_prefetch_bucket_size": "the all-gathers' prefetch bucket, in elements (not chosen by the model)",
    "stage3_param_persistence_threshold": "weights of at most this many elements stay whole on every GPU, never "
    "gathered",
    "stage3_max_reuse_distance": "a weight used again within this many elements of weights is not gathered again",
    "zero_hpz_partition_size": "hpZ's group of GPUs (not chosen by the model)",
}


@dataclass(frozen=True)
class UserSetting:
    """One speed-relevant key the user's config fixes: its value and where it was written."""

    key: str
    value: bool | int
    source: str  # "zero.config ds_z3_config.json" or "zero.overrides"

    @property
    def effect(self) -> str:
        if self.key == "overlap_comm":
            if self.value is False:
                return "communication not overlapped with compute (the predicted step adds the two)"
            return "communication overlapped with compute"
        return SPEED_KEYS[self.key]

    def describe(self) -> str:
        """``overlap_comm: false (from zero.config ds_z3_config.json): communication not overlapped ...``"""
        value = json.dumps(self.value) if isinstance(self.value, bool) else f"{self.value:,}"
        return f"{self.key}: {value} (from {self.source}): {self.effect}"

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "source": self.source}


@dataclass(frozen=True)
class UserZeroSettings:
    """The speed-relevant keys a job's own config fixes (none: dzctl's generated config decides them all)."""

    settings: tuple[UserSetting, ...] = ()

    def get(self, key: str) -> UserSetting | None:
        return next((s for s in self.settings if s.key == key), None)

    def integer(self, key: str) -> int | None:
        setting = self.get(key)
        return int(setting.value) if setting is not None and not isinstance(setting.value, bool) else None

    @property
    def overlap_off(self) -> UserSetting | None:
        """The setting that turns ``overlap_comm`` off, if one does."""
        setting = self.get("overlap_comm")
        return setting if setting is not None and setting.value is False else None

    def notes(self) -> list[str]:
        return [setting.describe() for setting in self.settings]

    def to_list(self) -> list[dict[str, Any]]:
        return [setting.to_dict() for setting in self.settings]


def _zero_section(config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    zero = (config or {}).get("zero_optimization")
    return zero if isinstance(zero, Mapping) else {}


def _speed_value(key: str, value: Any) -> bool | int | None:
    """The value the model can use: a boolean ``overlap_comm``, a number elsewhere (JSON's 1e9 is a float)."""
    if key == "overlap_comm":
        return value if isinstance(value, bool) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    return None  # "auto" (the planner fills it) or a value DeepSpeed itself will refuse


def user_zero_settings(
    config: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None, config_name: str | None
) -> UserZeroSettings:
    """The speed-relevant keys of ``zero.config`` (named ``config_name``) and ``zero.overrides``; overrides win."""
    written = _zero_section(config)
    overridden = _zero_section(overrides)
    where = f"zero.config {config_name}" if config_name else "the job's DeepSpeed config"
    found: list[UserSetting] = []
    for key in SPEED_KEYS:
        for section, source in ((overridden, "zero.overrides"), (written, where)):
            if key in section:
                value = _speed_value(key, section[key])
                if value is not None:
                    found.append(UserSetting(key, value, source))
                break  # the overriding value decides, even "auto"
    return UserZeroSettings(tuple(found))
