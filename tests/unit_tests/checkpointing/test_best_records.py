"""Top-K best records (propose, commit) and retention's two protections, on real files."""

import json
import math

import pytest

from tierstack.checkpointing import paths, retention
from tierstack.checkpointing.best import BestRecords, protected_steps, resolve_pretrained, top_k


def test_top_k_orders_lower_first_older_on_ties_and_keeps_one_record_per_step():
    records = [[10, 2.0], [20, 1.5], [30, 1.5], [40, 3.0], [20, 1.4]]
    assert top_k(records, 3) == [[20, 1.4], [30, 1.5], [10, 2.0]]
    assert top_k(records, 0) == []


def test_propose_changes_nothing_and_only_a_top_k_entry_is_a_candidate():
    best = BestRecords(2, save_on_best=True)
    committed = [[4, 1.0], [6, 1.2]]
    assert not best.propose(8, {"val_loss": 1.3}, committed)  # worse than both
    assert best.pending is None and not best.save_requested(8)
    assert not best.propose(8, {"val_loss": math.nan}, committed)  # never a non-finite value
    assert not best.propose(8, {"loss": 0.1}, committed)  # no validation metric this step
    assert best.propose(8, {"val_loss": 1.1}, committed)
    assert committed == [[4, 1.0], [6, 1.2]]  # proposing changed nothing
    assert best.save_requested(8) and not best.save_requested(9)
    assert best.records_for(9, committed) == committed  # another step's save does not commit it
    assert best.records_for(8, committed) == [[4, 1.0], [8, 1.1]]
    best.settle(8)
    assert best.pending is None and best.records_for(8, committed) == committed


def test_off_by_default_and_unknown_metric_refused():
    assert not BestRecords(0).propose(2, {"val_loss": 1.0}, [])
    with pytest.raises(ValueError, match="checkpoint.best_metric='bleu'"):
        BestRecords(1, "bleu")


@pytest.mark.parametrize("k,protected,expected", [
    # Hazard: protecting the best must not delete the newest (resume needs it), and the best
    # itself must never be pruned by most_recent_k: two protections, remove what neither holds.
    (1, {10}, [20, 30]),       # best 10 and the published 40 stay
    (2, {10}, [20]),           # + the most recent older one (30)
    (1, {40}, [10, 20, 30]),   # the published one is also the best
    (1, set(), [10, 20, 30]),
    (-1, {10}, []),
])
def test_retention_removes_only_what_neither_protection_holds(k, protected, expected):
    assert retention.steps_to_delete([10, 20, 30, 40], 40, k, protected) == expected


def _global_dir(root, step, run_id="r1"):
    d = root / paths.step_dir_name(step)
    d.mkdir()
    (d / paths.MANIFEST).write_text(json.dumps({"run_id": run_id}))
    return d


def test_prune_global_keeps_the_best_and_the_latest_on_disk(tmp_path):
    for s in (2, 4, 6, 8, 10):
        _global_dir(tmp_path, s)
    _global_dir(tmp_path, 3, run_id="other")  # another run's: never touched
    train_state = {"best_checkpoints": [[4, 1.0], [6, 1.1]]}
    doomed = retention.prune_global(tmp_path, "r1", 10, 1, protected_steps(train_state))
    assert doomed == [2, 8]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000003", "iter_0000004", "iter_0000006", "iter_0000010"]


def test_pretrained_best_resolves_through_the_tracker(tmp_path):
    _global_dir(tmp_path, 6)
    (tmp_path / "best_checkpointed_iteration.txt").write_text("6\n")
    assert resolve_pretrained(f"{tmp_path}:best") == tmp_path / "iter_0000006"
    assert resolve_pretrained(str(tmp_path)) == tmp_path


