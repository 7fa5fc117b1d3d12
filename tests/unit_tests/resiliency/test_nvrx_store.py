"""The store NVRx's in-process restart runs on, with NVRx 0.7's real sibling monitor: a rank it
finds unresponsive must not poison the termination barrier that every rank's wrapper enters at the
end of the run (a finished CI run ended with exit status 1 on ``int("b'1'")``)."""

from datetime import timedelta

import pytest
import torch.distributed as dist
from nvidia_resiliency_ext.inprocess.sibling_monitor import SiblingMonitor
from nvidia_resiliency_ext.inprocess.store import PrefixStore, StoreMixin

from tierstack.resiliency.nvrx_store import JobStore


@pytest.fixture
def master(monkeypatch):
    """A real TCP store server, as the job's (rank 0's slot hosts it), on a port it picks."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    return server


def _unresponsive_rank_1_then_rank_0_ends(base) -> None:
    """What the job does: rank 0's monitor finds rank 1 unresponsive (it enters the termination
    barrier for rank 1), then rank 0's wrapper shuts down at the end of the run."""
    store = PrefixStore(0, base)  # the iteration's store, as NVRx's monitor process builds it
    for rank in (0, 1):
        store.set_initial_rank(rank, rank)
    SiblingMonitor(store, rank=0, world_size=2, initial_world_size=2, timeout=timedelta(seconds=1),
                   interval=timedelta(seconds=0.1)).terminate_unresponsive_ranks({1})
    base.termination_barrier(ranks=[0], rendezvous_count=2, timeout=timedelta(seconds=5))


def test_an_unresponsive_rank_does_not_poison_the_termination_barrier(master):
    store = JobStore("job/", timeout_s=10)
    _unresponsive_rank_1_then_rank_0_ends(store)  # returns: both ranks arrived
    arrived = store.get_packed("inprocess_barrier_prefix:reentrant_barrier:termination_barrier:arrived", ",")
    assert arrived == ["1", "0"]


def test_nvrx_own_store_still_has_the_defect_the_job_store_works_around(master):
    """When this fails, nvidia-resiliency-ext fixed ``terminate_unresponsive_ranks``: the override
    in :class:`JobStore` can go."""
    class Plain(dist.PrefixStore, StoreMixin):
        pass

    tcp = dist.TCPStore("127.0.0.1", master.port, is_master=False)
    with pytest.raises(ValueError, match="b'1'"):
        _unresponsive_rank_1_then_rank_0_ends(Plain("plain/", tcp))


def _rank_1_found_dead_before_it_wrote_its_initial_rank(base) -> float:
    """Rank 0's monitor finds rank 1 unresponsive in an iteration rank 1 never began (killed during
    the restart, before NVRx's ``set_initial_rank``); returns the seconds the monitor spent."""
    import time

    store = PrefixStore(1, base)
    store.set_initial_rank(0, 0)
    t0 = time.monotonic()
    SiblingMonitor(store, rank=0, world_size=2, initial_world_size=2, timeout=timedelta(seconds=1),
                   interval=timedelta(seconds=0.1)).terminate_unresponsive_ranks({1})
    return time.monotonic() - t0


def test_a_rank_killed_before_it_began_the_iteration_does_not_hold_up_its_siblings_monitor(master):
    """The second defect the job store works around (module docstring): the monitor's read of the
    dead rank's initial rank waited for the store's timeout (60 s here; minutes in a job), which
    cost a healthy rank at the next restart. Now it waits about ``INITIAL_RANK_WAIT_S``, the
    interruption is recorded, and the termination barrier is not entered for an unknown rank."""
    from tierstack.resiliency.nvrx_store import INITIAL_RANK_WAIT_S

    store = JobStore("job/", timeout_s=60)
    took = _rank_1_found_dead_before_it_wrote_its_initial_rank(store)
    assert INITIAL_RANK_WAIT_S <= took < INITIAL_RANK_WAIT_S + 3
    iteration = PrefixStore(1, store)
    assert iteration.get_terminated_ranks() == {1}
    arrived = store.get_packed("inprocess_barrier_prefix:reentrant_barrier:termination_barrier:arrived", ",")
    assert arrived in ([], [""]), arrived  # no rank entered for the unknown initial rank (not even "-1")


def test_nvrx_own_store_still_waits_for_the_initial_rank_of_a_rank_that_never_wrote_it(master):
    """When this fails, nvidia-resiliency-ext no longer waits there: :meth:`JobStore.multi_get` can go."""
    class Plain(dist.PrefixStore, StoreMixin):
        pass

    tcp = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=2))
    with pytest.raises(dist.DistStoreError):
        _rank_1_found_dead_before_it_wrote_its_initial_rank(Plain("plain/", tcp))
