"""A file system that holds ``most_recent_k`` checkpoints but not one more: before the fix every
later save failed with ENOSPC (retention removes old checkpoints only after a save seals), so the
newest LOCAL step stayed where the disk filled up for the rest of the run. Real tiers write real
files; only the file system's capacity is emulated (``shutil.disk_usage`` answers capacity minus
the bytes under the test's directory), since a test cannot mount a small file system.

End to end on a real 100 MB tmpfs (README, "A full disk"): 2 ranks, a LOCAL step every 3
iterations, 19 MB per rank and step, most_recent_k=2: steps 9 to 24 all failed with ENOSPC before,
all sealed after; the same with GLOBAL (39 MB per step) on that tmpfs.
"""

import errno
import json
import logging
import os
import time
from collections import namedtuple

import pytest
import torch

from tierstack.checkpointing import local_file, manifest, paths, retention
from tierstack.checkpointing.local_tier import LocalTier, _InFlight
from tierstack.config import CheckpointConfig
from tests.unit_tests.checkpointing.test_failed_write_cleanup import LAYOUT

STEP_BYTES = 1 << 20  # one buffer of 1 MiB per LOCAL step


@pytest.fixture
def capacity(tmp_path, monkeypatch):
    """Emulates a file system of ``capacity.bytes`` holding ``tmp_path``: free = capacity - the bytes
    of every file under ``tmp_path`` (set ``capacity.bytes`` before the saves), and a LOCAL file
    write that does not fit fails with ENOSPC, as on a full disk."""
    usage = namedtuple("usage", "total used free")
    real_write = local_file.write

    class Capacity:
        bytes = 0

        def __call__(self, path):
            used = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
            return usage(self.bytes, used, max(0, self.bytes - used))

        def write(self, path, header, buffers):
            if len(header) + sum(b.nbytes for b in buffers) > self(path).free:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real_write(path, header, buffers)

    cap = Capacity()
    monkeypatch.setattr(retention.shutil, "disk_usage", cap)
    monkeypatch.setattr(local_file, "write", cap.write)
    monkeypatch.setattr(retention, "_made_room", set())
    monkeypatch.setattr(retention, "_global_need", {})
    return cap


