"""ExperimentTracker against a real sqlite store in tmp_path, read back with mlflow's own client."""

import json
from dataclasses import dataclass
from enum import Enum

import pytest
from mlflow.tracking import MlflowClient

from tierstack.config.sections import MlflowConfig
from tierstack.observability.experiment_tracker import ExperimentTracker, flatten_params

CONFIG = {
    "train": {"train_iters": 20, "micro_batch_size": 4},
    "mlflow": {"tracking_uri": None, "experiment_name": "exp"},
    "dataset": {"data_path": ["x" * 7000]},
}


class Tier(Enum):
    LOCAL = "local"
    GLOBAL = "global"


@dataclass
class Event:
    tier: Tier
    step: int
    path: str
    bytes: int
    seconds: float


def client_for(run_dir):
    return MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")


def test_flatten_params_names_sections_and_truncates():
    flat = flatten_params(CONFIG)
    assert flat["train.train_iters"] == "20"
    assert flat["mlflow.tracking_uri"] == "None"
    assert len(flat["dataset.data_path"]) == 6000 and flat["dataset.data_path"].endswith("...")


def test_run_params_metrics_checkpoints_and_resume(tmp_path):
    cfg = MlflowConfig(experiment_name="exp", run_name="first")
    tracker = ExperimentTracker(cfg, tmp_path, rank=0)
    run_id = tracker.start(CONFIG)
    tracker.log_metrics(10, {"loss": 3.5, "lr": 1e-3, "skipped": None, "note": "text"})
    tracker.log_metrics(20, {"loss": 3.1})
    assert tracker.log_checkpoint(Event(Tier.LOCAL, 10, "/local/iter_10", 100, 0.1)) is False
    assert tracker.log_checkpoint(Event(Tier.GLOBAL, 20, "/ckpt/iter_0000020", 4096, 1.5)) is True
    png = tmp_path / "curve.png"
    png.write_bytes(b"\x89PNG fake")
    tracker.log_artifact(png)
    tracker.finish("KILLED")

    client = client_for(tmp_path)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.info.run_name == "first"
    assert run.data.params["train.train_iters"] == "20"
    assert run.info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri())
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(10, 3.5), (20, 3.1)]
    assert "skipped" not in run.data.metrics and "note" not in run.data.metrics
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "checkpoint/global_bytes")] == [(20, 4096)]
    events = [a.path for a in client.list_artifacts(run_id, "checkpoints")]
    assert events == ["checkpoints/global_iter_0000020.json"]  # LOCAL saves are not logged
    record = json.loads(open(client.download_artifacts(run_id, events[0], str(tmp_path / "dl"))).read())
    assert record == {"tier": "GLOBAL", "step": 20, "path": "/ckpt/iter_0000020", "bytes": 4096, "seconds": 1.5}
    assert "curve.png" in [a.path for a in client.list_artifacts(run_id)]

    # a resume continues the same run: curves go on, params are not logged twice
    resumed = ExperimentTracker(cfg, tmp_path, rank=0)
    changed = {**CONFIG, "train": {"train_iters": 40, "micro_batch_size": 4}}
    assert resumed.start(changed, resume_run_id=run_id, resume_step=20) == run_id
    resumed.log_metrics(30, {"loss": 2.9})
    resumed.finish()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.train_iters"] == "20"
    assert run.data.tags["tierstack.resumed_at"] == "20"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [10, 20, 30]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_unknown_resume_id_starts_a_new_run(tmp_path):
    tracker = ExperimentTracker(MlflowConfig(), tmp_path, rank=0)
    run_id = tracker.start(CONFIG, resume_run_id="0" * 32)
    assert run_id and run_id != "0" * 32
    tracker.finish()


def test_other_ranks_and_disabled_tracking_are_no_ops(tmp_path):
    for tracker in (ExperimentTracker(MlflowConfig(), tmp_path, rank=1), ExperimentTracker(None, tmp_path, rank=0)):
        assert tracker.start(CONFIG) is None
        tracker.log_metrics(1, {"loss": 1.0})
        assert tracker.log_checkpoint({"tier": "GLOBAL", "step": 1, "path": "p", "bytes": 1, "seconds": 1}) is False
        tracker.finish()
    assert not (tmp_path / "mlflow.db").exists()


def test_bad_status_is_refused(tmp_path):
    with pytest.raises(ValueError, match="FINISHED"):
        ExperimentTracker(None, tmp_path, rank=0).finish("DONE")


def test_a_store_that_cannot_be_opened_is_one_clear_refusal_not_a_library_traceback(tmp_path):
    """Found on a full disk under ``logger.run_dir`` (2 ranks): rank 0 died in setup with
    sqlalchemy's traceback ("database or disk is full") while rank 1 waited for it. Setup now turns
    any failure of the store into one BadInputError (agreed across ranks) naming the store, the
    root cause and the fix. Here a real sqlite store whose file cannot be created (a path under
    /dev/null, which is no directory)."""
    from tierstack.errors import BadInputError
    from tierstack.recipes import gpt_tiny_config
    from tierstack.training.setup import _build_experiment_tracker
    from tierstack.runtime import ParallelLayout

    cfg = gpt_tiny_config().apply_overrides([f"logger.run_dir={tmp_path}",
                                             "mlflow.tracking_uri=sqlite:////dev/null/mlflow.db"])
    layout = ParallelLayout(rank=0, world_size=1, local_rank=0, tensor_model_parallel_size=1,
                            pipeline_model_parallel_size=1, data_parallel_size=1, tensor_model_parallel_rank=0,
                            pipeline_model_parallel_rank=0, data_parallel_rank=0)
    with pytest.raises(BadInputError) as e:
        _build_experiment_tracker(cfg, layout)
    msg = str(e.value)
    assert msg.startswith("mlflow: the tracking store sqlite:////dev/null/mlflow.db cannot be used (")
    assert "mlflow=null to train without mlflow" in msg and "\n" not in msg
