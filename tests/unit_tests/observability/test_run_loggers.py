"""RunLoggers: one interface over every logger that is on; TensorBoard's files read back with
TensorBoard's own reader; W&B offline (no network) continuing one run id across a resume."""

import logging
import time
from pathlib import Path

import pytest

from tierstack.checkpointing.types import CheckpointTier, SaveEvent
from tierstack.observability.run_loggers import RunLoggers, numeric_items
from tierstack.observability.tensorboard_logger import TensorBoardLogger


class Recorder:
    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def _record(self, *args):
        self.calls.append(args)
        if self.fail:
            raise RuntimeError("tracker down")

    def log_metrics(self, step, metrics):
        self._record("metrics", step, dict(metrics))

    def log_checkpoint(self, event):
        self._record("checkpoint", event.step)

    def set_tag(self, key, value):
        self._record("tag", key, value)

    def log_artifact(self, path, artifact_path=None):
        self._record("artifact", str(path))

    def finish(self, status="FINISHED"):
        self._record("finish", status)


def _event(step, tier=CheckpointTier.GLOBAL):
    return SaveEvent(tier=tier, step=step, path=f"/ckpt/iter_{step:07d}", bytes=1234, seconds=0.5)


def test_every_logger_gets_each_call_and_a_failing_one_never_stops_the_others(caplog):
    broken, good = Recorder(fail=True), Recorder()
    loggers = RunLoggers(None, broken)
    loggers.add(good)
    loggers.add(None)
    assert len(loggers) == 2
    with caplog.at_level(logging.ERROR):
        loggers.log_metrics(3, {"loss": 2.5})
        loggers.log_checkpoint(_event(4))
        loggers.set_tag("stop_reason", "done")
        loggers.finish("FAILED")
    assert good.calls == [("metrics", 3, {"loss": 2.5}), ("checkpoint", 4), ("tag", "stop_reason", "done"),
                          ("finish", "FAILED")]
    assert len(broken.calls) == 4  # each call reached it too
    assert "Recorder.log_metrics failed" in caplog.text


def test_a_logger_failing_at_every_interval_is_logged_once_and_its_recovery_said(caplog):
    """A full disk under mlflow's store fails every log interval: one traceback, then a count, not a
    traceback per interval; the first call that works again says how many failed."""
    flaky = Recorder(fail=True)
    loggers = RunLoggers(flaky)
    with caplog.at_level(logging.INFO):
        for step in range(1, 6):
            loggers.log_metrics(step, {"loss": 1.0})
        loggers.set_tag("k", "v")  # another method fails on its own account
        flaky.fail = False
        loggers.log_metrics(6, {"loss": 1.0})
        loggers.log_metrics(7, {"loss": 1.0})
    failures = [r for r in caplog.records if "failed (later failures" in r.getMessage()]
    assert [r.getMessage().split(" ")[0] for r in failures] == ["Recorder.log_metrics", "Recorder.set_tag"]
    assert all(r.exc_info for r in failures)
    assert "Recorder.log_metrics works again after 5 failed calls" in caplog.text
    assert caplog.text.count("works again") == 1 and len(flaky.calls) == 8
    flaky.fail = True
    caplog.clear()
    with caplog.at_level(logging.INFO):
        loggers.set_tag("k", "v")  # still counted: no new traceback
        loggers.finish("FINISHED")
    assert [r.getMessage() for r in caplog.records] == ["Recorder.finish failed too (RuntimeError: tracker down)"]


def test_numeric_items_keep_finite_numbers_only():
    import torch

    assert numeric_items({"a": 1, "b": float("nan"), "c": None, "d": "x", "e": torch.tensor(2.0)}) == [
        ("a", 1.0), ("e", 2.0)]


def _scalars(log_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}, acc


