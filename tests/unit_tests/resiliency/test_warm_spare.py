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

    with caplog.at_level(logging.INFO, logger="tierstack.resiliency.warm_spare"):
        warm_spare.warm_up(_in_process_config(tmp_path), train)
    assert "warm-up failed after" in caplog.text and "(RuntimeError: no data here); it starts cold" in caplog.text
    assert "warmed up in" not in caplog.text  # (a new user read both lines, one after the other)


def test_the_rehearsal_never_asks_for_the_runs_checkpoint_step(tmp_path):
    """``checkpoint.ckpt_step`` names a step of the run's checkpoints: the rehearsal, with its own
    empty directories, must not look for it (a new user's bad step was refused once more by every
    spare's rehearsal, which then said it started cold)."""
    seen = []
    config = _in_process_config(tmp_path, "checkpoint.ckpt_step=7")
    warm_spare.warm_up(config, seen.append)
    (rehearsal,) = seen
    assert rehearsal.checkpoint.ckpt_step is None and config.checkpoint.ckpt_step == 7



_FIRST_RUN = r"""
import json, sys
from tierstack.resiliency import warm_spare
from tierstack.recipes import gpt_tiny_config
from tierstack.resiliency import in_process  # the rank's own code: imported before its first attempt
warm_spare.warm_imports()
warm_spare.import_first_use_modules()
before = set(sys.modules)
from tierstack import pretrain
out = sys.argv[1]
pretrain(gpt_tiny_config().apply_overrides([
    "train.train_iters=4", "train.eval_interval=2", "train.eval_iters=1", "dataset.mock=true",
    "logger.progress_bar=false", "mlflow=null", "straggler=null", f"logger.run_dir={out}",
    f"checkpoint.save={out}/g", f"checkpoint.local_dir={out}/l", "checkpoint.local_save_interval=2",
    "checkpoint.save_interval=3", "distributed.tensor_model_parallel_size=1", "train.global_batch_size=4",
    "train.micro_batch_size=4"]))
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_a_first_run_imports_nothing_after_the_ranks_imports_before_the_wrapper(tmp_path):
    """What a rank's first set-up, evaluation, steps and saves import is imported before NVRx's
    wrapper exists (``warm_imports`` in the slot, ``import_first_use_modules`` in the rank):
    NVRx's interruption can cut an import in half, and every later attempt of that process then
    fails on the half-imported package (torch._dynamo, imported lazily by the first optimizer
    step, was cut by a spare's death in a break-it pass). A fresh interpreter, since this one's
    modules are whatever earlier tests imported; run as a rank without in-process restart runs."""
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FIRST_RUN, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    late = json.loads(proc.stdout.strip().splitlines()[-1])
    watched = ("torch", "megatron", "nvidia_resiliency_ext", "numpy", "sympy", "matplotlib", "PIL")
    assert [m for m in late if m.split(".")[0] in watched or m.startswith((
        "tierstack.checkpointing", "tierstack.training", "tierstack.models", "tierstack.data",
        "tierstack.resiliency", "tierstack.runtime"))] == []
