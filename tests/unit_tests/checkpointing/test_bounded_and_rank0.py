"""Issue 10: checkpoint collectives are bounded in time, and megatron-core's rank-0-only writes
fail after its collectives; the GLOBAL writer's results travel through an in-process queue. Real gloo process groups (file store, no port), real megatron-core
``dist_checkpointing.save`` and real files."""

import errno
import multiprocessing as mp
import os
import time

import pytest
import torch

from tierstack.checkpointing import errors, global_writer, rank0_phases, retry
from tierstack.runtime import collectives as _dist


def _prepare_agreement(rank: int):
    """Nothing to set up: the collective is an agreement (:func:`retry.run_agreed`)."""
    return lambda: retry.run_agreed(lambda: None)


def _prepare_replication(rank: int):
    """NVRx creates the clique groups (every rank takes part); the collective is the exchange."""
    from tierstack.checkpointing.replication import Replicator

    replicator = Replicator(factor=2, jump=1, rank=rank, world_size=2)
    replicator.strategy
    return lambda: replicator.replicate(10, {"files": {}}, torch.zeros(16, dtype=torch.uint8))


def _rank_with_an_absent_peer(rank: int, store: str, gone: str, out, prepare) -> None:
    """One of 2 gloo ranks: both run ``prepare`` (bounded at 2 s); then rank 1 stays away while rank 0
    runs the collective ``prepare`` returned, bounded at 2 s, and reports what it raised and when."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        with _dist.bounded(2.0, 600.0):
            collective = prepare(rank)
        if rank == 1:  # the peer that never arrives: waits until rank 0 has given up
            deadline = time.monotonic() + 60
            while not os.path.exists(gone) and time.monotonic() < deadline:
                time.sleep(0.1)
            out.put(("peer", None))
            return
        t0 = time.monotonic()
        try:
            with _dist.bounded(2.0, 600.0):
                collective()
            out.put(("rank0", ("no error", time.monotonic() - t0)))
        except errors.CollectiveFailure as e:
            out.put(("rank0", (type(e).__name__, time.monotonic() - t0)))
        open(gone, "w").close()
    finally:
        torch.distributed.destroy_process_group() if rank == 0 else None


def _rank0_outcome(tmp_path, prepare, timeout: float) -> tuple:
    """Run :func:`_rank_with_an_absent_peer` on 2 spawned ranks: ``(exception name, seconds)`` of rank 0."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_with_an_absent_peer,
                         args=(r, str(tmp_path / "store"), str(tmp_path / "gone"), out, prepare))
             for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return got["rank0"]


def test_agreement_with_a_missing_peer_fails_within_the_collective_timeout(tmp_path):
    """A rank that never enters the agreement makes it fail on the other rank within
    ``checkpoint.collective_timeout_s`` (here 2 s), as CollectiveFailure, not after the 600 s
    training timeout."""
    kind, seconds = _rank0_outcome(tmp_path, _prepare_agreement, timeout=120)
    assert kind == "CollectiveError", (kind, seconds)  # errors.CollectiveFailure is runtime.collectives.CollectiveError
    assert seconds < 30, seconds  # bounded by the 2 s timeout (plus start-up on a loaded machine)


