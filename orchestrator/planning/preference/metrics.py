"""The progress keys of a preference stage's metrics (``step`` and ``eval`` events; ``status``; the log lines).

Written by the trainer from TRL's logs (``train/preference/stage.py``), read by ``observe/``.
"""

from __future__ import annotations

from typing import Any

# TRL's metric name -> the progress key (an eval event's carry ``eval_`` before both).
TRL_NAMES: dict[str, str] = {
    "rewards/chosen": "rewards_chosen",  # beta x (policy - reference) log-prob of the chosen answers
    "rewards/rejected": "rewards_rejected",
    "rewards/accuracies": "reward_accuracy",  # the share of pairs whose chosen reward is the higher
    "rewards/margins": "reward_margin",  # chosen minus rejected reward
    "kl": "kl",  # KTO's KL estimate (its reference point)
    "logps/chosen": "logps_chosen",
    "logps/rejected": "logps_rejected",
    "nll_loss": "nll_loss",  # ORPO's and SimPO's SFT term
    "log_odds_ratio": "log_odds_ratio",  # ORPO's
}
# What status and the log lines show of them.
SHOWN = ("rewards_chosen", "rewards_rejected", "reward_accuracy", "reward_margin", "kl")


def of_event(event: dict[str, Any], prefix: str = "") -> dict[str, float] | None:
    """The shown metrics of a step (or, ``prefix="eval_"``, an eval) event; None for an SFT run's."""
    found = {key: event[prefix + key] for key in SHOWN if isinstance(event.get(prefix + key), (int, float))}
    return found or None


def line_text(event: dict[str, Any]) -> str:
    """``reward-acc 92%  margin 1.73  kl 0.41`` for the step's log line ('' for SFT)."""
    found = of_event(event) or {}
    parts = []
    if "reward_accuracy" in found:
        parts.append(f"reward-acc {found['reward_accuracy']:.0%}")
    if "reward_margin" in found:
        parts.append(f"margin {found['reward_margin']:.3g}")
    if "kl" in found:
        parts.append(f"kl {found['kl']:.3g}")
    return "  ".join(parts)
