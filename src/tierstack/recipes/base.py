"""Shared recipe base: a recipe is a function returning a :class:`ConfigContainer`.

A recipe file (``recipes/gpt_tiny.py``) defines its config function from :func:`gpt_config` and
calls :func:`run` under ``if __name__ == "__main__":``, so it is runnable as
``torchrun --nproc-per-node 2 recipes/gpt_tiny.py section.field=value ...``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from tierstack.config import (
    CheckpointConfig,
    ConfigContainer,
    ConfigError,
    DistributedConfig,
    LoggerConfig,
    MlflowConfig,
    ModelConfig,
    OptimizerConfig,
    SchedulerConfig,
    StragglerConfig,
    TrainConfig,
)


def gpt_config(
    name: str,
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    seq_length: int,
    train_iters: int,
    micro_batch_size: int,
    global_batch_size: int,
    lr: float,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    run_root: str = "runs",
) -> ConfigContainer:
    """A GPT pretraining config with both checkpoint tiers, straggler detection and mlflow on.

    Checkpoints: LOCAL every ``train_iters // 8`` iterations under ``<run_root>/<name>/local``
    (put it on node-local disk on a cluster), GLOBAL asynchronously every ``train_iters // 2``
    under ``<run_root>/<name>/checkpoints``; two of each are kept. mlflow writes a sqlite store in
    the run directory.
    """
    run_dir = Path(run_root) / name
    return ConfigContainer(
        model=ModelConfig(
            num_layers=num_layers,
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            seq_length=seq_length,
        ),
        train=TrainConfig(
            train_iters=train_iters,
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            eval_interval=max(1, train_iters // 4),
            eval_iters=4,
        ),
        optimizer=OptimizerConfig(lr=lr, min_lr=lr / 10),
        scheduler=SchedulerConfig(lr_warmup_iters=max(1, train_iters // 10), lr_decay_style="cosine"),
        distributed=DistributedConfig(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
        ),
        checkpoint=CheckpointConfig(
            save=str(run_dir / "checkpoints"),
            save_interval=max(1, train_iters // 2),
            local_dir=str(run_dir / "local"),
            local_save_interval=max(1, train_iters // 8),
            most_recent_k=2,
            async_save=True,
        ),
        logger=LoggerConfig(run_dir=str(run_dir), log_interval=10),
        straggler=StragglerConfig(report_interval=max(1, train_iters // 4)),
        mlflow=MlflowConfig(experiment_name="tierstack", run_name=name),
    )


def run(config_fn: Callable[[], ConfigContainer], argv: Optional[Sequence[str]] = None) -> int:
    """Build the recipe's config, apply ``section.field=value`` overrides, and pretrain.

    Returns a process exit status: 0 on success, 2 on a config error (printed once, on rank 0,
    before any work starts).
    """
    import os

    from tierstack import pretrain

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config = config_fn().apply_overrides(argv)
        config.validate(int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            logging.basicConfig(level=logging.INFO, format="%(message)s")
            logging.getLogger("tierstack").error("%s", exc)
        return 2
    pretrain(config)
    return 0