def test_megatron_plan_writes_nothing_on_rank0_and_the_common_state_is_a_shard(gloo_group, tmp_path):
    """megatron-core 0.19 has no rank-0-only write before its planning collectives (0.16 wrote
    ``common.pt`` there, which ``rank0_phases`` had to defer): planning writes no file at all, and the
    common state travels as a shard in the files our writer writes, so its write errors reach every
    rank through the writers' agreement. The checkpoint then reads back, common state included."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict

    global_writer.start_results_channel()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0)), "note": {"step": 7}}
    try:
        request = dist_checkpointing.save(sd, str(ckpt), async_sharded_save=True, async_strategy="mcore")
        assert list(ckpt.iterdir()) == []  # the plan wrote nothing: no rank-0 write to defer
        global_writer.write_request(request, ckpt, attempts=1, backoff_s=0.0)
        for fn in request.finalize_fns:
            fn()
    finally:
        global_writer.shutdown_results_channel()
    assert not (ckpt / "common.pt").exists()
    assert load_common_state_dict(str(ckpt))["note"] == {"step": 7}
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}, str(ckpt))
    assert torch.equal(loaded["w"], torch.arange(8.0))


def test_transient_rank0_metadata_error_reruns_only_the_failed_write(gloo_group, tmp_path):
    """A retried finalize re-runs only rank 0's failed write (``Deferred.rerun``: here
    ``metadata.json``), after which the real megatron checkpoint loads."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rank0_phases.install()
    global_writer.start_results_channel()  # as the GLOBAL tier does before its first save
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}
    real = serialization.save_config.__wrapped__
    fails = [OSError(errno.EIO, "Input/output error", str(ckpt / "metadata.json"))]

    def flaky(config, checkpoint_dir):
        if fails:
            raise fails.pop()
        return real(config, checkpoint_dir)

    saved = serialization.save_config
    serialization.save_config = rank0_phases._deferrable(flaky, "checkpoint config (metadata.json)")
    try:
        request = dist_checkpointing.save(sd, str(ckpt), async_sharded_save=True, async_strategy="mcore")
        global_writer.write_request(request, ckpt, attempts=1, backoff_s=0.0)  # tierstack's writer
        pending = rank0_phases.Deferred()
        with pytest.raises(OSError) as info:
            with rank0_phases.deferring(pending):
                for fn in request.finalize_fns:  # megatron's finalize: .metadata, then metadata.json
                    fn()
        assert errors.classify(info.value) == errors.TRANSIENT and len(pending.calls) == 1
        assert (ckpt / ".metadata").is_file() and not (ckpt / "metadata.json").exists()
        pending.rerun()  # the retry: only metadata.json is written again
        assert not pending.calls and (ckpt / "metadata.json").is_file()
    finally:
        serialization.save_config = saved
        global_writer.shutdown_results_channel()
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}, str(ckpt))
    assert torch.equal(loaded["w"], torch.arange(8.0))


def test_local_replication_with_a_missing_clique_member_fails_within_the_collective_timeout(tmp_path):
    """Issue 9 on issue 10: NVRx's clique groups (created with torch's default timeout of 30 min)
    are bounded like every checkpoint collective: a member that never joins the exchange fails it on
    the other within ``checkpoint.collective_timeout_s`` (here 2 s), as CollectiveError."""
    kind, seconds = _rank0_outcome(tmp_path, _prepare_replication, timeout=150)
    assert kind == "CollectiveError", (kind, seconds)
    assert seconds < 30, seconds


def test_a_torch_dist_save_reports_through_an_in_process_queue_and_starts_no_process(gloo_group, tmp_path):
    """The GLOBAL writer's results reach megatron-core's finalize through an in-process queue: a
    real torch_dist save starts no process, and loads back. megatron-core would serve that queue
    from a spawned multiprocessing Manager: a process per rank importing torch at each start,
    outliving a killed rank, and dying on a job-wide SIGTERM that the rank turns into a planned exit
    whose GLOBAL save still needed it (found by a break-it pass)."""
    import queue

    import psutil
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global_writer.shutdown_results_channel()
    channel = global_writer.start_results_channel()
    assert isinstance(channel, queue.Queue) and global_writer.start_results_channel() is channel
    assert filesystem_async.get_write_results_queue() is channel  # megatron starts no Manager now
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    try:
        request = dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))},
                                          str(ckpt), async_sharded_save=True, async_strategy="mcore")
        assert request.async_fn_args[2] is channel
        global_writer.write_request(request, ckpt, attempts=1, backoff_s=0.0)  # our writer, this process
        for fn in request.finalize_fns:  # megatron's finalize reads the results from the channel
            fn()
        assert channel.empty()
        assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
    finally:
        global_writer.shutdown_results_channel()
    assert filesystem_async._results_queue is None
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}, str(ckpt))
    assert torch.equal(loaded["w"], torch.arange(8.0))
