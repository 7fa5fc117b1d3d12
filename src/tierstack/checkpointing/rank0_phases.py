"""Keep megatron-core's rank-0-only writes from desynchronising the ranks' collectives.

megatron-core 0.19 ``dist_checkpointing.save`` (async, ``async_strategy="mcore"``) has two writes that
rank 0 does alone, each followed by a collective that every rank enters:

- ``FileSystemWriterAsync.finish`` (``.metadata``) inside ``save_state_dict_async_finalize``,
  followed by a broadcast of the failure flag (state_dict_saver.py);
- ``save_config`` (``metadata.json``) inside ``metadata_finalize_fn``, followed by a barrier.

(Before 0.19 rank 0 also wrote ``common.pt`` alone ahead of the planning collectives; 0.19 stores the
common state as a ``ShardedObject`` inside the torch_dist files, written by rank 0's writer thread like
any other shard, so a failure there reaches every rank through the writers' agreement.)

If one of these raises (ENOSPC, EIO), rank 0 leaves megatron while the other ranks wait in the
next collective, and the run hangs until the process-group timeout. Inside :func:`deferring`,
these writes record their error instead of raising, so rank 0 walks through the same collectives
as everyone else; :meth:`Deferred.raise_first` then raises the first error on rank 0, where the caller's
agreement (``retry.run_agreed``) makes every rank fail, or retry, together; an asynchronous
save's finalize step can run just the failed calls again (:meth:`Deferred.rerun`).

The wrappers are installed once, on the class and module that megatron looks them up in at call
time, and do nothing outside :func:`deferring`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Iterator, Optional

log = logging.getLogger(__name__)

_state = threading.local()
_installed = False


class Deferred:
    """Errors recorded inside :func:`deferring`, with the calls that raised them (to run again)."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self.calls: list = []

    def raise_first(self) -> None:
        """Raise the first recorded error (and forget the errors; the failed calls are kept)."""
        if self.errors:
            first = self.errors[0]
            self.errors = []
            raise first

    def rerun(self) -> None:
        """Run the failed calls again (rank 0's metadata writes of a retried finalize step).

        Raises:
            The first error of this run; the calls that failed again are kept for the next one.
        """
        calls, self.calls = self.calls, []
        for call in calls:
            try:
                call()
            except Exception as e:  # noqa: BLE001 - raised below, after every call had its chance
                self.errors.append(e)
                self.calls.append(call)
        self.raise_first()


def _active() -> Optional[Deferred]:
    return getattr(_state, "deferred", None)


def _deferrable(fn, what: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        deferred = _active()
        if deferred is None:
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised by Deferred.raise_first after the collectives
            log.error("writing %s failed on this rank: %s (reported after megatron's collectives)", what, e)
            deferred.errors.append(e)
            deferred.calls.append(functools.partial(fn, *args, **kwargs))
            return None

    wrapper.__tierstack_deferrable__ = True
    return wrapper


def install() -> None:
    """Wrap megatron-core's rank-0-only writes (idempotent)."""
    global _installed
    if _installed:
        return
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    writer = filesystem_async.FileSystemWriterAsync
    writer.finish = _deferrable(writer.finish, "torch_dist metadata (.metadata)")
    serialization.save_config = _deferrable(serialization.save_config, "checkpoint config (metadata.json)")
    _installed = True


@contextlib.contextmanager
def deferring(into: Optional[Deferred] = None) -> Iterator[Deferred]:
    """Within this block, megatron's rank-0-only writes record errors instead of raising.

    Args:
        into: where to record (keep it to :meth:`Deferred.rerun` the failed calls later).

    Raises:
        The first recorded error, when the block ends without another error.
    """
    install()
    deferred = into if into is not None else Deferred()
    _state.deferred = deferred
    try:
        yield deferred
    finally:
        _state.deferred = None
    deferred.raise_first()
