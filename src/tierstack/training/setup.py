"""``setup(config)``: everything a training run needs, handed on as a named ``SetupOutput``."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional

import torch

from tierstack import runtime
from tierstack.config import ConfigContainer, ConfigError
from tierstack.errors import BadInputError, say_once
from tierstack.runtime import collectives
from tierstack.runtime.failures import root_cause
from tierstack.train_state import TrainState

if TYPE_CHECKING:  # megatron-core and mlflow are slow to import; setup() imports them when it runs
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from tierstack.checkpointing import CheckpointManager, ResumeInfo
    from tierstack.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer
    from tierstack.observability.experiment_tracker import ExperimentTracker
    from tierstack.observability.run_loggers import RunLoggers
    from tierstack.resiliency.straggler import StragglerMonitor

log = logging.getLogger(__name__)


class SetupOutput(NamedTuple):
    """Objects built by :func:`setup`, in the order the training loop uses them.

    ``straggler`` and ``experiment_tracker`` are None when their config sections are off;
    ``resume_info`` is None on a fresh start.
    """

    config: ConfigContainer
    layout: runtime.ParallelLayout
    tokenizer: "ByteTokenizer | HuggingFaceTokenizer"
    model: list[torch.nn.Module]  # megatron DDP-wrapped model chunks (one: no virtual pipeline stages)
    optimizer: "MegatronOptimizer"  # a ChainedOptimizer on megatron-core 0.16
    scheduler: "OptimizerParamScheduler"
    train_state: TrainState
    train_data_iterator: Iterator[dict]
    valid_data_iterator: Optional[Iterator[dict]]
    checkpoint_manager: "CheckpointManager"
    resume_info: "Optional[ResumeInfo]"
    straggler: "Optional[StragglerMonitor]"
    experiment_tracker: "Optional[ExperimentTracker]"
    padded_vocab_size: int
    loggers: "RunLoggers"  # every run logger that is on (mlflow, TensorBoard, W&B) behind one interface


def _build_iterators(cfg: ConfigContainer, tokenizer, layout, train_state: TrainState):
    from tierstack.data.datasets import build_train_valid_datasets
    from tierstack.data.samplers import build_cyclic_iterator, build_data_iterator

    t = cfg.train
    train_samples = t.train_iters * t.global_batch_size
    evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 0
    valid_samples = max(evals * t.eval_iters * t.global_batch_size, t.global_batch_size)
    train_ds, valid_ds = build_train_valid_datasets(
        cfg.dataset,
        tokenizer,
        seq_length=cfg.model.seq_length,
        train_samples=train_samples,
        valid_samples=valid_samples,
        seed=cfg.rng.seed,
    )
    train_it = build_data_iterator(
        train_ds,
        consumed_samples=train_state.consumed_train_samples,
        micro_batch_size=t.micro_batch_size,
        dp_rank=layout.data_parallel_rank,
        dp_size=layout.data_parallel_size,
        num_workers=cfg.dataset.num_workers,
        pin_memory=runtime.has_gpu(),
    )
    valid_it = None
    if valid_ds is not None and evals:
        valid_it = build_cyclic_iterator(
            valid_ds,
            consumed_samples=train_state.consumed_valid_samples,
            micro_batch_size=t.micro_batch_size,
            dp_rank=layout.data_parallel_rank,
            dp_size=layout.data_parallel_size,
            pin_memory=runtime.has_gpu(),
        )
    return train_it, valid_it


def _check_paths_on_every_rank(cfg: ConfigContainer, layout: runtime.ParallelLayout) -> None:
    """Collective: every rank checks the checkpoint directories (rank 0 also ``logger.tensorboard_dir``) as its node sees them
    (``CheckpointConfig.path_problems``) and all ranks raise the same error when any rank found a
    problem, naming the field and the ranks (a node-local ``local_dir`` that is a file on one node,
    a GLOBAL mount missing on another). Without this, the rank with the bad directory stopped alone
    before the process groups existed and the others waited for it until ``distributed.timeout_s``.

    Raises:
        ConfigError: on every rank, each problem once with the ranks that found it.
    """
    import socket

    mine = cfg.checkpoint.path_problems() if cfg.checkpoint is not None else []
    if layout.rank == 0:  # rank 0 alone writes TensorBoard's files
        mine += cfg.logger.path_problems()
    seen = collectives.all_gather_object((mine, socket.gethostname()) if mine else None)
    by_problem: dict[str, list[str]] = {}
    for rank, view in enumerate(seen):
        if view is not None:
            for problem in view[0]:
                by_problem.setdefault(problem, []).append(f"{rank} on {view[1]}")
    if by_problem:
        raise ConfigError([f"{problem} (rank(s) {', '.join(where)})" for problem, where in by_problem.items()])


def setup(cfg: ConfigContainer, closers: Optional[contextlib.ExitStack] = None) -> SetupOutput:
    """Validate, initialise ranks, build model/optimizer/scheduler, resume, then data and loggers.

    Order matters: the checkpoint is loaded before the data iterators are built, because the
    samplers start at the restored ``consumed_train_samples`` / ``consumed_valid_samples``.

    Args:
        closers: each resource is registered on this stack the moment it exists (process groups,
            mlflow run, checkpoint manager, straggler monitor; see :mod:`tierstack.training.closers`),
            so a failure anywhere closes exactly what was built. When None, a failed setup still
            closes what it built and a successful one leaves closing to the caller.

    Raises:
        ConfigError: the config is invalid (before any process group is created).
        Errors of the checkpoint layer when checkpoints exist but none is valid.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world_size, check_paths=world_size == 1)  # several ranks: checked together, below
    with contextlib.ExitStack() as own:
        out = _setup(cfg, closers if closers is not None else own)
        own.pop_all()  # success: the resources outlive setup
        return out


