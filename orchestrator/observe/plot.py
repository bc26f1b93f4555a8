"""``dzctl status JOB --plot FILE.png``: loss, smoothed loss, eval loss, learning rate, gradient norm,
a preference stage's reward margin, reward accuracy and KL, and useful tokens/s against step.

The eval loss (``eval`` events) is drawn on the loss panel, the gradient norm (``grad_norm``
of the step events, before clipping) on a panel of its own; each only when the run has it.

matplotlib is imported here, inside ``write_plot``, and this module only when
``--plot`` is given: the controller's usual import path never loads it (a test
checks). It comes with the ``plot`` extra.

The PNG carries the plotted series in its own text metadata (key
``dzctl-series``, JSON): read back from the drawn lines, so a reader (the tests,
a script comparing runs) gets the exact numbers without reading pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError, RuntimeFailure
from .view import EMA_FACTOR
from .watchstate import ema

SERIES_KEY = "dzctl-series"
# A preference stage's panel (docs/preference.md): the reward margin and accuracy, KTO's KL.
PREFERENCE_SERIES = (("reward_margin", "reward margin"), ("reward_accuracy", "reward accuracy"), ("kl", "KL"))


def plot_series(events: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """Quantity -> (steps, values) from the step events; each only where the value is known."""
    steps = [e for e in events if e.get("event") == "step" and isinstance(e.get("step"), int)]
    series: dict[str, tuple[list[int], list[float]]] = {}
    evals = [e for e in events if e.get("event") == "eval" and isinstance(e.get("step"), int)]
    for rows, key, name in (
        (steps, "loss", "loss"),
        (steps, "learning_rate", "learning rate"),
        (steps, "tokens_per_s", "useful tokens/s"),
        (steps, "grad_norm", "grad norm"),
        (evals, "eval_loss", "eval loss"),
    ):
        known = [(e["step"], float(e[key])) for e in rows if isinstance(e.get(key), (int, float))]
        series[name] = ([s for s, _ in known], [v for _, v in known])
    loss_steps, losses = series["loss"]
    series[f"smoothed loss (EMA {EMA_FACTOR})"] = (loss_steps, ema(losses, EMA_FACTOR))
    for key, name in PREFERENCE_SERIES:  # train.stage dpo | kto: only where the run logs them
        known = [(e["step"], float(e[key])) for e in steps if isinstance(e.get(key), (int, float))]
        if known:
            series[name] = ([s for s, _ in known], [v for _, v in known])
    return series


def write_plot(events: list[dict], path: Path, title: str) -> dict[str, dict[str, list]]:
    """Draw the four panels into ``path`` (PNG); returns the series as drawn (also stored in the PNG)."""
    if path.suffix.lower() != ".png":
        raise InputError(f"--plot {path}: the plot is written as PNG", fix=f"name it {path.with_suffix('.png')}")
    try:
        import matplotlib
    except ImportError:
        raise InputError(
            "--plot needs matplotlib, which the controller does not install by default",
            fix="pip install 'dzctl[plot]'",
        ) from None
    matplotlib.use("Agg")  # no display needed: the controller may be a CI box or an SSH session
    import matplotlib.pyplot as plt

    series = plot_series(events)
    if not series["loss"][0]:
        raise RuntimeFailure(
            f"{title}: no step has been logged yet: nothing to plot", fix="plot again once the job has logged steps"
        )
    smoothed_name = f"smoothed loss (EMA {EMA_FACTOR})"
    with_norm = bool(series["grad norm"][0])
    rewards = [name for _, name in PREFERENCE_SERIES if name in series]
    panels = 3 + with_norm + bool(rewards)
    fig, axes = plt.subplots(panels, 1, figsize=(8, {3: 8, 4: 10.5}.get(panels, 13)), sharex=True)
    loss_ax, lr_ax, rate_ax = axes[0], axes[1], axes[-1]
    loss_ax.plot(*series["loss"], label="loss", color="tab:blue", alpha=0.45, linewidth=1)
    loss_ax.plot(*series[smoothed_name], label=smoothed_name, color="tab:blue", linewidth=2)
    if series["eval loss"][0]:
        loss_ax.plot(*series["eval loss"], label="eval loss", color="tab:red", marker="o", markersize=3, linewidth=1.5)
    loss_ax.set_ylabel("loss")
    loss_ax.legend(loc="upper right")
    lr_ax.plot(*series["learning rate"], label="learning rate", color="tab:orange")
    lr_ax.set_ylabel("learning rate")
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if with_norm:
        axes[2].plot(*series["grad norm"], label="grad norm", color="tab:purple")
        axes[2].set_ylabel("gradient norm")
    if rewards:
        ax = axes[2 + with_norm]
        for name in rewards:
            ax.plot(*series[name], label=name)
        ax.set_ylabel("preference")
        ax.legend(loc="upper left")
    rate_ax.plot(*series["useful tokens/s"], label="useful tokens/s", color="tab:green")
    rate_ax.set_ylabel("useful tokens/s (job)")
    rate_ax.set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    # What was drawn, read back from the figure's own lines: the metadata is the plot's data.
    drawn = {
        line.get_label(): {"step": [int(x) for x in line.get_xdata()], "value": [float(y) for y in line.get_ydata()]}
        for ax in axes
        for line in ax.get_lines()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={SERIES_KEY: json.dumps(drawn), "Software": "dzctl"})
    plt.close(fig)
    return drawn
