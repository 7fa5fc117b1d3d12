"""``peer_lost``: a collective that failed because another rank died is told from a rank's own error,
on the error gloo really raises (two processes, one killed)."""

import os
import signal

from tierstack.runtime.failures import peer_lost


def _rank(rank: int, init_file: str, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    t = torch.ones(4)
    dist.all_reduce(t)  # both alive: works
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies as an OOM kill would
    try:
        for _ in range(50):
            dist.all_reduce(t)
        out.put(("no error", None))
    except Exception as exc:  # noqa: BLE001 - the error under test
        out.put((type(exc).__name__, peer_lost(exc)))


def test_a_collective_with_a_killed_peer_is_a_peer_loss(tmp_path, start_ranks):
    procs, out = start_ranks(_rank, str(tmp_path / "init"))
    name, what = out.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    assert procs[1].exitcode == -signal.SIGKILL
    assert what is not None and what.startswith("gloo: "), (name, what)
    assert "by peer" in what and "GLHF" not in what and "This is typically" not in what


def test_an_error_of_the_rank_itself_is_not():
    assert peer_lost(ValueError("bad shape")) is None
    assert peer_lost(RuntimeError("CUDA out of memory")) is None
    try:  # wrapped, as tierstack's checkpoint collectives wrap it
        try:
            raise RuntimeError("[../pair.cc:537] Read error [10.0.0.2]:4000: Connection reset by peer. "
                               "This is typically caused by a remote worker hanging. GLHF!")
        except RuntimeError as inner:
            raise KeyError("save") from inner
    except KeyError as outer:
        assert peer_lost(outer) == "gloo: Read error [10.0.0.2]:4000: Connection reset by peer."


def _hung_peer_rank(rank: int, init_file: str, out) -> None:
    from datetime import timedelta
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=2))
    t = torch.ones(4)
    dist.all_reduce(t)  # both alive: works
    if rank == 1:
        time.sleep(8)  # stops answering (a SIGSTOPped rank), then leaves
        out.put(("slept", None))
        return
    try:
        dist.all_reduce(t)
        out.put(("no error", None))
    except Exception as exc:  # noqa: BLE001 - the error under test
        out.put((type(exc).__name__, peer_lost(exc)))


def test_gloo_timing_out_on_a_peer_that_stopped_answering_is_a_peer_loss(tmp_path, start_ranks):
    """gloo's own timeout of a collective (a plain RuntimeError, not a DistBackendError) is "a rank is
    gone or hung", not the rank's own error: a SIGSTOPped rank in the chaos soak was reported so."""
    procs, out = start_ranks(_hung_peer_rank, str(tmp_path / "init"))
    results = [out.get(timeout=120) for _ in range(2)]
    for p in procs:
        p.join(timeout=30)
    name, what = next(r for r in results if r[0] != "slept")
    assert what is not None and what.startswith("timed out: "), (name, what)
    assert "Timed out" in what and "[" not in what, what  # gloo's source prefix left out


def test_a_timeout_of_the_rank_itself_is_not():
    assert peer_lost(RuntimeError("Timeout waiting for the tokenizer download")) is None
    assert peer_lost(TimeoutError("timed out")) is None
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                        "Timed out waiting 15000ms for recv operation to complete")
    assert peer_lost(gloo) == "timed out: Timed out waiting 15000ms for recv operation to complete"
