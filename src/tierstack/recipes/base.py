"""The shared recipe base: :func:`gpt_config`, from which every GPT recipe derives its config."""

from __future__ import annotations

from pathlib import Path

from tierstack.config import (
    CheckpointConfig,
    ConfigContainer,
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
