"""Staging: host buffers kept across saves, and the background writer that reads them.

One :class:`Stager` per tier moves a checkpoint's bytes off the training loop:

1. :meth:`Stager.stage` copies the state's tensors into host buffers allocated at the first save
   with the state's shapes and dtypes and refilled with ``copy_`` at every later one (pinned, with
   the device-to-host copies on a side stream, on GPU: see :mod:`tierstack.runtime.host_copy`).
   On CPU too the copy is made, also for tensors already on the host: it is the only thing that
   separates what is written from what the next optimizer step changes in place.
2. :meth:`Stager.submit` hands a job that reads those buffers to one persistent writer thread.
   The buffers belong to the writer until that job has ended: the next :meth:`stage` waits for it
   (so a slow writer can never see half-refilled buffers), and a tier never has two saves in flight.

A writer *thread* rather than a writer process, because what it does releases the GIL (``os.write``,
``fsync``, CRC-32C over large buffers) and it reads the buffers where they are: a process would need
the state in shared memory segments (one more copy target that must be cleaned up after a crash) or
a fork, whose copy-on-write snapshot makes the next training step fault on every page it writes.
The benchmark (``scripts/bench_checkpoint.py``) prints the extra time of the steps that overlap a
background write, which is what a writer costs training either way.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import torch

from tierstack import runtime

log = logging.getLogger(__name__)


class Stager:
    """Reused host staging buffers for one tier and the writer thread that drains them.

    Args:
        name: the tier's name, for the thread name and log lines.
    """

    def __init__(self, name: str):
        self.name = name
        self._buffers: list[torch.Tensor] = []
        self._signature: Optional[list[tuple]] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._job: Optional[Future] = None
        self.allocations = 0  # how many times the buffers were (re)allocated: 1 for a steady run

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held by the staging buffers (the checkpoint memory cost per rank)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    @property
    def job(self) -> Optional[Future]:
        """The job the writer is running or ran last (None before the first submit)."""
        return self._job

    def wait_released(self) -> None:
        """Block until the writer has finished with the buffers (its job's outcome is not raised)."""
        if self._job is not None:
            self._job.exception()

    def stage(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy ``tensors`` into the staging buffers and return them (same order, shapes, dtypes).

        Waits first until the writer released the buffers. Allocates them at the first call, and
        again only when the shapes or dtypes of the state change (logged).
        """
        self.wait_released()
        signature = [(tuple(t.shape), t.dtype) for t in tensors]
        if signature != self._signature:
            if self._signature is not None:
                log.info("%s staging: the state's shapes changed; reallocating the buffers", self.name)
            self._buffers = []  # drop the old ones before allocating the new
            self._buffers = [runtime.empty_host_buffer(t) for t in tensors]
            self._signature = signature
            self.allocations += 1
            log.info("%s staging: %d buffers, %.3f GiB of host memory", self.name, len(self._buffers),
                     self.nbytes / 2**30)
        runtime.copy_to_host(self._buffers, tensors)
        return list(self._buffers)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` on the writer thread; the buffers are the writer's until it returns.

        Raises:
            RuntimeError: the previous job has not ended (the caller must finalize it first).
        """
        if self._job is not None and not self._job.done():
            raise RuntimeError(f"{self.name} staging: a save is still in flight")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tierstack-{self.name}-writer")
        self._job = self._executor.submit(fn, *args, **kwargs)
        return self._job

    def close(self) -> None:
        """Wait for the writer, stop its thread, free the buffers. Idempotent."""
        self.wait_released()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._buffers, self._signature, self._job = [], None, None


class StagedTier:
    """What every tier that saves through a :class:`Stager` shares: the one save in flight, the
    staging buffers, the failed steps, and closing (finalize, then stop the writer).

    A subclass sets ``self._in_flight`` when it hands a save to ``self._stager`` and implements
    ``finalize`` with :meth:`_take_ended`.
    """

    def __init__(self, name: str) -> None:
        self._stager = Stager(name)
        self._in_flight = None  # the save handed to the writer and not yet finalized (one at most)
        self.failures: list[int] = []  # steps whose save failed on some rank (the manager decides what follows)
        self.last_durable_s: Optional[float] = None  # start of the last finalized save to its agreement

    @property
    def in_flight(self) -> int:
        return 0 if self._in_flight is None else 1

    @property
    def staging_bytes(self) -> int:
        return self._stager.nbytes

    def _take_ended(self, blocking: bool):
        """Collective: the save in flight, taken out of flight, once its writer ended on every rank
        (``blocking``: whenever it ends); None while it is still running somewhere, or with none."""
        from tierstack.runtime import collectives

        job = self._in_flight
        if job is None:
            return None
        if not blocking and not collectives.all_true(job.job.done()):
            return None  # a sync point per step while a save is in flight: one small all-reduce
        self._in_flight = None
        return job

    def finalize(self, blocking: bool) -> None:  # pragma: no cover - every tier defines it
        raise NotImplementedError

    def close(self) -> None:
        """Collective: finalize the save in flight (blocking), then stop the writer and free the buffers."""
        try:
            self.finalize(blocking=True)
        finally:
            self._stager.close()
