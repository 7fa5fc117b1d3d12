"""Errors that mean "the input is wrong": the run stops with one message and exit status 2.

A :class:`BadInputError` is raised on every rank alike (the check that raises it agrees across
ranks first), before any work that could be lost. ``tierstack.recipes.run`` prints its message once,
on rank 0, and every other rank says one line; the process exits with status 2, as for a config
error. Anything else that goes wrong is a crash and keeps its traceback.
"""

from __future__ import annotations


class BadInputError(Exception):
    """Bad input the user must fix (a config field, a data file, a checkpoint directory).

    Subclasses: ``ConfigError`` (config), ``DataFileError`` (dataset files),
    ``CheckpointMismatchError`` and ``CheckpointFamilyError`` (resume). The message names the
    field or file to fix and what to do.
    """


__all__ = ["BadInputError"]
