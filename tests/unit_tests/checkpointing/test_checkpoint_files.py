"""Single-process tests of the file-level pieces: retention, trackers, manifests, retries, names."""

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from tierstack.checkpointing import listing
from tierstack.checkpointing import manifest, paths, retention, retry


def _global_ckpt(root, step, run_id="runA", payload=b"x" * 100):
    d = root / paths.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(payload)
    # the layout of megatron-core 0.16 (legacy, still read): common state in common.pt, embedding the TrainState
    torch.save({"train_state": {"step": step}}, d / "common.pt")
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                 "common_backend": "torch", "common_backend_version": 1}))
    man = manifest.build_manifest(
        tier="global", step=step, run_id=run_id, topology={"world_size": 2},
        train_state={"step": step, "consumed_train_samples": step * 4},
        files=manifest.describe_files(d, manifest.list_files(d)),
    )
    manifest.write_manifest(d / paths.MANIFEST, man)
    return d


# ------------------------------------------------------------------ retention
def test_steps_sort_numerically():
    assert paths.sorted_steps([1000, 999, 20]) == [20, 999, 1000]
    assert paths.parse_step_dir("iter_0001000") == 1000
    assert paths.parse_step_dir("iter_10000000") == 10000000


def test_retention_keeps_k_newest_and_never_newer_than_published():
    assert retention.steps_to_delete([10, 20, 30], published=30, k=2) == [10]
    assert retention.steps_to_delete([999, 1000, 1001], published=1001, k=2) == [999]
    # a run resumed at 20 with ckpt_step leaves 30 (newer) alone
    assert retention.steps_to_delete([10, 20, 30], published=20, k=1) == [10]
    assert retention.steps_to_delete([10, 20, 30], published=30, k=-1) == []


def test_prune_global_leaves_other_runs_and_staging(tmp_path, monkeypatch):
    for s in (999, 1000, 1001):
        _global_ckpt(tmp_path, s)
    foreign = _global_ckpt(tmp_path, 5, run_id="runB")
    staging = tmp_path / paths.staging_dir_name(998, "runA", 1)
    staging.mkdir()
    renames, real_rename = [], Path.rename
    monkeypatch.setattr(Path, "rename", lambda self, target: renames.append((self.name, Path(target).name))
                        or real_rename(self, target))
    deleted = retention.prune_global(tmp_path, "runA", published=1001, k=2)
    assert deleted == [999]
    # renamed out of the candidates in one step before its files go
    assert renames == [("iter_0000999", paths.deleting_dir_name(999, "runA"))]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["iter_0001000", "iter_0001001", foreign.name, staging.name]
    )


def test_prune_local_keeps_k(tmp_path):
    rank_dir = tmp_path / "0"
    rank_dir.mkdir()
    for s in (10, 20, 30):
        (rank_dir / paths.local_file_name(s, 0)).write_bytes(b"data")
        paths.atomic_write_json(rank_dir / paths.local_manifest_name(s, 0), {"run_id": "runA"})
    (rank_dir / paths.local_file_name(5, 0)).write_bytes(b"other run")
    paths.atomic_write_json(rank_dir / paths.local_manifest_name(5, 0), {"run_id": "runB"})
    assert retention.prune_local(rank_dir, 0, "runA", published=30, k=2) == [10]
    left = sorted(p.name for p in rank_dir.iterdir() if p.suffix == ".pt")
    assert left == [paths.local_file_name(s, 0) for s in (5, 20, 30)]


# ------------------------------------------------------------------ trackers
def test_atomic_write_replaces_whole_file_and_leaves_no_temp(tmp_path):
    tracker = tmp_path / paths.TRACKER_ITERATION
    paths.atomic_write_text(tracker, "10\n")
    paths.atomic_write_text(tracker, "20\n")
    assert tracker.read_text() == "20\n"
    assert [p.name for p in tmp_path.iterdir()] == [paths.TRACKER_ITERATION]


def test_atomic_write_failure_keeps_old_content(tmp_path, monkeypatch):
    tracker = tmp_path / paths.TRACKER_ITERATION
    paths.atomic_write_text(tracker, "10\n")

    def broken_replace(src, dst):
        raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        paths.atomic_write_text(tracker, "20\n")
    assert tracker.read_text() == "10\n"


# ------------------------------------------------------------------ manifests
def test_manifest_detects_truncated_and_corrupted_files(tmp_path):
    d = _global_ckpt(tmp_path, 20)
    man = paths.read_json(d / paths.MANIFEST)
    assert manifest.check_manifest(man, step=20) is None
    assert manifest.check_files(d, man["files"]) is None
    shard = d / "__0_0.distcp"
    shard.write_bytes(b"x" * 50)  # truncated
    assert manifest.check_files(d, man["files"]).startswith("size-mismatch")
    shard.write_bytes(b"y" * 100)  # same size, other bytes
    assert manifest.check_files(d, man["files"], checksums=False) is None
    assert manifest.check_files(d, man["files"]).startswith("checksum-mismatch")
    shard.unlink()
    assert manifest.check_files(d, man["files"]).startswith("missing-file")


