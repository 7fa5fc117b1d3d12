"""What ``checkpoint.pretrained_checkpoint`` names: a path, or ``<GLOBAL root>:best``.

This is the lowest layer that needs three names of the GLOBAL layout (the step directory's name and
the ``best`` and latest trackers' file names), so they are defined here once: ``checkpointing.paths`` and
``checkpointing.best`` use these, and config validation can resolve a ``:best`` spec without
importing the checkpointing package (which imports config).
"""

from __future__ import annotations

from pathlib import Path

BEST_SUFFIX = ":best"
TRACKER_BEST = "best_checkpointed_iteration.txt"
TRACKER_ITERATION = "latest_checkpointed_iteration.txt"  # a GLOBAL root's newest step


def step_dir_name(step: int) -> str:
    """``iter_0000020`` for step 20: the name of a published GLOBAL step directory."""
    return f"iter_{step:07d}"


def resolve_pretrained(spec: str) -> Path:
    """``<root>:best`` -> the step directory named by the root's ``best`` tracker; any other value
    -> the path itself.

    Raises:
        FileNotFoundError: ``<root>:best`` and the root has no ``best`` tracker, or its step
            directory is missing (the message names ``checkpoint.pretrained_checkpoint``).
    """
    if not spec.endswith(BEST_SUFFIX):
        return Path(spec)
    root = Path(spec[: -len(BEST_SUFFIX)])
    tracker = root / TRACKER_BEST
    try:
        step = int(tracker.read_text().strip())
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"checkpoint.pretrained_checkpoint={spec}: no readable best tracker "
                                f"{tracker} ({e}); was it saved with checkpoint.keep_best_k > 0?") from e
    path = root / step_dir_name(step)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint.pretrained_checkpoint={spec}: {tracker} names step {step} but "
                                f"{path} does not exist")
    return path
