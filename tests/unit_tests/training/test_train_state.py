"""TrainState: a Stateful of plain values; checkpoints of 0.1.0 (``tracker_run_id``) still load."""

import pytest

from tierstack.train_state import TrainState


def test_round_trip_and_unknown_keys():
    ts = TrainState(step=7, consumed_train_samples=56, run_id="abc", experiment_run_id="mlf", resumed_from=[4])
    again = TrainState.from_state_dict(ts.state_dict())
    assert again == ts
    with pytest.raises(KeyError, match="unknown keys"):
        TrainState().load_state_dict({"step": 1, "no_such_counter": 2})


def test_state_of_0_1_0_names_the_experiment_run_tracker_run_id():
    old = TrainState(step=3).state_dict()
    old["tracker_run_id"] = old.pop("experiment_run_id")
    old["tracker_run_id"] = "0123abcd"
    ts = TrainState.from_state_dict(old)
    assert ts.experiment_run_id == "0123abcd" and ts.step == 3
    assert "tracker_run_id" not in ts.state_dict()


def test_best_records_round_trip_and_an_older_state_without_them_loads_empty():
    ts = TrainState(step=8, best_checkpoints=[[6, 1.25], [4, 1.5]])
    again = TrainState.from_state_dict(ts.state_dict())
    assert again.best_checkpoints == [[6, 1.25], [4, 1.5]]
    older = ts.state_dict()
    del older["best_checkpoints"]  # a checkpoint written before issue 11
    assert TrainState.from_state_dict(older).best_checkpoints == []
