"""A blocking wait for a tier's writer thread is bounded (checkpoint.async_write_timeout_s): the stuck
thread is left behind as a daemon, the tier gets a new writer and new buffers."""

import threading
import time
from dataclasses import dataclass
from concurrent.futures import Future
from typing import Optional

import torch

from tierstack.checkpointing.staging import StagedTier, WriterTimeout


@dataclass
class _Job:
    step: int
    job: Future
    timed_out: Optional[BaseException] = None


def test_a_stuck_writer_times_out_and_the_tier_goes_on():
    tier = StagedTier("GLOBAL", write_timeout_s=0.3)
    old = tier._stager.stage([torch.ones(4)])
    never = threading.Event()
    tier._in_flight = _Job(2, tier._stager.submit(never.wait))
    t0 = time.monotonic()
    job = tier._take_ended(blocking=True)
    assert 0.3 <= time.monotonic() - t0 < 5
    err = StagedTier._job_error(job)
    assert isinstance(err, WriterTimeout)
    assert "GLOBAL checkpoint of step 2: the writer thread of rank(s) [0] is still running" in str(err)
    assert "checkpoint.async_write_timeout_s=0.3s" in str(err)
    stuck = [t for t in threading.enumerate() if t.name == "tierstack-GLOBAL-writer"]
    assert len(stuck) == 1 and stuck[0].daemon  # cannot keep the process from exiting
    new = tier._stager.stage([torch.full((4,), 2.0)])  # does not wait for the stuck writer
    assert new[0].data_ptr() != old[0].data_ptr() and torch.equal(old[0], torch.ones(4))
    assert tier._stager.submit(lambda: 7).result(timeout=5) == 7
    tier._stager.close()
    never.set()


def test_a_writer_that_ends_in_time_is_taken_with_its_outcome():
    tier = StagedTier("LOCAL", write_timeout_s=5)
    tier._in_flight = _Job(4, tier._stager.submit(lambda: time.sleep(0.2)))
    job = tier._take_ended(blocking=True)
    assert job.timed_out is None and StagedTier._job_error(job) is None
    tier._in_flight = _Job(5, tier._stager.submit(lambda: 1 / 0))
    assert isinstance(StagedTier._job_error(tier._take_ended(blocking=True)), ZeroDivisionError)
    tier._stager.close()


class _FailingFinalize(StagedTier):
    """A tier whose finalize raises (a peer died during the agreement) while its writer is stuck."""

    def finalize(self, blocking: bool) -> None:
        raise RuntimeError("peer gone")


def test_close_after_a_failed_finalize_does_not_wait_forever_on_a_stuck_writer():
    tier = _FailingFinalize("GLOBAL", write_timeout_s=0.3)
    tier._stager.stage([torch.ones(4)])
    never = threading.Event()
    tier._stager.submit(never.wait)
    outcome: list = []

    def close():
        try:
            tier.close()
        except RuntimeError as e:
            outcome.append(e)

    closer = threading.Thread(target=close, daemon=True)
    t0 = time.monotonic()
    closer.start()
    closer.join(timeout=10)
    try:
        assert not closer.is_alive(), "Stager.close waited on the stuck writer past async_write_timeout_s"
        assert 0.3 <= time.monotonic() - t0 < 10
        assert [str(e) for e in outcome] == ["peer gone"]  # finalize's error is the one raised
        assert tier._stager.nbytes == 0 and tier._stager.job is None
    finally:
        never.set()


def test_close_alone_enters_no_collective_and_abandons_the_save_in_flight(caplog):
    """A rank unwinding from its own error: no collective (none is initialised here, so one would
    raise), the save in flight is dropped, never published, and the writer is not waited for."""
    tier = StagedTier("LOCAL", write_timeout_s=30)
    tier._stager.stage([torch.ones(4)])
    never = threading.Event()
    tier._in_flight = _Job(6, tier._stager.submit(never.wait))
    t0 = time.monotonic()
    with caplog.at_level("WARNING"):
        tier.close_alone()
    try:
        assert time.monotonic() - t0 < 5
        assert tier.in_flight == 0 and tier._stager.job is None
        assert "LOCAL save of step 6 abandoned" in caplog.text
    finally:
        never.set()
