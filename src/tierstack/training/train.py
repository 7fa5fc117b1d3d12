"""The training loop: steps, evaluation, logging, checkpoints and planned exits."""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional

from tierstack.observability.megatron_log import NAN_ITERS, SKIPPED_ITERS, tracker_metrics
from tierstack.training.loop import BatchShape, evaluate, model_flops_per_iteration, train_step
from tierstack.training.setup import SetupOutput
from tierstack.train_state import TrainState

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

    Every rank runs this. After each step: evaluation by ``train.eval_interval``, the straggler
    report by its interval, a log line (every ``logger.log_interval``, the first step of a run or
    resume, evaluations, the last step), then LOCAL/GLOBAL saves by interval (the checkpoint
    manager decides; a validation is proposed to it as a top-K best candidate first, so that with
    ``checkpoint.save_on_best`` the GLOBAL save of that step follows at once). Each step's result
    goes to the manager's non-finite guard before anything else reads the step. A planned stop (exit_interval, SIGTERM, straggler) skips the interval saves
    and ends with the final save: the last state is always kept, in GLOBAL when configured.

    ``on_step(train_state, step_result)`` is called on every rank after each step (before
    checkpoints), e.g. to record per-rank losses.

    Returns:
        The final :class:`TrainState`.
    """
    from tierstack.checkpointing import TrainingObjects

    cfg, ts = s.config, s.train_state
    objs = TrainingObjects(model=s.model, optimizer=s.optimizer, scheduler=s.scheduler, train_state=ts)
    if ts.step >= cfg.train.train_iters:
        log.info(
            "nothing to do: resumed at iteration %d and train.train_iters=%d; raise train.train_iters to go on",
            ts.step,
            cfg.train.train_iters,
        )
        return ts
    step_forward = forward_step_func
    if s.straggler is not None:
        # The whole step ends in a gradient all-reduce where a fast rank waits for a slow one, so
        # step time alone hides a straggler on CPU; the forward step has no such wait.
        step_forward = s.straggler.wrap_forward_step(forward_step_func)
    m = cfg.model
    flops_per_iter = model_flops_per_iteration(
        global_batch_size=cfg.train.global_batch_size, seq_length=m.seq_length, num_layers=m.num_layers,
        hidden_size=m.hidden_size, vocab_size=s.padded_vocab_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size,
        gated_linear_unit=m.gated_linear_unit,
    )
    shape = batch_shape(s)
    window = _ThroughputWindow(flops_per_iter / s.layout.world_size)
    start_step = ts.step
    stop: Optional[str] = None
    while ts.step < cfg.train.train_iters:
        result = _run_step(s, step_forward, shape)
        _count(ts, cfg, result, flops_per_iter)
        s.checkpoint_manager.observe_step(objs, result)  # non-finite guard: this rank's flag for the step
        if on_step is not None:
            on_step(ts, result)
        window.add(result)
        metrics = {"loss": result.loss, "lr": _current_lr(s.optimizer), "grad_norm": result.grad_norm}
        if cfg.train.eval_interval and s.valid_data_iterator is not None and ts.step % cfg.train.eval_interval == 0:
            metrics["val_loss"] = evaluate(forward_step_func, s.valid_data_iterator, s.model, shape, cfg.train.eval_iters)
            ts.consumed_valid_samples += cfg.train.eval_iters * cfg.train.global_batch_size
            s.checkpoint_manager.propose_best(objs, metrics)  # a top-K candidate; saved (and committed) below
        straggler_stop = _straggler_report(s, ts.step, metrics)
        first_of_run = ts.step == start_step + 1  # shows where a run (or a resume) starts
        if first_of_run or ts.step % cfg.logger.log_interval == 0 or ts.step == cfg.train.train_iters or "val_loss" in metrics:
            metrics.update(window.take())
            _publish_metrics(s, ts.step, metrics, progress, history)
        elif progress is not None:
            progress.advance(ts.step)
        stop = _stop_reason(s, exit_request, straggler_stop)
        if stop:
            break
        s.checkpoint_manager.maybe_save(objs)
    s.checkpoint_manager.save_final(objs)  # the last state is always kept (GLOBAL when configured)
    if stop:
        log.warning("stopping at iteration %d: %s", ts.step, stop)
        if s.experiment_tracker is not None:
            s.experiment_tracker.set_tag("stop_reason", stop)
    return ts


class _ThroughputWindow:
    """Tokens and seconds since the last log line: tokens/s, mean step time and TFLOP/s per rank."""

    def __init__(self, flops_per_rank_per_iter: float = 0.0) -> None:
        self.seconds, self.tokens, self.steps = 0.0, 0, 0
        self.skipped, self.nan = 0, 0  # iterations whose update was skipped / whose loss was not finite
        self.flops_per_rank_per_iter = flops_per_rank_per_iter  # model FLOPs of one iteration / world size

    def add(self, result) -> None:
        self.seconds += result.seconds
        self.tokens += result.tokens
        self.steps += 1
        self.skipped += not result.update_successful
        self.nan += not math.isfinite(result.loss)

    def take(self) -> dict:
        out = {
            "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else math.nan,
            "step_time_s": self.seconds / self.steps if self.steps else math.nan,
            # Model FLOPs per second per rank, in TFLOP/s (model_flops_per_iteration / world size).
            "tflops_per_rank": self.flops_per_rank_per_iter * self.steps / self.seconds / 1e12
            if self.seconds > 0 else math.nan,
        }
        # the counts only when there are any: the default line stays as it was on a clean interval
        out.update({k: n for k, n in ((SKIPPED_ITERS, self.skipped), (NAN_ITERS, self.nan)) if n})
        self.seconds, self.tokens, self.steps = 0.0, 0, 0
        self.skipped, self.nan = 0, 0
        return out


def batch_shape(s: SetupOutput) -> BatchShape:
    """The step sizes of this run: the train section's batch sizes, the model's sequence length, DP."""
    t = s.config.train
    return BatchShape(
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        seq_length=s.config.model.seq_length,
        data_parallel_size=s.layout.data_parallel_size,
    )


def _run_step(s: SetupOutput, forward_step_func: Callable, shape: BatchShape):
    args = (forward_step_func, s.train_data_iterator, s.model, s.optimizer, s.scheduler, shape)
    if s.straggler is None:
        return train_step(*args)
    with s.straggler.step_section():
        return train_step(*args)


def _count(ts: TrainState, cfg, result, flops_per_iter: float) -> None:
    ts.step += 1
    ts.consumed_train_samples += cfg.train.global_batch_size
    if not result.update_successful:
        ts.skipped_train_samples += cfg.train.global_batch_size
        log.warning("iteration %d: optimizer skipped the update (non-finite gradients)", ts.step)
    ts.floating_point_operations_so_far += flops_per_iter


def _straggler_report(s: SetupOutput, step: int, metrics: dict) -> Optional[str]:
    """Collective at report intervals; returns a stop reason when stragglers must stop the run."""
    if s.straggler is None:
        return None
    report = s.straggler.maybe_report(step)
    if report is None:
        return None
    metrics.update(report.metrics)
    if not report.should_stop:
        return None
    return "straggler detected on rank(s) " + ", ".join(f"{r} ({node})" for r, node in report.stragglers)


def _publish_metrics(s: SetupOutput, step: int, metrics: dict, progress, history) -> None:
    if progress is not None:
        progress.log_step(step, metrics)
    if history is not None:
        history.append(step, metrics)
    if s.experiment_tracker is not None:  # logger.format=megatron: Megatron-LM's metric names
        s.experiment_tracker.log_metrics(step, tracker_metrics(s.config.logger.format, metrics,
                                                               s.config.train.global_batch_size))


def _current_lr(optimizer) -> float:
    for group in optimizer.param_groups:
        return float(group["lr"])
    return math.nan