def _setup(cfg: ConfigContainer, stack: contextlib.ExitStack) -> SetupOutput:
    from tierstack.resiliency.signals import stop_with_the_launcher
    from tierstack.training.closers import register

    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank of torchrun: never outlive the launcher
        stop_with_the_launcher()

    layout = runtime.initialize_distributed(
        tensor_model_parallel_size=cfg.distributed.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.distributed.pipeline_model_parallel_size,
        seed=cfg.rng.seed,
        backend=cfg.distributed.backend,
        timeout_s=cfg.distributed.timeout_s,
    )
    register(stack, "process groups", runtime.destroy_distributed)  # registered first: closed last
    try:
        return _build(cfg, layout, stack, register)
    except BadInputError as exc:  # raised alike on every rank: said by rank 0, then they leave together
        if layout.rank != 0:  # first: the refusal (rank 0, after the barrier) is the last line printed
            log.error("rank %d stopped: bad input (rank 0 says which)", layout.rank)
        collectives.barrier()
        say_once(exc)  # on every rank: marks it said (rank 0 prints it)
        collectives.barrier()  # none exits before rank 0 printed (torchrun would stop rank 0)
        raise


def _report_schedule(scheduler) -> None:
    """After a resume, rank 0 says when the LR/weight-decay schedule in use is not the one the
    config implies (raising ``train.train_iters`` does not stretch a finished decay by itself)."""
    from tierstack.training.optim import schedule_changes

    changes = schedule_changes(scheduler)  # none with override_opt_param_scheduler: the config's is in use
    if changes and int(os.environ.get("RANK", "0")) == 0:
        log.warning("resume: the LR schedule continues the checkpoint's, not this config's: %s. The LR at "
                    "iteration %d is %.3g. Set scheduler.override_opt_param_scheduler=true to follow this "
                    "config's schedule from here on", "; ".join(changes), scheduler.num_steps,
                    scheduler.get_lr(scheduler.optimizer.param_groups[0]))


def _build(cfg: ConfigContainer, layout: runtime.ParallelLayout, stack: contextlib.ExitStack, register) -> SetupOutput:
    from tierstack.resiliency import in_process
    from tierstack.resiliency.restarts import record_start

    from tierstack.checkpointing import CheckpointManager, TrainingObjects
    from tierstack.data.datasets import check_training_data
    from tierstack.data.tokenizers import build_tokenizer
    from tierstack.hf.pretrained import pretrained_root
    from tierstack.models.gpt import gpt_model_provider, model_vocab_size
    from tierstack.observability.run_loggers import RunLoggers
    from tierstack.training.optim import build_model, build_optimizer, build_scheduler, wire_model_config

    _check_paths_on_every_rank(cfg, layout)
    tokenizer = build_tokenizer(cfg.tokenizer)
    # Before any run artifact (checkpoint directories, the mlflow run): bad data stops every rank here.
    check_training_data(cfg.dataset, tokenizer)
    if in_process.restart_number() == 0:  # an in-process restart is no launcher restart: not counted
        record_start(Path(cfg.logger.run_dir))  # job-wide restart count; stops a job past --max-restarts
    provider = gpt_model_provider(cfg, model_vocab_size(cfg, tokenizer))
    model = build_model(cfg, provider)
    optimizer = build_optimizer(cfg, model)
    wire_model_config(model, optimizer)
    scheduler = build_scheduler(cfg, optimizer)
    train_state = TrainState()
    tracker = _build_experiment_tracker(cfg, layout)
    loggers = RunLoggers(tracker)  # TensorBoard and W&B join after the resume (they need its step)
    register(stack, "run loggers", loggers.finish, with_status=True)
    ckpt = CheckpointManager(
        cfg.checkpoint, layout, run_config=cfg.to_dict(), listeners=[loggers.log_checkpoint],
        pretrained_source=functools.partial(pretrained_root, cfg),  # a Hugging Face directory is imported
    )
    # Closed before the mlflow run ends (the final save's listener logs to it) and before the
    # process groups go away; with an error of this rank's own in flight, without collectives.
    register(stack, "checkpoint manager", ckpt.close, with_error=True)
    objs = TrainingObjects(model=model, optimizer=optimizer, scheduler=scheduler, train_state=train_state)
    resume_info = ckpt.resume(objs)
    if resume_info is not None:
        _report_schedule(scheduler)
    _start_loggers(cfg, layout, loggers, tracker, train_state, resume_info)
    # The DataLoaders draw their seeds from their own generator (data.samplers), so building them
    # leaves the restored RNG state untouched: dropout after a resume matches an uninterrupted run.
    train_it, valid_it = _build_iterators(cfg, tokenizer, layout, train_state)
    straggler = None
    if cfg.straggler is not None:
        from tierstack.resiliency.straggler import StragglerMonitor

        straggler = StragglerMonitor(cfg.straggler, layout)
        register(stack, "straggler monitor", straggler.close)
    return SetupOutput(
        config=cfg,
        layout=layout,
        tokenizer=tokenizer,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_state=train_state,
        train_data_iterator=train_it,
        valid_data_iterator=valid_it,
        checkpoint_manager=ckpt,
        resume_info=resume_info,
        straggler=straggler,
        experiment_tracker=tracker,
        padded_vocab_size=provider.padded_vocab_size,  # type: ignore[attr-defined]
        loggers=loggers,
    )


