"""Errors that mean "the input is wrong": the run stops with one message and exit status 2.

A :class:`BadInputError` is raised on every rank alike (the check that raises it agrees across
ranks first), before any work that could be lost. Its message is printed once, on rank 0, while the ranks are
still together (:func:`say_once`, or ``tierstack.recipes.run`` before any process group exists),
and every other rank says one line; the process exits with status 2, as for a config
error. Anything else that goes wrong is a crash and keeps its traceback.
"""

from __future__ import annotations

import logging
import os
from typing import Optional


class BadInputError(Exception):
    """Bad input the user must fix (a config field, a data file, a checkpoint directory).

    Subclasses: ``ConfigError`` (config), ``DataFileError`` (dataset files),
    ``CheckpointMismatchError`` and ``CheckpointFamilyError`` (resume). The message names the
    field or file to fix and what to do.
    """


def report_on_rank_0(message: str) -> None:
    """Log a refusal on rank 0 (``RANK`` unset counts as 0: a process that is not a rank), with a
    plain console handler when logging is not configured yet."""
    if int(os.environ.get("RANK", "0")) == 0:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(message)s")
        logging.getLogger("tierstack").error("%s", message)


def say_once(exc: BadInputError) -> None:
    """Log ``exc``'s message on rank 0 (``RANK`` unset counts as 0) and mark it said.

    Called while every rank is still inside its process group, before they leave together: under
    torchrun the first rank to exit makes torchrun stop the others (SIGTERM), so a message left for
    the exit path of rank 0 could be lost when another rank exits first. ``exc.said`` tells the
    caller that rank 0 printed it already.
    """
    if not getattr(exc, "said", False):
        report_on_rank_0(str(exc))  # a StreamHandler flushes every record
    exc.said = True


def raised_on_every_rank(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` is an error every rank raises at the same point (the ranks agreed on it
    first): a :class:`BadInputError`, or a class that sets ``raised_on_every_rank = True`` (e.g.
    ``CheckpointSaveError``, ``NonFiniteError``). Anything else (a bug, an OOM, a failed
    collective) may be this rank's alone: while it unwinds, the rank must enter no collective."""
    return isinstance(exc, BadInputError) or bool(getattr(exc, "raised_on_every_rank", False))


__all__ = ["BadInputError", "raised_on_every_rank", "report_on_rank_0", "say_once"]
