"""TensorBoard and W&B (offline) across an unplanned stop: 2 ranks, 30 iterations, rank 0 SIGKILLed
right after iteration 15, the job started again; it resumes from the checkpoints of iteration 10.

The event files are read back with TensorBoard's own reader (what ``tensorboard --logdir`` shows),
the W&B run files with wandb's protobuf records, the mlflow store with mlflow's client.
"""

import json
from pathlib import Path

import pytest

from launcher import run_torchrun
from wandb_records import history, records

WORKER = Path(__file__).with_name("loggers_worker.py")
SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tflops_per_rank",
           "timers/forward_backward_s", "timers/optimizer_s", "timers/data_s", "timers/checkpoint_s",
           "timers/slowest_rank", "memory/rss_gib")


def _tensorboard(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})  # 0: keep every event
    acc.Reload()
    return acc


def _check_profile(profile_dir: Path) -> None:
    """The profile of iterations 5-7 on rank 0: a Chrome trace that loads as JSON with the
    operators and phases of those steps, and the top-operators table."""
    assert sorted(p.name for p in profile_dir.iterdir()) == [
        "rank0_steps5-7.top_operators.txt", "rank0_steps5-7.trace.json"]
    trace = json.loads((profile_dir / "rank0_steps5-7.trace.json").read_text())
    names = [e.get("name", "") for e in trace["traceEvents"]]
    assert names.count("forward_backward") == 3 and names.count("optimizer") == 3  # one per profiled step
    assert "aten::mm" in names or "aten::addmm" in names  # the model's matrix multiplies
    table = (profile_dir / "rank0_steps5-7.top_operators.txt").read_text()
    assert "Self CPU" in table and "aten::" in table


@pytest.mark.slow
def test_tensorboard_and_wandb_continue_the_same_curves_after_a_kill(tmp_path):
    killed = run_torchrun([WORKER, tmp_path, 15, "profile.enabled=true"], timeout=300)  # steps 5-7, rank 0
    assert killed.returncode != 0  # rank 0 died of SIGKILL after iteration 15
    assert "iter 15/30" not in killed.stdout + killed.stderr  # killed before its log line
    done = run_torchrun([WORKER, tmp_path, 0], timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    assert "resumed from LOCAL checkpoint at iteration 10" in log, log[-6000:]
    run_dir = tmp_path / "tb"
    _check_profile(run_dir / "profile")

    acc = _tensorboard(run_dir / "tensorboard")
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file per start
    tags = set(acc.Tags()["scalars"])
    for key in SCALARS:
        assert [e.step for e in acc.Scalars(key)] == list(range(1, 31)), key  # each step once, in order
    assert [e.step for e in acc.Scalars("val_loss")] == [5, 10, 15, 20, 25, 30]
    assert [e.step for e in acc.Scalars("checkpoint/global_bytes")] == [10, 20, 30]
    assert {"checkpoint/local_durable_s", "checkpoint/global_durable_s", "checkpoint/local_blocked_s",
            "checkpoint/global_blocked_s"} <= tags
    straggler = sorted(t for t in tags if t.startswith("straggler/"))
    assert straggler  # the straggler scores, at their report steps
    for tag in tags:
        steps = [e.step for e in acc.Scalars(tag)]
        assert steps == sorted(set(steps)), tag  # nothing twice or reversed, whatever the tag
    assert "config" in acc.Tags()["tensors"][0]  # the run config as text

    # mlflow holds the same scalars (the loggers are fed the same metrics)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tierstack").experiment_id])
    assert set(run.data.metrics) <= tags
    mlflow_loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    tb_loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert tb_loss == pytest.approx(mlflow_loss)  # float32 in event files

    # W&B: two offline run files (one per start) of one run id; the resumed one goes on from 11
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    (first_id, first), (second_id, second) = history(files[0]), history(files[1])
    assert first_id == second_id == (run_dir / "wandb_run_id.txt").read_text().strip()
    # The killed run's file holds what wandb had flushed (every second) before the kill: a
    # prefix of 1..14 (the last second is lost with the process). The resumed run logs 11..30.
    before_kill = [r["_step"] for r in first if "loss" in r]
    assert before_kill == list(range(1, len(before_kill) + 1)) and len(before_kill) <= 14
    assert [r["_step"] for r in second if "loss" in r] == list(range(11, 31))
    merged = {}
    for row in first + second:  # a later row of a step replaces the earlier one
        if "loss" in row:
            merged[row["_step"]] = row["loss"]
    assert set(range(11, 31)) <= set(merged) <= set(range(1, 31))
    assert merged == pytest.approx({s: tb_loss[s] for s in merged}, rel=1e-6)  # the same values as TensorBoard
    assert [r["_step"] for r in second if "val_loss" in r] == [15, 20, 25, 30]
    artifacts = [r.artifact for r in records(files[1]) if r.WhichOneof("record_type") == "artifact"]
    assert [json.loads(a.metadata)["step"] for a in artifacts] == [20, 30]  # checkpoint metadata, not bytes
    assert all(a.type == "checkpoint" and json.loads(a.metadata)["bytes"] > 0 for a in artifacts)
