"""Loss curve image of a run: train and validation loss over steps, checkpoints and resumes marked.

Drawn with matplotlib's object API on an Agg canvas (no pyplot, no global backend switch), so it
works on headless nodes and never opens a window.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

# Marker style per kind: GLOBAL checkpoints are the persistent ones, so they stand out.
_MARKS = {
    "GLOBAL": dict(color="tab:green", linestyle="-", linewidth=1.4, alpha=0.8),
    "LOCAL": dict(color="tab:gray", linestyle=":", linewidth=1.0, alpha=0.6),
}
_RESUME = dict(color="tab:red", linestyle="--", linewidth=1.8, alpha=0.9)


def _series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = sorted((int(r["step"]), float(r[key])) for r in history if r.get(key) is not None and "event" not in r)
    return [s for s, _ in points], [v for _, v in points]


def plot_loss_curve(
    history: Sequence[Mapping[str, Any]],
    out_path: str | os.PathLike,
    checkpoint_steps: Optional[Mapping[str, Sequence[int]]] = None,
    resume_steps: Optional[Sequence[int]] = None,
    title: str = "tierstack training loss",
) -> Path:
    """Write a PNG of train (``loss``) and validation (``val_loss``) loss against step.

    Args:
        history: records with ``step`` and ``loss`` and/or ``val_loss`` (``MetricsHistory.metrics()``).
        out_path: PNG file to write (parent directories are created).
        checkpoint_steps: ``{"GLOBAL": [...], "LOCAL": [...]}``: vertical lines per checkpoint.
        resume_steps: steps a run resumed from: dashed red lines.
        title: figure title.

    Returns:
        The path written.

    Raises:
        ValueError: ``history`` holds no loss values.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train_x, train_y = _series(history, "loss")
    val_x, val_y = _series(history, "val_loss")
    if not train_x and not val_x:
        raise ValueError("plot_loss_curve: history has no 'loss' or 'val_loss' values")

    fig = Figure(figsize=(9, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train_x:
        ax.plot(train_x, train_y, color="tab:blue", linewidth=1.6, label="train loss")
    if val_x:
        ax.plot(val_x, val_y, color="tab:orange", linewidth=1.6, marker="o", markersize=4, label="validation loss")
    for tier, steps in sorted((checkpoint_steps or {}).items()):  # GLOBAL listed first, drawn above LOCAL
        name = str(tier).upper()
        style = _MARKS.get(name, _MARKS["LOCAL"])
        for i, step in enumerate(sorted(set(steps))):
            ax.axvline(step, label=f"{name} checkpoint" if i == 0 else None, zorder=1.5 if name == "GLOBAL" else 1, **style)
    for i, step in enumerate(sorted(set(resume_steps or []))):
        ax.axvline(step, label="resume" if i == 0 else None, zorder=2, **_RESUME)

    ax.set_xlabel("step (iteration)")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", framealpha=0.9)
    fig.tight_layout()

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