def test_manifest_header_checks():
    man = {"format_version": paths.FORMAT_VERSION, "step": 3, "run_id": "a", "files": {},
           "train_state": {}, "topology": {"tp": 2}}
    assert manifest.check_manifest(None) == "no-manifest"
    assert manifest.check_manifest(man, step=4).startswith("step-mismatch")
    assert manifest.check_manifest(man, run_id="b") == "other-run"
    assert manifest.check_manifest(man, topology={"tp": 1}) == "topology-changed"


def test_inspect_verify_reports_invalid(tmp_path):
    _global_ckpt(tmp_path, 10)
    d = _global_ckpt(tmp_path, 20)
    text, status = listing.verify(str(tmp_path))
    assert status == 0 and "2 checkpoint(s), 0 invalid" in text
    data = bytearray((d / "common.pt").read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed
    (d / "common.pt").write_bytes(bytes(data))
    text, status = listing.verify(str(tmp_path))
    assert status == 1 and "checksum-mismatch common.pt" in text
    assert listing.ls(str(tmp_path))[1] == 0  # sizes still match
    assert listing.ls(str(tmp_path / "missing"))[1] == 2


# ------------------------------------------------------------------ names
def test_staging_and_quarantined_names_are_never_candidates(tmp_path):
    assert paths.parse_step_dir(paths.staging_dir_name(20, "runA", 1)) is None
    d = _global_ckpt(tmp_path, 20)
    moved = paths.quarantine(d, "checksum-mismatch common.pt")
    assert moved.name.startswith("iter_0000020.invalid-checksum-mismatch")
    assert paths.parse_step_dir(moved.name) is None
    assert paths.parse_local_file("iter_0000020_0_local.dirty.pt") is None
    assert paths.parse_local_file("iter_0000020_0_local.pt.invalid-x") is None
    assert paths.parse_local_file("iter_0000020_1_local.pt") == (20, 1)


def test_run_file_roundtrip(tmp_path):
    assert paths.read_run_file(tmp_path) is None
    paths.write_run_file(tmp_path, "abc")
    info = paths.read_run_file(tmp_path)
    assert info["run_id"] == "abc" and json.loads((tmp_path / paths.RUN_FILE).read_text())["run_id"] == "abc"


# ------------------------------------------------------------------ retries
@pytest.mark.parametrize("code", sorted(retry.TRANSIENT_ERRNOS))
def test_transient_errnos_are_retried(code):
    calls = []

    def attempt(n):
        calls.append(n)
        if n < 3:
            raise OSError(code, os.strerror(code))
        return "ok"

    failed = []
    out = retry.run_attempts(attempt, attempts=3, backoff_s=0.01, sleep=lambda s: None,
                             on_failure=lambda n, e: failed.append(n))
    assert out == "ok" and calls == [1, 2, 3] and failed == [1, 2]


@pytest.mark.parametrize("exc", [OSError(errno.EACCES, "x"), OSError(errno.EROFS, "x"),
                                 OSError(errno.ENOSPC, "x"), TypeError("bug")])
def test_permanent_errors_are_not_retried(exc):
    calls = []

    def attempt(n):
        calls.append(n)
        raise exc

    with pytest.raises(retry.SaveAttemptFailed) as info:
        retry.run_attempts(attempt, attempts=5, backoff_s=0.01, sleep=lambda s: None)
    assert calls == [1] and not info.value.transient


def test_retries_stop_after_attempts_and_back_off_exponentially():
    sleeps = []

    def attempt(n):
        raise OSError(errno.EIO, "flaky disk")

    with pytest.raises(retry.SaveAttemptFailed) as info:
        retry.run_attempts(attempt, attempts=4, backoff_s=1.0, sleep=sleeps.append)
    assert info.value.transient and sleeps == [1.0, 2.0, 4.0]


def test_decision_is_collective():
    """A rank whose own attempt succeeded still fails (and retries) when another rank failed."""
    worst = {"value": retry.TRANSIENT}  # what "the other rank" reports in the all-reduce
    calls = []

    def reduce_max(v):
        out = max(v, worst["value"])
        worst["value"] = retry.OK  # the other rank succeeds on the retry
        return out

    out = retry.run_attempts(lambda n: calls.append(n) or n, attempts=3, backoff_s=0.0,
                             sleep=lambda s: None, reduce_max=reduce_max)
    assert calls == [1, 2] and out == 2


def test_wrapped_causes_are_classified():
    try:
        try:
            raise OSError(errno.ESTALE, "stale handle")
        except OSError as inner:
            raise RuntimeError("write failed") from inner
    except RuntimeError as outer:
        assert retry.classify(outer) == retry.TRANSIENT
    assert retry.classify(None) == retry.OK


def test_verify_lists_leftovers_apart_and_fails_only_on_damaged_published(tmp_path):
    _global_ckpt(tmp_path, 10)
    (tmp_path / paths.staging_dir_name(20, "runA", 1)).mkdir()  # a save killed mid-write
    paths.quarantine(_global_ckpt(tmp_path, 5), "checksum-mismatch")
    text, status = listing.verify(str(tmp_path))
    assert status == 0, text
    assert "leftover" in text and "quarantined" in text and "1 checkpoint(s), 0 invalid" in text


@pytest.mark.parametrize("where", ["manifest", "embedded"])
def test_step_disagreement_is_damage(tmp_path, where):
    d = _global_ckpt(tmp_path, 30)
    if where == "manifest":
        man = json.loads((d / paths.MANIFEST).read_text())
        man["train_state"]["step"] = 29
        manifest.write_manifest(d / paths.MANIFEST, man)
    else:  # the TrainState inside the checkpoint names another step; the manifest matches the file
        torch.save({"train_state": {"step": 31}}, d / "common.pt")
        man = json.loads((d / paths.MANIFEST).read_text())
        man["files"] = manifest.describe_files(d, manifest.list_files(d))
        manifest.write_manifest(d / paths.MANIFEST, man)
    text, status = listing.verify(str(tmp_path))
    assert status == 1 and "step-mismatch" in text, text


def test_leftovers_of_this_run_are_removed_and_another_runs_staging_is_kept(tmp_path):
    """What the next save of a tier removes (issue 10): its own staging directories, .dirty files and
    temp files of other processes; never a checkpoint, nor another run's staging (maybe in progress)."""
    keep = [_global_ckpt(tmp_path, 10).name, paths.staging_dir_name(30, "runB", 1), paths.deleting_dir_name(5, "runB"),
            f".latest_checkpointed_iteration.txt.tmp-{os.getpid()}"]  # this process's own write in progress
    gone = [paths.staging_dir_name(20, "runA", 1), "iter_0000020_0_local.dirty.pt", ".run.json.tmp-999999",
            paths.deleting_dir_name(7, "runA")]  # a retention deletion a crash interrupted
    for name in keep[1:] + gone:
        (tmp_path / name).mkdir() if "staging" in name or "deleting" in name else (tmp_path / name).write_bytes(b"x")
    removed = paths.remove_leftovers(tmp_path, "runA")
    assert sorted(p.name for p in removed) == sorted(gone)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)