def _local_save(tier: LocalTier, step: int) -> None:
    """One LOCAL file save of ``step`` through the tier's writer thread and finalize (sealed or failed)."""
    buffers = [torch.full((STEP_BYTES // 4,), float(step))]
    room = tier._room_plan(step, "runA", 6 + STEP_BYTES)  # what LocalTier.save decides before the hand-off
    job = tier._stager.submit(tier._write_and_seal, step, "runA", {"step": step}, b"header", buffers, {}, room)
    tier._in_flight = _InFlight(step, "runA", time.perf_counter(), 0.0, job)
    tier.finalize(blocking=True)
    tier.release_retention(None)
    tier.wait_retention()


def _own_steps(tier: LocalTier) -> list[int]:
    return retention.own_local_steps(tier.rank_dir, 0, "runA")


def test_a_local_disk_with_room_for_k_steps_keeps_saving_by_removing_the_oldest_first(tmp_path, capacity, caplog):
    caplog.set_level(logging.INFO)
    tier = LocalTier(CheckpointConfig(local_dir=str(tmp_path / "local"), most_recent_k=2), LAYOUT)
    try:
        capacity.bytes = int(2.5 * STEP_BYTES)  # k=2 steps fit, a third one does not
        _local_save(tier, 3)
        _local_save(tier, 6)
        assert _own_steps(tier) == [3, 6]
        for step in (9, 12):
            _local_save(tier, step)
            assert tier.sealed[-1] == step and tier.failures == []
        assert _own_steps(tier) == [9, 12]
        removals = [r for r in caplog.records if "to make room" in r.getMessage()]
        assert ["step 3 to make room" in removals[0].getMessage(), "step 6 to make room" in removals[1].getMessage()] \
            == [True, True] and len(removals) == 2
        assert [r.levelno for r in removals] == [logging.WARNING, logging.INFO]  # the first one in a directory warns
    finally:
        tier.close()


def _quarantine_pair(rank_dir, step, run_id, nbytes):
    """A LOCAL file and its manifest of ``run_id`` quarantined together, as resume selection does."""
    f = rank_dir / f"{paths.local_file_name(step, 0)}.invalid-damaged"
    f.write_bytes(b"q" * nbytes)
    (rank_dir / f"{paths.local_manifest_name(step, 0)}.invalid-damaged").write_text(json.dumps({"run_id": run_id}))
    return f


def test_quarantined_files_of_this_run_give_way_when_no_older_step_is_left_and_another_runs_never(
        tmp_path, capacity, caplog):
    tier = LocalTier(CheckpointConfig(local_dir=str(tmp_path / "local"), most_recent_k=2), LAYOUT)
    try:
        mine, theirs = STEP_BYTES * 6 // 10, STEP_BYTES // 10
        capacity.bytes = int(1.5 * STEP_BYTES) + mine + theirs + 8192
        _local_save(tier, 3)
        q_mine = _quarantine_pair(tier.rank_dir, 1, "runA", mine)
        q_theirs = _quarantine_pair(tier.rank_dir, 2, "another-run", theirs)
        by_hand = tier.rank_dir / "iter_0000002_0_local.pt.invalid-byhand"  # no manifest: its run is unknown
        by_hand.write_bytes(b"h")
        _local_save(tier, 6)  # step 3 is the newest sealed: only this run's quarantined file can give way
        assert tier.failures == [] and _own_steps(tier) == [3, 6]
        assert not q_mine.exists() and q_theirs.exists() and by_hand.exists()
        assert f"removing quarantined {q_mine} to make room" in caplog.text
    finally:
        tier.close()


@pytest.mark.parametrize("k", [2, -1])
def test_the_newest_sealed_step_is_never_removed_and_keep_all_removes_nothing(tmp_path, capacity, caplog, k):
    """No room even for one more step: the newest sealed step is kept and the save fails, said as any
    failed save; with most_recent_k=-1 the user asked for every step: nothing of the run is removed."""
    tier = LocalTier(CheckpointConfig(local_dir=str(tmp_path / "local"), most_recent_k=k), LAYOUT)
    try:
        capacity.bytes = 10 * STEP_BYTES
        _local_save(tier, 3)
        _local_save(tier, 6)
        (tmp_path / "someone-else").write_bytes(b"x" * (STEP_BYTES * 17 // 2))  # another user fills the disk
        caplog.clear()
        _local_save(tier, 9)
        assert _own_steps(tier) == ([6] if k == 2 else [3, 6])  # the newest sealed step, or every step, kept
        assert "nothing this save may remove is left: the write will likely fail (ENOSPC)" in caplog.text
        assert tier.failures == [9] and "LOCAL checkpoint of step 9 NOT saved" in caplog.text
    finally:
        tier.close()


def _published(root, step, run_id="runA", nbytes=STEP_BYTES):
    d = root / paths.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * nbytes)
    man = manifest.build_manifest(tier="global", step=step, run_id=run_id, topology={"world_size": 1},
                                  train_state={"step": step}, files=manifest.describe_files(d, ["__0_0.distcp"]))
    manifest.write_manifest(d / paths.MANIFEST, man)


def test_a_full_global_file_system_gives_up_the_oldest_unprotected_checkpoint_of_the_run(tmp_path, capacity):
    root = tmp_path / "global"
    for step in (10, 20, 30, 40):
        _published(root, step)
    _published(root, 5, run_id="another-run")
    _published(root, 3, run_id="another-run")
    theirs = paths.quarantine(root / paths.step_dir_name(3), "damaged")  # another run's quarantined step: kept
    capacity.bytes = int(6.5 * STEP_BYTES)  # 0.5 MiB free: the next checkpoint (1 MiB) does not fit
    removed = retention.make_room_global(root, "runA", 50, k=4, protected={10})
    assert removed == [f"GLOBAL checkpoint {root / paths.step_dir_name(20)}"]  # 10 is a best record, 40 newest
    assert sorted(retention.own_global_steps(root, "runA")) == [10, 30, 40]
    assert retention.own_global_steps(root, "another-run") and theirs.exists()  # another run's: never touched
    assert retention.make_room_global(root, "runA", 50, k=4, protected={10}) == []  # room now: nothing more
    capacity.bytes = int(5.2 * STEP_BYTES)
    assert retention.make_room_global(root, "runA", 50, k=-1, protected=()) == []  # keep all: never
    assert sorted(retention.own_global_steps(root, "runA")) == [10, 30, 40]


def _two_rank_worker(rank, root, store, out):
    """A rank of :func:`test_every_rank_removes_the_same_steps_when_one_rank_is_short`: rank 0's file
    system reports no room once it holds 2 steps, rank 1's always has room."""
    import torch.distributed as dist

    from tierstack.runtime import ParallelLayout

    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        layout = ParallelLayout(rank=rank, world_size=2, local_rank=rank, tensor_model_parallel_size=1,
                                pipeline_model_parallel_size=1, data_parallel_size=2, tensor_model_parallel_rank=0,
                                pipeline_model_parallel_rank=0, data_parallel_rank=rank)
        usage = namedtuple("usage", "total used free")

        def disk_usage(path):
            files = len(list((root / "local" / "0").glob("iter_*_local.pt"))) if rank == 0 else 0
            return usage(1 << 40, 0, 0 if files >= 2 else 1 << 40)

        retention.shutil.disk_usage = disk_usage
        tier = LocalTier(CheckpointConfig(local_dir=str(root / "local"), most_recent_k=3), layout)
        for step in (3, 6, 9):
            _local_save(tier, step)
        out.put((rank, retention.own_local_steps(tier.rank_dir, rank, "runA"), tier.sealed))
        tier.close()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, repr(e), None))


def test_every_rank_removes_the_same_steps_when_one_rank_is_short(tmp_path, start_ranks):
    """2 real ranks (gloo): only rank 0 is short of room at step 9, yet both remove step 3, so no
    step is left on one rank only (a helper's break-it pass: each rank deciding on its own free space
    left rank 1's copy of a removed step, and ``checkpoints verify`` exited 1 for it). With
    most_recent_k=3 retention alone would keep step 3 on both."""
    procs, out = start_ranks(_two_rank_worker, tmp_path, tmp_path / "store")
    results = dict((r, (steps, sealed)) for r, steps, sealed in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=30)
    assert results[0] == ([6, 9], [3, 6, 9]) and results[1] == ([6, 9], [3, 6, 9]), results
