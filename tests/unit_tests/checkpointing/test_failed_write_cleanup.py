"""Failed writes on real files, single process: a cleanup error never escapes a LOCAL save, and a
failed atomic write leaves no temp file (issue 17, defects 1 and 2)."""

import time

import pytest

from tierstack.checkpointing import paths
from tierstack.checkpointing.local_tier import LocalTier, _InFlight
from tierstack.config import CheckpointConfig
from tierstack.data import checks
from tierstack.runtime import ParallelLayout

LAYOUT = ParallelLayout(rank=0, world_size=1, local_rank=0, tensor_model_parallel_size=1,
                        pipeline_model_parallel_size=1, data_parallel_size=1, tensor_model_parallel_rank=0,
                        pipeline_model_parallel_rank=0, data_parallel_rank=0)


def _blocked(path):
    """Make ``path`` a non-empty directory: unlinking or renaming over it fails (EISDIR), as on EIO/EROFS."""
    path.mkdir(parents=True)
    (path / "x").write_text("x")


@pytest.mark.parametrize("blocked", ["manifest", "file"])
def test_a_failed_cleanup_of_a_failed_local_attempt_is_a_failed_save_not_a_crash(tmp_path, caplog, blocked):
    tier = LocalTier(CheckpointConfig(load=str(tmp_path / "g"), local_dir=str(tmp_path / "local"),
                                      save_retries=2, retry_backoff_s=0.0), LAYOUT)
    try:
        ckpt, man = tier._paths(20)
        _blocked(man if blocked == "manifest" else ckpt)
        job = tier._stager.submit(tier._write_and_seal, 20, "runA", {"step": 20}, b"", [], {})
        tier._in_flight = _InFlight(20, "runA", time.perf_counter(), 0.0, job)
        tier.finalize(blocking=True)  # before the fix: the raw IsADirectoryError of the cleanup escaped here
        assert tier.failures == [20] and tier.sealed == []
        assert "LOCAL checkpoint of step 20 NOT saved (permanent failure rank 0: EISDIR" in caplog.text
        assert "LOCAL files of failed step 20 on rank 0 not removed: EISDIR" in caplog.text
        assert [c for c in tier.candidates("runA") if c.problem is None] == []  # no valid checkpoint of it
    finally:
        tier.close()


def test_a_failed_atomic_write_leaves_no_temp_file(tmp_path):
    _blocked(tmp_path / "tracker.txt")
    with pytest.raises(IsADirectoryError):
        paths.atomic_write_text(tmp_path / "tracker.txt", "20\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tracker.txt"]


def test_a_failed_data_sidecar_write_leaves_no_temp_file(tmp_path):
    _blocked(tmp_path / "byte.json")
    with pytest.raises(IsADirectoryError):
        checks._replace_text(tmp_path / "byte.json", "{}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["byte.json"]
