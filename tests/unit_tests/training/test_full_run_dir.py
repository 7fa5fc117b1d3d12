"""A ``logger.run_dir`` that cannot be written (a full disk, a path under a regular file) must not stop
a run whose checkpoints live elsewhere: found by relaunching into a full 8 MB tmpfs (before: rank 0
died in setup on ``restarts.json``, then on TensorBoard's first event file; after: it trained on,
rc 0, with one warning each). Here the failures are real OSErrors from the file system: the run
directory is a path under a regular file (ENOTDIR)."""

import logging

from tierstack.observability.run_loggers import RunLoggers
from tierstack.recipes import gpt_tiny_config
from tierstack.resiliency import restarts
from tierstack.runtime import ParallelLayout
from tierstack.train_state import TrainState
from tierstack.training.setup import _start_loggers

LAYOUT = ParallelLayout(rank=0, world_size=1, local_rank=0, tensor_model_parallel_size=1,
                        pipeline_model_parallel_size=1, data_parallel_size=1, tensor_model_parallel_rank=0,
                        pipeline_model_parallel_rank=0, data_parallel_rank=0)


def test_a_restart_record_that_cannot_be_written_is_a_warning(tmp_path, monkeypatch, caplog):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    record = restarts.record_start(tmp_path / "file" / "run")
    assert record["restarts"] == 0 and record["rdzv_id"] == "job-1"
    assert "restarts.json cannot be written" in caplog.text and "Not a directory" in caplog.text


def test_tensorboard_that_cannot_write_its_event_file_is_off_with_a_warning(tmp_path, caplog):
    (tmp_path / "file").write_text("x")
    cfg = gpt_tiny_config().apply_overrides([f"logger.run_dir={tmp_path / 'run'}",
                                             f"logger.tensorboard_dir={tmp_path / 'file' / 'tb'}", "wandb=null"])
    loggers = RunLoggers()
    with caplog.at_level(logging.WARNING):
        _start_loggers(cfg, LAYOUT, loggers, None, TrainState(), None)
    assert len(loggers) == 0
    assert f"TensorBoard is off for this run: {tmp_path / 'file' / 'tb'} cannot be written" in caplog.text
