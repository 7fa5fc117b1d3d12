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
    job = tier._stager.submit(tier._write_and_seal, step, "runA", {"step": step}, b"header",
                              [torch.full((STEP_BYTES // 4,), float(step))], {})
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
        quarantined = tier.rank_dir / (paths.local_file_name(1, 0) + ".invalid-damaged")
        _local_save(tier, 3)
        quarantined.write_bytes(b"q" * 1000)
        _local_save(tier, 6)
        assert _own_steps(tier) == [3, 6]
        for step in (9, 12):
            _local_save(tier, step)
            assert tier.sealed[-1] == step and tier.failures == []
        assert _own_steps(tier) == [9, 12] and not quarantined.exists()
        warnings = [r.getMessage() for r in caplog.records if "to make room" in r.getMessage()]
        assert "removing quarantined" in warnings[0] and "step 3" in warnings[1] and "step 6" in warnings[2], warnings
        assert [r.levelno for r in caplog.records if "to make room" in r.getMessage()] == [
            logging.WARNING, logging.INFO, logging.INFO]  # the first removal in a directory is the warning
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
    capacity.bytes = int(5.5 * STEP_BYTES)  # 0.5 MiB free: the next checkpoint (1 MiB) does not fit
    removed = retention.make_room_global(root, "runA", 50, k=4, protected={10})
    assert removed == [f"GLOBAL checkpoint {root / paths.step_dir_name(20)}"]  # 10 is a best record, 40 newest
    assert sorted(retention.own_global_steps(root, "runA")) == [10, 30, 40]
    assert retention.own_global_steps(root, "another-run")  # another run's checkpoint is never touched
    assert retention.make_room_global(root, "runA", 50, k=4, protected={10}) == []  # room now: nothing more
    capacity.bytes = int(4.2 * STEP_BYTES)
    assert retention.make_room_global(root, "runA", 50, k=-1, protected=()) == []  # keep all: never
    assert sorted(retention.own_global_steps(root, "runA")) == [10, 30, 40]
