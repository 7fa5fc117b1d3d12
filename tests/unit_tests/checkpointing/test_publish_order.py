"""Publishing a GLOBAL step, on real files: the trackers name the step only after its directory
has its final name (a tracker committed first would name a step a crash leaves unpublished)."""

import os

import pytest

from tierstack.checkpointing import best, paths, publish


def _staging(root, step):
    staging = root / f"{paths.step_dir_name(step)}.staging-r1-1"
    staging.mkdir(parents=True)
    (staging / paths.MANIFEST).write_text('{"run_id": "r1"}')
    return staging


def test_the_trackers_are_committed_only_after_the_directory_rename(tmp_path, monkeypatch):
    root = tmp_path
    publish.publish_step(root, 10, _staging(root, 10), {"step": 10, "best_checkpoints": []}, "r1")
    trackers = {root / paths.TRACKER_ITERATION, root / paths.TRACKER_TRAIN_STATE, root / best.TRACKER_BEST}
    final = root / paths.step_dir_name(20)
    events = []
    real_rename, real_replace = os.rename, os.replace

    def record(kind, real):
        def move(src, dst, *a, **kw):
            dst = type(root)(dst)
            if dst == final:
                events.append("directory")
            elif dst in trackers:
                events.append(dst.name)
                assert final.is_dir(), f"{dst.name} committed before {final.name} exists"
            return real(src, dst, *a, **kw)
        return move

    monkeypatch.setattr(os, "rename", record("rename", real_rename))
    monkeypatch.setattr(os, "replace", record("replace", real_replace))
    publish.publish_step(root, 20, _staging(root, 20), {"step": 20, "best_checkpoints": [[20, 1.0]]}, "r1")
    assert events[0] == "directory" and sorted(events[1:]) == sorted(p.name for p in trackers)
    assert (root / paths.TRACKER_ITERATION).read_text() == "20\n" and (root / best.TRACKER_BEST).read_text() == "20\n"


def test_a_failed_rename_leaves_the_trackers_naming_the_previous_step(tmp_path, monkeypatch):
    root = tmp_path
    publish.publish_step(root, 10, _staging(root, 10), {"step": 10}, "r1")
    staging = _staging(root, 20)
    real_rename = os.rename

    def failing(src, dst, *a, **kw):
        if type(root)(dst) == root / paths.step_dir_name(20):
            raise OSError(28, "No space left on device")
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError):
        publish.publish_step(root, 20, staging, {"step": 20}, "r1")
    assert (root / paths.TRACKER_ITERATION).read_text() == "10\n" and staging.is_dir()
    assert not list(root.glob(".*.tmp-*"))  # no temp tracker left behind