def test_tensorboard_continues_the_curves_of_a_resumed_run(tmp_path):
    first = TensorBoardLogger(tmp_path, rank=0, config={"train": {"train_iters": 6}})
    for step in range(1, 6):
        first.log_metrics(step, {"loss": float(step), "val_loss": None, "note": "x"})
    first.log_checkpoint(_event(4))
    first.log_checkpoint(_event(4, CheckpointTier.LOCAL))  # LOCAL saves are no events
    # no finish(): the first run died after step 5; the resume is from step 3
    second = TensorBoardLogger(tmp_path, rank=0, resume_step=3)
    for step in range(4, 7):
        second.log_metrics(step, {"loss": 10.0 * step})
    second.finish()
    scalars, acc = _scalars(tmp_path)
    assert scalars["loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    assert scalars["checkpoint/global_bytes"] == []  # step 4 lies beyond the resume: purged with the rest
    assert "config/text_summary" in acc.Tags()["tensors"]


def test_a_fresh_start_in_the_same_directory_hides_the_earlier_runs_events(tmp_path):
    old = TensorBoardLogger(tmp_path, rank=0)
    for step in (1, 2, 3):
        old.log_metrics(step, {"loss": 9.0})
    old.finish()
    new = TensorBoardLogger(tmp_path, rank=0)  # no checkpoint: a fresh start at step 0
    new.log_metrics(1, {"loss": 1.0})
    new.finish()
    assert _scalars(tmp_path)[0]["loss"] == [(1, 1.0)]


def test_tensorboard_writes_nothing_on_other_ranks(tmp_path):
    logger = TensorBoardLogger(tmp_path / "tb", rank=1)
    logger.log_metrics(1, {"loss": 1.0})
    logger.finish()
    assert not (tmp_path / "tb").exists()


def test_wandb_offline_continues_one_run_id_across_a_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tierstack.config import WandbConfig
    from tierstack.observability.wandb_logger import RUN_ID_FILE, WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: never a server
    monkeypatch.delenv("WANDB_SERVICE", raising=False)  # wandb.init sets it; gone again after the test
    cfg = WandbConfig(project="unit", mode="offline", tags=["t"])
    first = WandbLogger(cfg, tmp_path, rank=0, config={"a": {"b": 1}})
    first.log_metrics(1, {"loss": 2.0})
    first.finish()
    # wandb names an offline run's folder by its start, to the second: in one second, both starts
    # would share one folder (a real restart takes seconds, a unit test does not)
    time.sleep(1.01 - time.time() % 1.0)
    second = WandbLogger(cfg, tmp_path, rank=0, resume_step=1)
    second.log_metrics(2, {"loss": 1.5})
    second.finish("FAILED")
    # a fresh start (step 0) is a new W&B run; no wandb.mode: $WANDB_MODE (offline here)
    fresh = WandbLogger(WandbConfig(project="unit"), tmp_path, rank=0)
    fresh.finish()
    assert first.run_id == second.run_id != fresh.run_id
    assert (tmp_path / RUN_ID_FILE).read_text().strip() == fresh.run_id
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{first.run_id}"))) == 2
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{fresh.run_id}"))) == 1
    assert WandbLogger(cfg, tmp_path, rank=1).run_id is None  # other ranks: no run at all


def test_wandb_init_waits_while_a_killed_ranks_service_still_holds_the_run(monkeypatch, caplog):
    """Seen in a full-suite run: after SIGKILL of rank 0, the resumed launch's ``wandb.init`` got
    "run ID ... is in use" from the killed rank's W&B service. It is tried again with backoff; an
    error other than "in use" is raised at once; a holder that never lets go costs W&B, not the run."""
    from tierstack.observability import wandb_logger

    calls = []

    class Held:
        def __init__(self, held_times, other=None):
            self.held_times, self.other = held_times, other

        def init(self, **kwargs):
            calls.append(kwargs["id"])
            if self.other is not None:
                raise self.other
            if len(calls) <= self.held_times:
                raise RuntimeError(f"run ID {kwargs['id']} is in use")
            return "run"

    assert wandb_logger._init_waiting_for_a_killed_holder(Held(2), {"id": "r1"}) == "run" and calls == ["r1"] * 3
    calls.clear()
    with pytest.raises(ValueError):
        wandb_logger._init_waiting_for_a_killed_holder(Held(0, ValueError("bad entity")), {"id": "r1"})
    assert calls == ["r1"]
    calls.clear()
    monkeypatch.setattr(wandb_logger, "IN_USE_WAIT_S", 0.5)
    assert wandb_logger._init_waiting_for_a_killed_holder(Held(10**6), {"id": "r1"}) is None
    assert "still held by another process" in caplog.text


CHILD = """
import sys
from tierstack.config import WandbConfig
from tierstack.observability import wandb_logger
wandb_logger.IN_USE_WAIT_S = 3.0  # a failure shows in seconds, not a minute
logger = wandb_logger.WandbLogger(WandbConfig(project="unit", mode="offline"), sys.argv[1], rank=0, resume_step=5)
logger.log_metrics(6, {"loss": 1.0})
logger.finish()
print("RUN_ID", logger.run_id)
"""

DRIVER = """
import os, subprocess, sys
import wandb
holder = wandb.init(project="unit", mode="offline", dir=sys.argv[1] + "/driver", id="held", resume="allow")
assert os.environ.get("WANDB_SERVICE"), "wandb no longer leaves its service in the environment"
child = subprocess.run([sys.executable, "-c", sys.argv[2], sys.argv[1]], capture_output=True, text=True, timeout=120)
holder.finish()
sys.stdout.write(child.stdout)
sys.stderr.write(child.stderr)
sys.exit(child.returncode)
"""


def test_a_rank_starts_its_own_wandb_service_not_the_one_its_launcher_left_in_the_environment(tmp_path):
    """Found by CI: a process that called ``wandb.init`` keeps ``$WANDB_SERVICE`` in its environment;
    a job it launches afterwards inherits it, so rank 0 registered its run in that long-lived service,
    and after rank 0 was SIGKILLed the id stayed "in use" there: the resume logged without W&B.
    Here a real driver process holds run ``held`` open in its service and starts a real child that
    resumes the same run id: the child must get its own service, continue ``held``, write its own file."""
    import os
    import subprocess
    import sys

    pytest.importorskip("wandb")
    from tierstack.observability.wandb_logger import RUN_ID_FILE

    (tmp_path / RUN_ID_FILE).write_text("held\n")
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    done = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), CHILD], capture_output=True, text=True,
                          timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RUN_ID held" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "still held by another process" not in done.stderr
    assert len(list((tmp_path / "wandb").glob("offline-run-*-held/run-held.wandb"))) == 1
