"""Issue 25: a GLOBAL write spends no time of its own on the checksum or the non-finite check. Each
file is checksummed while its fsync runs, and the check of the staged buffers runs beside the write,
yet no write result is reported before its file is durable and a non-finite state is never sealed
(real megatron-core write plan, real files; os.fsync slowed by a wrapper to make the overlap visible)."""

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from tierstack.checkpointing import global_writer, manifest
from tierstack.checkpointing.nonfinite_guard import NonFiniteStateError, check_staged

FSYNC_S = 0.4  # the slowed fsync of a data file


def _plan(path: Path, value: float = 1.0):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    path.mkdir(parents=True)
    global_writer.start_results_channel(fresh=True)
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.full((1 << 16,), value))}
    return dist_checkpointing.save(sd, str(path), async_sharded_save=True, async_strategy="mcore")


@pytest.fixture
def events(monkeypatch):
    """(what, path or name, perf_counter) of every fsync's start and end and every checksum's start."""
    out: list[tuple[str, str, float]] = []
    real_fsync, real_checksum = os.fsync, manifest.checksum_file

    def fsync(fd):
        path = os.path.realpath(f"/proc/self/fd/{fd}")
        out.append(("fsync start", path, time.perf_counter()))
        time.sleep(FSYNC_S)
        real_fsync(fd)
        out.append(("fsync end", path, time.perf_counter()))

    def checksum(path, *a, **k):
        out.append(("checksum start", str(Path(path).resolve()), time.perf_counter()))
        return real_checksum(path, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(manifest, "checksum_file", checksum)
    yield out
    global_writer.shutdown_results_channel()


def test_each_file_is_checksummed_while_its_fsync_runs_and_reported_after_it(gloo_group, tmp_path, events):
    staging = tmp_path / "iter_0000001.staging-r1-1"
    request = _plan(staging)
    results = request.async_fn_args[2]
    entries = global_writer.write_request(request, staging, attempts=1, backoff_s=0.0)

    (name,) = entries  # one file per rank (megatron's thread_count 1)
    path = str((staging / name).resolve())
    during = [(w, t) for w, p, t in events if p == path]
    assert [w for w, _ in during].count("checksum start") == 1  # once: no read-back pass after the write
    start = dict(during)
    assert set(start) == {"fsync start", "fsync end", "checksum start"}
    # the checksum ran inside the fsync's window, not after it
    assert start["fsync start"] - 0.05 <= start["checksum start"] < start["fsync end"]
    assert entries == manifest.describe_files(staging, [name])  # the entry is the file's own checksum
    assert not results.empty()  # the write result, reported once the file was durable
    for fn in request.finalize_fns:
        fn()


def test_the_nonfinite_check_runs_beside_the_write_and_still_blocks_the_save(gloo_group, tmp_path, events):
    staging = tmp_path / "iter_0000002.staging-r1-1"
    request = _plan(staging)
    results = request.async_fn_args[2]
    buffers = [torch.tensor([1.0, float("nan")])]
    checked = threading.Event()

    def check():
        checked.set()
        check_staged(buffers, "GLOBAL checkpoint of step 2")

    t0 = time.perf_counter()
    with pytest.raises(NonFiniteStateError, match="step 2: non-finite"):
        global_writer.write_request(request, staging, attempts=1, backoff_s=0.0, check=check)
    assert checked.is_set()
    assert results.empty()  # megatron's finalize never sees a result of a non-finite state
    assert time.perf_counter() - t0 >= FSYNC_S  # the check did not stop the write: they ran side by side


def test_a_failed_fsync_is_the_files_write_error(gloo_group, tmp_path, monkeypatch):
    """The fsync now runs in our wrapper: its error must reach the save as the file's error (with the
    errno that decides a retry), not be lost on a thread."""
    import errno

    staging = tmp_path / "iter_0000003.staging-r1-1"
    request = _plan(staging)

    def fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        with pytest.raises(OSError) as info:
            global_writer.write_request(request, staging, attempts=1, backoff_s=0.0)
    finally:
        global_writer.shutdown_results_channel()
    assert info.value.errno == errno.EIO
    assert request.async_fn_args[2].empty()


def test_early_writeback_hands_the_file_to_the_disk_while_it_is_written(tmp_path):
    """The write-out is started repeatedly during the write (sync_file_range succeeds on this file
    system), the file's bytes are the writer's, and a file that never appears is no error."""
    from tierstack.checkpointing import writeback

    path = tmp_path / "shard.distcp"
    chunk = os.urandom(1 << 20)
    with writeback.EarlyWriteback(path, interval_s=0.01) as wb:
        time.sleep(0.05)  # the file does not exist yet: the thread waits for it
        with open(path, "wb") as f:
            for _ in range(32):
                f.write(chunk)
                f.flush()
                time.sleep(0.01)
            during = wb.calls
            os.fsync(f.fileno())
    assert during >= 5
    assert path.read_bytes() == chunk * 32
    with writeback.EarlyWriteback(tmp_path / "never", interval_s=0.01) as wb:
        time.sleep(0.05)
    assert wb.calls == 0
