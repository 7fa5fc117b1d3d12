"""A peer that is still reading a large file is neither gone nor hung: inside ``io_phase`` the
collective that waits for it gets the I/O wait on top of the collective bound (2 real gloo ranks, a
2 s bound, a peer 5 s late); without it the same wait fails (on NCCL it would abort the process)."""

import time

import torch

from tierstack.runtime import collectives as _dist


def _rank(rank: int, store: str, io_wait_s, out) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    _dist.training_timeout_s = 600.0
    t0 = time.monotonic()
    try:
        with _dist.bounded(2.0):
            with _dist.io_phase(io_wait_s):
                if rank == 1:
                    time.sleep(5.0)  # a whole-file read and checksum
                _dist.all_gather_object(rank)
            _dist.barrier()  # after the phase: the 2 s bound again, and the peers are in step
        out.put((rank, "ok", time.monotonic() - t0))
    except _dist.CollectiveError:
        out.put((rank, "CollectiveError", time.monotonic() - t0))
    finally:
        if rank == 0:
            time.sleep(6.0)  # let rank 1 finish its sleep before the store goes
        torch.distributed.destroy_process_group()


def _run(start_ranks, tmp_path, io_wait_s) -> dict:
    procs, out = start_ranks(_rank, str(tmp_path / "store"), io_wait_s)
    got = {}
    for _ in procs:
        r, kind, seconds = out.get(timeout=120)
        got[r] = (kind, seconds)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return got


def test_a_slow_peer_inside_an_io_phase_is_waited_for(tmp_path, start_ranks):
    got = _run(start_ranks, tmp_path, io_wait_s=30.0)
    assert got[0][0] == "ok" and got[1][0] == "ok", got
    assert got[0][1] >= 4.5, got  # rank 0 did wait for the 5 s read


def test_without_it_the_collective_bound_cuts_the_wait(tmp_path, start_ranks):
    got = _run(start_ranks, tmp_path, io_wait_s=None)
    assert got[0][0] == "CollectiveError", got