def _build_experiment_tracker(cfg: ConfigContainer, layout: runtime.ParallelLayout) -> "Optional[ExperimentTracker]":
    """Collective: the mlflow tracker (rank 0 opens the store); a store that cannot be opened stops
    every rank alike (:func:`_tracker_agreed`)."""
    if cfg.mlflow is None:
        return None
    from tierstack.observability.experiment_tracker import ExperimentTracker

    return _tracker_agreed(cfg, lambda: ExperimentTracker(cfg.mlflow, cfg.logger.run_dir, layout.rank))


def _tracker_agreed(cfg: ConfigContainer, fn):
    """Collective: ``fn()`` (mlflow work on rank 0); when it raises, every rank raises one
    :class:`BadInputError` naming the tracking store, its root cause (e.g. sqlite's "database or disk
    is full" under ``logger.run_dir``) and the fix, instead of rank 0's library traceback while the
    other ranks wait for it."""
    try:
        out, problem = fn(), None
    except Exception as e:  # noqa: BLE001 - mlflow, sqlalchemy, OSError: all mean the store is unusable
        root = root_cause(e)
        uri = cfg.mlflow.tracking_uri or f"sqlite:///{Path(cfg.logger.run_dir).resolve() / 'mlflow.db'}"
        why = (str(root).splitlines() or [repr(root)])[0]
        out, problem = None, (f"mlflow: the tracking store {uri} cannot be used ({type(root).__name__}: "
                              f"{why}); free space there, set "
                              "mlflow.tracking_uri to another store, or mlflow=null to train without mlflow")
    problem = collectives.broadcast_object(problem)
    if problem is not None:
        raise BadInputError(problem)
    return out


def _start_loggers(cfg: ConfigContainer, layout: runtime.ParallelLayout, loggers, tracker, train_state: TrainState,
                   resume_info) -> None:
    """Collective, after the resume: continue (or open) the mlflow run, then add TensorBoard
    (``logger.tensorboard_dir``) and W&B (section ``wandb``) to ``loggers``, continuing the curves of
    the run resumed at ``train_state.step`` (0: a fresh start)."""
    if tracker is not None:
        run_id = _tracker_agreed(cfg, lambda: tracker.start(
            cfg.flat_params(),
            resume_run_id=train_state.experiment_run_id,
            resume_step=resume_info.step if resume_info is not None else None,
        ))
        train_state.experiment_run_id = collectives.broadcast_object(run_id, src=0)  # rank 0 talks to mlflow
    resume_step = train_state.step
    tb_dir = cfg.logger.tensorboard_path()
    if tb_dir is not None:
        from tierstack.observability.tensorboard_logger import TensorBoardLogger

        try:  # rank 0 writes the event file at once: a full disk must not stop the run for its curves
            loggers.add(TensorBoardLogger(tb_dir, layout.rank, resume_step=resume_step, config=cfg.to_dict()))
        except OSError as e:
            log.warning("TensorBoard is off for this run: %s cannot be written (%s); mlflow and metrics.jsonl "
                        "go on (free space there, or set logger.tensorboard_dir elsewhere)", tb_dir, e)
    if cfg.wandb is not None:
        from tierstack.observability.wandb_logger import WandbLogger

        loggers.add(WandbLogger(cfg.wandb, cfg.logger.run_dir, layout.rank, resume_step=resume_step,
                                config=cfg.to_dict()))
