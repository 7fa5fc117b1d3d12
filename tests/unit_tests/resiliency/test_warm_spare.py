"""A spare's rehearsal (``warm_spare.warm_up``): its config is one the run's own checks accept for
every in-process config (a refused rehearsal leaves the spare cold), and a rehearsal that fails is
said in the log, not swallowed with the rehearsal's own lines."""

import logging

from tierstack.config import ConfigContainer
from tierstack.resiliency import warm_spare


def _in_process_config(tmp_path, *extra):
    return ConfigContainer().apply_overrides([
        "train.micro_batch_size=2", "train.global_batch_size=4", "resiliency.restart=in-process",
        "resiliency.heartbeat_timeout_s=3", "resiliency.spare_ranks=1", f"checkpoint.local_dir={tmp_path}/local",
        "checkpoint.local_save_interval=5", f"checkpoint.save={tmp_path}/global", *extra])


def test_the_rehearsal_config_passes_the_runs_checks_with_memory_steps_and_replicas(tmp_path):
    seen = []

    def train(cfg):
        cfg.validate(1)  # what pretrain's set-up checks first (paths included)
        seen.append(cfg)

    config = _in_process_config(tmp_path, "checkpoint.memory_save_interval=1", "checkpoint.replication_factor=2")
    warm_spare.warm_up(config, train)
    (rehearsal,) = seen
    assert rehearsal.resiliency.restart == "launcher" and rehearsal.checkpoint.memory_save_interval is None
    assert rehearsal.checkpoint.local_dir != config.checkpoint.local_dir  # nothing of the run touched
    assert config.checkpoint.memory_save_interval == 1  # the run's own config is unchanged


def test_a_failed_rehearsal_is_logged(tmp_path, caplog):
    def train(cfg):
        raise RuntimeError("no data here")

    with caplog.at_level(logging.WARNING, logger="tierstack.resiliency.warm_spare"):
        warm_spare.warm_up(_in_process_config(tmp_path), train)
    assert "spare warm-up failed (RuntimeError: no data here); the spare starts cold" in caplog.text