def _with_records(d, records):
    man = json.loads((d / paths.MANIFEST).read_text())
    man["train_state"]["best_checkpoints"] = records
    manifest.write_manifest(d / paths.MANIFEST, man)


def test_ls_marks_best_and_top_k_and_verify_checks_trackers_records_and_directories(tmp_path):
    from tierstack.checkpointing.best import TRACKER_BEST

    for step, records in ((10, [[10, 2.5]]), (20, [[20, 2.0], [10, 2.5]]), (30, [[20, 2.0], [10, 2.5]])):
        _with_records(_global_ckpt(tmp_path, step), records)
    (tmp_path / paths.TRACKER_ITERATION).write_text("30\n")
    (tmp_path / TRACKER_BEST).write_text("20\n")
    text, status = listing.ls(str(tmp_path))
    assert status == 0 and "tracker: best step 20" in text
    rows = {line.split()[1]: line.split() for line in text.splitlines() if line.startswith("global")}
    assert rows["20"][6:8] == ["2.0000", "best"] and rows["10"][6:8] == ["2.5000", "top-k"]
    assert rows["30"][6] == "-" and rows["30"][7] != "best"
    assert listing.verify(str(tmp_path))[1] == 0
    (tmp_path / TRACKER_BEST).write_text("10\n")  # the tracker disagrees with the records
    text, status = listing.verify(str(tmp_path))
    assert status == 1 and f"DISAGREE: {TRACKER_BEST} names 10, the records' best is step 20" in text
    (tmp_path / TRACKER_BEST).write_text("20\n")
    import shutil

    shutil.rmtree(tmp_path / "iter_0000010")  # a record without its directory
    text, status = listing.verify(str(tmp_path))
    assert status == 1 and "DISAGREE: best record step 10 has no valid checkpoint directory" in text
    (tmp_path / paths.TRACKER_ITERATION).write_text("40\n")  # a tracker naming no checkpoint
    text, status = listing.verify(str(tmp_path))
    assert status == 1 and "DISAGREE: latest_checkpointed_iteration.txt names '40', which is not a valid" in text


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("n_files", [0, 1, 5, 16, 37])
def test_the_ranks_verification_shares_cover_every_file_exactly_once(world_size, n_files):
    names = [f"__{i}_0.distcp" for i in range(n_files)] + ["common.pt", "metadata.json"]
    shares = [manifest.share(reversed(names), r, world_size) for r in range(world_size)]  # order of the manifest: any
    flat = [n for s in shares for n in s]
    assert sorted(flat) == sorted(names)  # every file, none twice
    assert max(map(len, shares)) - min(map(len, shares)) <= 1  # balanced
    with pytest.raises(ValueError, match="rank 2 is not one of 2 ranks"):
        manifest.share(names, 2, 2)
