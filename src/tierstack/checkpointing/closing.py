"""Closing the tiers at the end of a run: together (collective), or alone on a rank that unwinds
from an error of its own, which must enter no collective the other ranks did not agree to (they may
be inside a training collective, or gone: on gloo it would cost them the collective timeout, on
NCCL it would pair with a collective of another kind)."""

from __future__ import annotations

import logging
from typing import Iterable

from tierstack.checkpointing.types import CheckpointTierHandler
from tierstack.runtime import collectives
from tierstack.runtime.failures import FILE_ONLY, peer_lost

log = logging.getLogger(__name__)


def close_each(handlers: Iterable[CheckpointTierHandler]) -> list[BaseException]:
    """Collective: ``close()`` every tier, each even when another one's close raised.

    Returns:
        The errors the closes raised, in tier order (the caller raises the first).
    """
    errors: list[BaseException] = []
    for handler in handlers:
        try:
            handler.close()
        except Exception as e:  # noqa: BLE001 - returned: raised by the caller after every tier is closed
            errors.append(e)
    return errors


def close_alone(handlers: Iterable[CheckpointTierHandler], error: BaseException) -> None:
    """Not collective: ``close_alone()`` every tier (its save in flight abandoned unpublished, its
    writer not waited for), then wait for its retention (bounded by the tier). A failure is logged:
    ``error``, what ended the run, is the outcome."""
    from tierstack.resiliency import in_process

    if in_process.interrupted():  # the abort released the groups under a collective: not this rank's fault
        log.warning("rank %d: interrupted by an in-process restart (%s once its process groups were released); its "
                    "checkpoints are closed without the other ranks", collectives.rank_label(), type(error).__name__)
    elif peer_lost(error):  # the rank's one console line says so (recipes.runner); the log file keeps this
        log.warning("rank %d: another rank is gone; its checkpoints are closed without the other ranks (under "
                    "in-process restart it then restarts in this process)", collectives.rank_label(), extra=FILE_ONLY)
    else:
        log.warning("rank %d stops on an error of its own (%s): its checkpoints are closed without the other ranks",
                    collectives.rank_label(), type(error).__name__)
    for handler in handlers:
        try:
            handler.close_alone()
        except Exception:  # noqa: BLE001 - logged; `error` is what ended the run
            log.exception("closing the %s tier alone failed", handler.tier.value.upper())
        handler.close_retention()
