"""End to end through pretrain(): the mlflow store read back with mlflow's own client across a resume.

Run 1 stops at iteration 6 (train.exit_interval, a planned stop that saves GLOBAL); run 2 resumes
and finishes at 16. One mlflow run holds both parts.
"""

import json
from pathlib import Path

import pytest

@pytest.mark.slow
def test_one_mlflow_run_across_a_resume(tmp_path, pretrain_run):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "e2e"
    pretrain_run(tmp_path, -1, 0, "train.exit_interval=6", "straggler=null")
    log = pretrain_run(tmp_path, -1, 0, "straggler=null")
    assert "resumed from GLOBAL checkpoint at iteration 6" in log

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tierstack")
    (run,) = client.search_runs([experiment.experiment_id])  # one run, continued
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == "e2e"
    assert run.data.tags["tierstack.resumed_at"] == "6"  # setup passes the resumed step on
    assert run.data.params["train.train_iters"] == "16"
    assert run.data.params["checkpoint.save_interval"] == "8"
    assert run.data.params["straggler"] == "None"

    def steps(key):
        return [m.step for m in client.get_metric_history(run_id, key)]

    # every log_interval, plus the first step of each run (1, and 7 after the resume); no step twice
    assert steps("loss") == [1, 2, 4, 6, 7, 8, 10, 12, 14, 16]
    assert steps("val_loss") == [4, 8, 12, 16]
    assert steps("lr") == steps("loss") and steps("tokens_per_s") == steps("loss")
    # GLOBAL saves only (6: the planned stop, 8: save_interval, 16: the end); LOCAL saves every 2 are not events
    assert steps("checkpoint/global_bytes") == [6, 8, 16]
    assert steps("checkpoint/global_save_seconds") == [6, 8, 16]
    events = sorted(a.path for a in client.list_artifacts(run_id, "checkpoints"))
    assert events == [f"checkpoints/global_iter_{s:07d}.json" for s in (6, 8, 16)]
    record = json.loads(Path(client.download_artifacts(run_id, events[0], str(tmp_path / "dl"))).read_text())
    assert record["tier"] == "GLOBAL" and record["step"] == 6 and record["bytes"] > 0
    assert record["path"].endswith("iter_0000006")
    assert "loss_curve.png" in [a.path for a in client.list_artifacts(run_id)]
    assert (run_dir / "loss_curve.png").stat().st_size > 20_000
