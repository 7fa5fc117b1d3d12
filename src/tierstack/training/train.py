"""The training loop: steps, evaluation, logging, checkpoints and planned exits."""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional

from tierstack.training.loop import evaluate, model_flops_per_iteration, train_step
from tierstack.training.setup import SetupOutput
from tierstack.training.state import TrainState

log = logging.getLogger(__name__)


def _stop_reason(s: SetupOutput, exit_request, straggler_stop: Optional[str]) -> Optional[str]:
    cfg, ts = s.config, s.train_state
    if straggler_stop:
        return straggler_stop
    if cfg.train.exit_interval and ts.step % cfg.train.exit_interval == 0:
        return f"train.exit_interval={cfg.train.exit_interval} reached at iteration {ts.step}"
    if exit_request is not None and exit_request.agreed():
        return f"{exit_request.reason or 'signal'} received on some rank"
    return None


def train(
    s: SetupOutput,
    forward_step_func: Callable,
    exit_request=None,
    history=None,
    progress=None,
    on_step: Optional[Callable] = None,
) -> TrainState:
    """Run iterations until ``train.train_iters`` (or an early, planned stop).

    Every rank runs this. After each step: LOCAL/GLOBAL saves by interval (the checkpoint manager
    decides), evaluation by ``train.eval_interval``, a log line by ``logger.log_interval``, the
    straggler report by its interval. A planned stop (exit_interval, SIGTERM, straggler) saves a
    GLOBAL checkpoint first; the end of training saves a GLOBAL checkpoint unless one was just taken.

    ``on_step(train_state, step_result)`` is called on every rank after each step (before
    checkpoints), e.g. to record per-rank losses.

    Returns:
        The final :class:`TrainState`.
    """
    from tierstack.checkpointing import CheckpointTier, TrainingObjects

    cfg, ts, layout = s.config, s.train_state, s.layout
    objs = TrainingObjects(model=s.model, optimizer=s.optimizer, scheduler=s.scheduler, train_state=ts, config=cfg)
    flops_per_iter = model_flops_per_iteration(cfg, s.padded_vocab_size)
    if ts.step >= cfg.train.train_iters:
        log.info(
            "nothing to do: resumed at iteration %d and train.train_iters=%d; raise train.train_iters to go on",
            ts.step,
            cfg.train.train_iters,
        )
        return ts
    if s.straggler is not None:
        # The whole step ends in a gradient all-reduce where a fast rank waits for a slow one, so
        # step time alone hides a straggler on CPU; the forward step has no such wait.
        forward_step_func = s.straggler.wrap_forward_step(forward_step_func)
    window_time, window_tokens = 0.0, 0
    start_step = ts.step
    stop: Optional[str] = None
    while ts.step < cfg.train.train_iters:
        if s.straggler is not None:
            with s.straggler.step_section():
                result = train_step(forward_step_func, s.train_data_iterator, s.model, s.optimizer, s.scheduler, cfg, layout.data_parallel_size)
        else:
            result = train_step(forward_step_func, s.train_data_iterator, s.model, s.optimizer, s.scheduler, cfg, layout.data_parallel_size)
        ts.step += 1
        ts.consumed_train_samples += cfg.train.global_batch_size
        if not result.update_successful:
            ts.skipped_train_samples += cfg.train.global_batch_size
            log.warning("iteration %d: optimizer skipped the update (non-finite gradients)", ts.step)
        ts.floating_point_operations_so_far += flops_per_iter
        if on_step is not None:
            on_step(ts, result)
        window_time += result.seconds
        window_tokens += result.tokens

        metrics = {"loss": result.loss, "lr": _current_lr(s.optimizer), "grad_norm": result.grad_norm}
        if cfg.train.eval_interval and s.valid_data_iterator is not None and ts.step % cfg.train.eval_interval == 0:
            metrics["val_loss"] = evaluate(forward_step_func, s.valid_data_iterator, s.model, cfg, layout.data_parallel_size)
            ts.consumed_valid_samples += cfg.train.eval_iters * cfg.train.global_batch_size

        straggler_stop = None
        if s.straggler is not None:
            report = s.straggler.maybe_report(ts.step)
            if report is not None:
                metrics.update(report.metrics)
                if report.should_stop:
                    straggler_stop = "straggler detected on rank(s) " + ", ".join(
                        f"{r} ({node})" for r, node in report.stragglers
                    )

        first_of_run = ts.step == start_step + 1  # shows where a run (or a resume) starts
        if first_of_run or ts.step % cfg.logger.log_interval == 0 or ts.step == cfg.train.train_iters or "val_loss" in metrics:
            metrics["tokens_per_s"] = window_tokens / window_time if window_time > 0 else math.nan
            metrics["step_time_s"] = window_time / max(1, round(window_tokens / result.tokens))
            window_time, window_tokens = 0.0, 0
            if progress is not None:
                progress.log_step(ts.step, metrics)
            if history is not None:
                history.append(ts.step, metrics)
            if s.tracker is not None:
                s.tracker.log_metrics(ts.step, metrics)
        elif progress is not None:
            progress.advance(ts.step)

        stop = _stop_reason(s, exit_request, straggler_stop)
        if stop:
            break
        s.checkpoint_manager.maybe_save(objs)

    # The last state is always kept: in GLOBAL when it is configured (it survives the node), else LOCAL.
    final_tier = CheckpointTier.GLOBAL if cfg.checkpoint.save is not None else (
        CheckpointTier.LOCAL if cfg.checkpoint.local_dir is not None else None
    )
    if final_tier is not None and s.checkpoint_manager.last_saved_step(final_tier) != ts.step:
        s.checkpoint_manager.save(final_tier, objs)
    if stop:
        log.warning("stopping at iteration %d: %s", ts.step, stop)
        if s.tracker is not None:
            s.tracker.set_tag("stop_reason", stop)
    return ts


def _current_lr(optimizer) -> float:
    for group in optimizer.param_groups:
        return float(group["lr"])
    return math.nan