def test_publish_writes_the_best_tracker_with_the_latest_ones_and_a_refused_publish_none(tmp_path):
    from tierstack.checkpointing.best import TRACKER_BEST
    from tierstack.checkpointing.publish import publish_step

    staging = tmp_path / paths.staging_dir_name(6, "r1", 1)
    staging.mkdir()
    (staging / paths.MANIFEST).write_text(json.dumps({"run_id": "r1"}))
    publish_step(tmp_path, 6, staging, {"step": 6, "best_checkpoints": [[6, 1.0], [4, 1.5]]}, "r1")
    assert (tmp_path / TRACKER_BEST).read_text() == "6\n"
    assert (tmp_path / paths.TRACKER_ITERATION).read_text() == "6\n"
    _global_dir(tmp_path, 8, run_id="other")  # another run's step 8 is in the way: refused, nothing changes
    staging = tmp_path / paths.staging_dir_name(8, "r1", 1)
    staging.mkdir()
    with pytest.raises(FileExistsError):
        publish_step(tmp_path, 8, staging, {"step": 8, "best_checkpoints": [[8, 0.5]]}, "r1")
    assert (tmp_path / TRACKER_BEST).read_text() == "6\n" and (tmp_path / paths.TRACKER_ITERATION).read_text() == "6\n"


def _objs(records):
    from tierstack.checkpointing import TrainingObjects
    from tierstack.train_state import TrainState

    ts = TrainState()
    ts.best_checkpoints = [list(r) for r in records]
    return TrainingObjects(model=[], optimizer=None, scheduler=None, train_state=ts)


def test_a_best_record_naming_a_deleted_checkpoint_is_reported_once_and_repaired(tmp_path, caplog):
    from tierstack.checkpointing.best import TRACKER_BEST
    from tierstack.checkpointing.resuming import repair_best_records
    from tierstack.config import CheckpointConfig

    for step in (4, 8):
        _global_dir(tmp_path, step)
    (tmp_path / TRACKER_BEST).write_text("6\n")  # step 6, the best, was deleted by hand
    objs = _objs([[6, 1.5], [4, 2.0], [2, 2.5]])
    cfg = CheckpointConfig(save=str(tmp_path), keep_best_k=3)
    with caplog.at_level("WARNING"):
        dropped = repair_best_records(cfg, objs)
    assert dropped == [[6, 1.5], [2, 2.5]]
    assert objs.train_state.best_checkpoints == [[4, 2.0]]
    assert (tmp_path / TRACKER_BEST).read_text() == "4\n"
    for step, value in ((6, 1.5), (2, 2.5)):
        assert caplog.text.count(f"best record step {step} (val_loss {value:g}) names") == 1
    caplog.clear()
    assert repair_best_records(cfg, objs) == [] and "best record" not in caplog.text  # repaired: once


def test_no_best_record_left_removes_the_best_tracker(tmp_path):
    from tierstack.checkpointing.best import TRACKER_BEST
    from tierstack.checkpointing.resuming import repair_best_records
    from tierstack.config import CheckpointConfig

    (tmp_path / TRACKER_BEST).write_text("6\n")
    objs = _objs([[6, 1.5]])
    assert repair_best_records(CheckpointConfig(save=str(tmp_path), keep_best_k=2), objs) == [[6, 1.5]]
    assert objs.train_state.best_checkpoints == [] and not (tmp_path / TRACKER_BEST).exists()


def test_a_best_tracker_naming_a_step_that_is_gone_is_repaired_from_the_records(tmp_path, caplog):
    """After a rewind the tracker of the abandoned timeline names a step moved aside."""
    from tierstack.checkpointing.best import TRACKER_BEST
    from tierstack.checkpointing.resuming import repair_best_records
    from tierstack.config import CheckpointConfig

    _global_dir(tmp_path, 4)
    (tmp_path / TRACKER_BEST).write_text("40\n")
    objs = _objs([[4, 2.0]])
    with caplog.at_level("WARNING"):
        assert repair_best_records(CheckpointConfig(save=str(tmp_path), keep_best_k=2), objs) == []
    assert (tmp_path / TRACKER_BEST).read_text() == "4\n" and "names step 40, which does not exist" in caplog.text
