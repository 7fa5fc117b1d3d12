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
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Callable, Optional, Sequence

import torch

from tierstack import runtime
from tierstack.checkpointing.writer_thread import WriterThread as _WriterThread

log = logging.getLogger(__name__)


class WriterTimeout(RuntimeError):
    """A tier's writer thread was still running on some rank ``checkpoint.async_write_timeout_s``
    seconds into a blocking wait (the same error on every rank)."""


class Stager:
    """Reused host staging buffers for one tier and the writer thread that drains them.

    Args:
        name: the tier's name, for the thread name and log lines.
    """

    def __init__(self, name: str):
        self.name = name
        self._buffers: list[torch.Tensor] = []
        self._signature: Optional[list[tuple]] = None
        self._executor: Optional[_WriterThread] = None
        self._job: Optional[Future] = None
        self.allocations = 0  # how many times the buffers were (re)allocated: 1 for a steady run

    @property
    def nbytes(self) -> int:
        """Bytes of host memory held by the staging buffers (the checkpoint memory cost per rank)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The staging buffers as the last :meth:`stage` filled them (the writer's while a job runs)."""
        return list(self._buffers)

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
            self._buffers = self._allocate(tensors)  # one (pinned, on GPU) region, exact sizes
            self._signature = signature
            self.allocations += 1
            log.info("%s staging: %d buffers, %.3f GiB of host memory", self.name, len(self._buffers),
                     self.nbytes / 2**30)
        runtime.copy_to_host(self._buffers, tensors)
        return list(self._buffers)

    def _allocate(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """New staging buffers for ``tensors`` (a subclass may back them with a file)."""
        return runtime.empty_host_buffers(tensors)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Run ``fn(*args, **kwargs)`` on the writer thread; the buffers are the writer's until it returns.

        Raises:
            RuntimeError: the previous job has not ended (the caller must finalize it first).
        """
        if self._job is not None and not self._job.done():
            raise RuntimeError(f"{self.name} staging: a save is still in flight")
        if self._executor is None:
            self._executor = _WriterThread(f"tierstack-{self.name}-writer")
        self._job = self._executor.submit(fn, *args, **kwargs)
        return self._job

    def abandon(self) -> None:
        """Leave a stuck writer thread behind: it keeps its job and the buffers it reads (they are
        never reused); the next :meth:`submit` starts a new thread and :meth:`stage` allocates new
        buffers. The old thread is a daemon, so it does not keep the process from exiting."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self._executor, self._buffers, self._signature, self._job = None, [], None, None

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Wait for the writer (at most ``timeout_s`` seconds; None: as long as it runs), stop its
        thread, free the buffers. A writer still running after ``timeout_s`` (a hung file system,
        after a failed finalize) is left behind as :meth:`abandon` does, and logged. Idempotent."""
        if self._job is not None and not wait_futures([self._job], timeout=timeout_s).done:
            log.warning("%s writer still running %s; left behind", self.name, f"after {timeout_s:.0f} s at close (a "
                        "hung file system?)" if timeout_s else "at a failure's close (its save abandoned unpublished)")
            self.abandon()
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

    def __init__(self, name: str, write_timeout_s: float = 1800.0) -> None:
        self._stager = Stager(name)
        self._write_timeout_s = write_timeout_s  # checkpoint.async_write_timeout_s
        self._in_flight = None  # the save handed to the writer and not yet finalized (one at most)
        self.failures: list[int] = []  # steps whose save failed on some rank (the manager decides what follows)
        # (step, ranks) of saves whose staged state held NaN/inf on those ranks; the manager takes them
        self.nonfinite: list[tuple[int, list[int]]] = []
        self._vetoed: set[int] = set()  # steps the guard blocked in another tier (see veto)
        self.last_durable_s: Optional[float] = None  # start of the last finalized save to its agreement
        self.last_blocked_s: Optional[float] = None  # seconds that save kept the training loop waiting
        self._retention: Optional[_WriterThread] = None  # deletes old checkpoints off the training thread
        self._retention_jobs: list[Future] = []
        self._held_retention: list[tuple[int, Callable[[], object], str]] = []  # see _retain_when_settled

    def _retain(self, fn: Callable[[], object], what: str) -> None:
        """Run retention ``fn`` (deleting old checkpoints) on this tier's retention thread, after the
        retention jobs before it. Deleting a checkpoint frees its pages and blocks: 0.3-0.6 s per
        GiB on the development machine, far more on a parallel file system; the training thread does
        not wait for it, and no save waits for it either. A failure is logged (retention never fails
        a save). Called on the training thread only, like :meth:`wait_retention`."""
        def job() -> None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - logged; the next save's retention tries again
                log.warning("%s retention %s failed: %s", self._stager.name, what, e)

        if self._retention is None:  # a daemon thread: a hung deletion never keeps the process alive
            self._retention = _WriterThread(f"tierstack-{self._stager.name}-retention")
        self._retention_jobs = [f for f in self._retention_jobs if not f.done()] + [self._retention.submit(job)]

    def _submit_checked(self, what: str, fn: Callable, *args, then: Optional[Callable[[bool], None]] = None,
                        check_in_fn: bool = False, checked: Optional[Sequence[torch.Tensor]] = None,
                        **kwargs) -> Future:
        """Hand ``fn(*args, **kwargs)`` to the writer thread behind the non-finite check of the
        buffers just staged (:func:`~tierstack.checkpointing.nonfinite_guard.check_staged`): a
        non-finite state raises ``NonFiniteStateError`` there and ``fn`` never runs, so nothing
        of it is written. The check reads the state once more (0.1 s per GiB here), off the loop.

        ``check_in_fn``: instead, ``fn`` gets the check as its ``check`` keyword (a callable that
        raises ``NonFiniteStateError``) and must run it before it reports success, so that it can
        overlap the check with its write (GLOBAL: the bytes go to a staging directory that a failed
        check discards, so nothing of a non-finite state is ever published).

        ``then(ok)``, when given, runs on the writer thread after ``fn`` whatever happened (``ok``:
        the check passed and ``fn`` returned): for a step every rank must take part in, such as
        LOCAL replication's exchange. With ``ok`` False it must not raise (the first error is the
        save's outcome); with ``ok`` True an error it raises fails the save.

        ``checked``: the tensors the write reads, when they are not the staging buffers (a GLOBAL
        sync save that writes the state in place, :func:`global_writer.stage_sharded_tensors`)."""
        from tierstack.checkpointing.nonfinite_guard import check_staged

        buffers = self._stager.buffers if checked is None else list(checked)

        def checked():
            ok = False
            try:
                if check_in_fn:
                    out = fn(*args, check=lambda: check_staged(buffers, what), **kwargs)
                else:
                    check_staged(buffers, what)
                    out = fn(*args, **kwargs)
                ok = True
            finally:
                if then is not None:
                    then(ok)
            return out

        return self._stager.submit(checked)

    def _log_writer_error(self, step: int, error: Optional[BaseException]) -> None:
        """Log this rank's writer outcome of ``step`` when it failed (before the ranks agree on it)."""
        from tierstack.checkpointing import errors
        from tierstack.checkpointing.nonfinite_guard import NonFiniteStateError
        from tierstack.runtime import collectives

        if isinstance(error, NonFiniteStateError):
            log.error("%s", error)
        elif error is not None:
            log.error("%s write of step %d failed on rank %d: %s", self._stager.name, step, collectives.rank(),
                      errors.describe(error))

    def _nonfinite_ranks(self, job) -> list[int]:
        """Collective, on the failure path of a save that failed on every rank (all ranks take it
        together, after the agreement): the ranks whose writer found a non-finite staged state
        (also when a write timeout on another rank is the agreed error)."""
        from tierstack.checkpointing.nonfinite_guard import NonFiniteStateError
        from tierstack.runtime import collectives

        own = job.job.exception() if job.job.done() else None
        return collectives.ranks_where(isinstance(own, NonFiniteStateError))

    def veto(self, step: int) -> None:
        """On every rank: the non-finite guard blocked ``step`` in another tier, so this tier's
        save of it must not be kept either (every tier of a step is blocked alike). A save of it
        still in flight is discarded at its finalize; one already sealed is removed
        (:meth:`_unseal`). Not collective: every rank receives the same vetoes."""
        self._vetoed.add(step)
        if step in self.saved_steps():
            self._unseal(step)

    def _unseal(self, step: int) -> None:  # pragma: no cover - each tier defines it
        raise NotImplementedError

    def _retain_when_settled(self, step: int, fn: Callable[[], object], what: str) -> None:
        """:meth:`_retain` for the save of ``step``, held until no other tier can still veto that
        step (:meth:`release_retention`): retention that deleted the older checkpoints before a
        veto removed this one would leave none."""
        self._held_retention.append((step, fn, what))

    def release_retention(self, settled_through: Optional[int]) -> None:
        """Training thread, every rank alike: start the held retention of the steps up to
        ``settled_through`` (None: all), that is no tier has a save of such a step in flight any
        more; that of a vetoed step is dropped (its older checkpoints stay)."""
        held, self._held_retention = self._held_retention, []
        for step, fn, what in held:
            if step in self._vetoed:
                continue
            if settled_through is None or step <= settled_through:
                self._retain(fn, what)
            else:
                self._held_retention.append((step, fn, what))

    @property
    def in_flight_step(self) -> Optional[int]:
        """The step of the save handed to the writer and not yet finalized; None without one."""
        return None if self._in_flight is None else self._in_flight.step

    @property
    def retention_pending(self) -> bool:
        """A retention job of this rank is held or has not ended yet (not collective)."""
        return bool(self._held_retention) or any(not f.done() for f in self._retention_jobs)

    def wait_retention(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until every retention job submitted so far has ended, at most ``timeout_s`` seconds
        (None: ``checkpoint.async_write_timeout_s``). Not collective: call it after the last
        checkpoint collective, never between two (``CheckpointManager.wait``/``close`` do).

        Returns:
            True when none is left; False after the timeout (logged: the deletion goes on in the
            background, and a directory it leaves is a leftover that a later save removes).
        """
        timeout_s = self._write_timeout_s if timeout_s is None else timeout_s
        _, pending = wait_futures(self._retention_jobs, timeout=timeout_s)
        if pending:
            log.warning("%s retention: still deleting old checkpoints after %.0f s (a slow or hung file system?); "
                        "left to finish in the background", self._stager.name, timeout_s)
            return False
        self._retention_jobs = []
        return True

    def close_retention(self) -> None:
        """Wait for retention (bounded as :meth:`wait_retention`), then stop its thread. Not collective."""
        done = self.wait_retention()
        if self._retention is not None:
            self._retention.shutdown(wait=done)
            self._retention = None

    @property
    def in_flight(self) -> int:
        return 0 if self._in_flight is None else 1

    @property
    def staging_bytes(self) -> int:
        return self._stager.nbytes

    def _take_ended(self, blocking: bool):
        """Collective: the save in flight, taken out of flight, once its writer ended on every rank
        (``blocking``: whenever it ends, within ``checkpoint.async_write_timeout_s``); None while it
        is still running somewhere, or with none. After a timeout the job is returned with
        ``timed_out`` set (see :meth:`_job_error`) and the stuck writer is abandoned."""
        from tierstack.runtime import collectives

        job = self._in_flight
        if job is None:
            return None
        if not blocking and not collectives.all_true(job.job.done()):
            return None  # a sync point per step while a save is in flight: one small all-reduce
        job.timed_out = self._wait_agreed(job) if blocking else None
        self._in_flight = None
        return job

    def _wait_agreed(self, job) -> Optional[WriterTimeout]:
        """Collective: wait until the writer of ``job`` ended on every rank, at most
        ``checkpoint.async_write_timeout_s`` seconds (each rank's clock; the ranks agree each poll).

        Returns:
            None when it ended everywhere; otherwise a :class:`WriterTimeout` naming the tier, step
            and the ranks whose writer still runs (the same on every rank), after logging it and
            abandoning this rank's stuck writer thread.
        """
        from tierstack.runtime import collectives

        deadline, poll = time.monotonic() + self._write_timeout_s, 0.01
        while True:
            wait_futures([job.job], timeout=poll)
            if collectives.all_true(job.job.done()):
                return None
            if collectives.any_true(time.monotonic() >= deadline):
                break
            poll = min(2 * poll, 1.0)
        running = [r for r, done in enumerate(collectives.all_gather_object(job.job.done())) if not done]
        error = WriterTimeout(
            f"{self._stager.name} checkpoint of step {job.step}: the writer thread of rank(s) {running} is still "
            f"running after checkpoint.async_write_timeout_s={self._write_timeout_s:g}s (a hung file system?); "
            "the save fails on every rank and that thread is left behind"
        )
        log.error("%s", error)
        if not job.job.done():
            self._stager.abandon()
        return error

    @staticmethod
    def _job_error(job) -> Optional[BaseException]:
        """This rank's outcome of an ended save: the writer's exception, the agreed timeout, or None."""
        if getattr(job, "timed_out", None) is not None:
            return job.timed_out
        return job.job.exception()

    def finalize(self, blocking: bool) -> None:  # pragma: no cover - every tier defines it
        raise NotImplementedError

    def close(self) -> None:
        """Collective: finalize the save in flight (blocking), then stop the writer and free the
        buffers; a writer still running ``checkpoint.async_write_timeout_s`` after that (finalize
        raised: a peer is gone) is left behind. Retention is not waited for here
        (:meth:`close_retention`, after every collective)."""
        try:
            self.finalize(blocking=True)
        finally:
            try:
                self._stager.close(self._write_timeout_s)
            finally:
                self._on_close()

    def close_alone(self) -> None:
        """Not collective: close on a rank that unwinds from an error of its own, which the other
        ranks did not agree to (they may be in a training collective, or gone). The save in flight
        is abandoned unpublished (its files are leftovers that a later save or resume removes) and
        its writer is not waited for."""
        from tierstack.runtime import collectives

        if self._in_flight is not None:
            log.warning("%s save of step %d abandoned on rank %d: this rank closes its checkpoints without the other "
                        "ranks (an error here or a lost peer), and publishing needs every rank", self._stager.name,
                        self._in_flight.step, collectives.rank_label())
            self._in_flight = None
        try:
            self._stager.close(timeout_s=0)
        finally:
            self._on_close()

    def _on_close(self) -> None:
        """A tier's own cleanup once its writer is stopped (both closes); none by default."""
