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
