"""The training loop: steps, evaluation, logging, checkpoints and planned exits."""

from __future__ import annotations

import logging
import math
from typing import Callable, NamedTuple, Optional

from tierstack.observability.megatron_log import NAN_ITERS, SKIPPED_ITERS, tracker_metrics
from tierstack import runtime
from tierstack.observability.profiler import StepProfiler
from tierstack.observability.timers import CHECKPOINT, EVAL, PhaseTimers
from tierstack.resiliency import signals
from tierstack.resiliency.time_budget import REASON_PREFIX as BUDGET_REASON, TimeBudget
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
        by_rank = exit_request.reasons()  # the same list on every rank
        reasons = [r for r in by_rank if r]
        signals = [r for r in reasons if not r.startswith(BUDGET_REASON)]
        if signals or not reasons:  # a signal wins: it came from outside the job
            name = signals[0] if signals else "signal"
            ranks = ", ".join(str(r) for r, why in enumerate(by_rank) if why == name) or "some rank"
            _announce_planned_exit(s, f"received {name} on rank {ranks}")
            return f"{name} received on some rank"
        return reasons[0]  # the time budget, as the first rank whose clock said so saw it
    return None


def _announce_planned_exit(s: SetupOutput, what: str) -> None:
    """Rank 0, once the ranks agreed to stop on a signal: the checkpoint the planned exit saves now
    (announced here, not when the signal came: only ranks that reached this agreement can save)."""
    if s.layout.rank != 0:
        return
    tier = s.checkpoint_manager.final_tier()
    step = s.train_state.step
    if tier is None:
        log.warning("%s: stopping after iteration %d (no checkpoint tier is on)", what, step)
    else:
        log.warning("%s: saving a %s checkpoint of iteration %d, then stopping", what, tier.value.upper(), step)


class _Instruments(NamedTuple):
    """What the loop measures with: throughput, per-phase timers, the profiler window, the budget."""

    window: "_ThroughputWindow"
    timers: PhaseTimers
    profiler: StepProfiler
    budget: Optional[TimeBudget]


def _instruments(s: SetupOutput, flops_per_iter: float) -> _Instruments:
    cfg = s.config
    budget = TimeBudget(cfg.train.exit_duration_in_mins) if cfg.train.exit_duration_in_mins else None
    return _Instruments(
        window=_ThroughputWindow(flops_per_iter / s.layout.world_size),
        timers=PhaseTimers(enabled=cfg.logger.timers),
        profiler=StepProfiler(cfg.profile, cfg.logger.run_dir, s.layout.rank),
        budget=budget,
    )


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
    resume, evaluations, the last step) to the console, the history and every run logger (with the
    per-phase timers), then LOCAL/GLOBAL saves by interval (the checkpoint
    manager decides; a validation is proposed to it as a top-K best candidate first, so that with
    ``checkpoint.save_on_best`` the GLOBAL save of that step follows at once). Each step's result
    goes to the manager's non-finite guard before anything else reads the step. A planned stop
    (exit_interval, SIGTERM, straggler, ``train.exit_duration_in_mins``) skips the interval saves
    and ends with the final save: the last state is always kept, in GLOBAL when configured.

    ``on_step(train_state, step_result)`` is called on every rank after each step (before
    checkpoints), e.g. to record per-rank losses.

    Returns:
        The final :class:`TrainState`.
    """
    from tierstack.checkpointing import TrainingObjects

    cfg, ts = s.config, s.train_state
    if ts.step >= cfg.train.train_iters:
        log.info(
            "nothing to do: resumed at iteration %d and train.train_iters=%d; raise train.train_iters to go on",
            ts.step,
            cfg.train.train_iters,
        )
        return ts
    objs = TrainingObjects(model=s.model, optimizer=s.optimizer, scheduler=s.scheduler, train_state=ts)
    flops_per_iter = _flops_per_iteration(s)
    inst = _instruments(s, flops_per_iter)
    if inst.budget is not None and exit_request is None:
        from tierstack.resiliency.signals import ExitRequest

        exit_request = ExitRequest(signals=())  # the ranks agree on the budget's stop through it
    step_forward = inst.timers.wrap_forward(_forward_for(s, forward_step_func))
    train_it = inst.timers.timed(s.train_data_iterator)
    start_step, stop = ts.step, None
    try:
        while ts.step < cfg.train.train_iters:
            result = _one_step(s, step_forward, train_it, inst)
            _count(ts, cfg, result, flops_per_iter)
            s.checkpoint_manager.observe_step(objs, result)  # non-finite guard: this rank's flag for the step
            if on_step is not None:
                on_step(ts, result)
            straggler_stop = _after_step(s, forward_step_func, objs, result, inst, start_step, progress, history)
            _check_budget(s, inst, exit_request)
            stop = _stop_reason(s, exit_request, straggler_stop)
            if stop:
                break
            with inst.timers.phase(CHECKPOINT):
                s.checkpoint_manager.maybe_save(objs)
            inst.profiler.step_end(ts.step)  # the whole iteration: step, eval, log line, saves
    finally:
        inst.profiler.close()  # a run that stops inside the window still writes its files
    with runtime.nvtx_range("checkpoint_final"):
        kept = s.checkpoint_manager.save_final(objs)  # the last state is always kept (GLOBAL when configured)
    if stop:
        log.warning("stopping at iteration %d: %s", ts.step, stop)
        s.loggers.set_tag("stop_reason", stop)
        if kept:  # an in-process restart after this stop must not train on (resiliency.in_process)
            signals.note_served(stop)
    return ts


def _flops_per_iteration(s: SetupOutput) -> float:
    m = s.config.model
    return model_flops_per_iteration(
        global_batch_size=s.config.train.global_batch_size, seq_length=m.seq_length, num_layers=m.num_layers,
        hidden_size=m.hidden_size, vocab_size=s.padded_vocab_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size,
        gated_linear_unit=m.gated_linear_unit,
    )


def _forward_for(s: SetupOutput, forward_step_func: Callable) -> Callable:
    if s.straggler is None:
        return forward_step_func
    # The whole step ends in a gradient all-reduce where a fast rank waits for a slow one, so
    # step time alone hides a straggler on CPU; the forward step has no such wait.
    return s.straggler.wrap_forward_step(forward_step_func)


def _one_step(s: SetupOutput, step_forward: Callable, train_it, inst: _Instruments):
    """One training step; the profiler window opens before the first step it covers (the loop
    closes it after the last one's saves)."""
    inst.profiler.step_begin(s.train_state.step + 1)
    result = _run_step(s, step_forward, batch_shape(s), train_it, inst.timers)
    inst.window.add(result)
    return result


def _after_step(s: SetupOutput, forward_step_func, objs, result, inst: _Instruments, start_step: int,
                progress, history) -> Optional[str]:
    """Evaluation, straggler report and the log line of the step just counted; returns a
    straggler stop reason, if any."""
    cfg, step = s.config, s.train_state.step
    metrics = {"loss": result.loss, "lr": _current_lr(s.optimizer), "grad_norm": result.grad_norm}
    if cfg.train.eval_interval and s.valid_data_iterator is not None and step % cfg.train.eval_interval == 0:
        with inst.timers.phase(EVAL):
            metrics["val_loss"] = evaluate(
                forward_step_func, s.valid_data_iterator, s.model, batch_shape(s), cfg.train.eval_iters)
        s.train_state.consumed_valid_samples += cfg.train.eval_iters * cfg.train.global_batch_size
        s.checkpoint_manager.propose_best(objs, metrics)  # a top-K candidate; saved (and committed) below
    straggler_stop = _straggler_report(s, step, metrics)
    first_of_run = step == start_step + 1  # shows where a run (or a resume) starts
    if first_of_run or step % cfg.logger.log_interval == 0 or step == cfg.train.train_iters or "val_loss" in metrics:
        metrics.update(inst.window.take())
        # collective (every rank logs at the same steps); memory: the largest over ranks, and which
        metrics.update(inst.timers.take(per_rank=runtime.memory_report()) or runtime.memory_report())
        metrics.update(_checkpoint_metrics(s))
        _publish_metrics(s, step, metrics, progress, history)
    elif progress is not None:
        progress.advance(step)
    return straggler_stop


def _check_budget(s: SetupOutput, inst: _Instruments, exit_request) -> None:
    """Ask for a planned exit when the next step and the final save would pass the time budget."""
    if inst.budget is None or exit_request.reason is not None:
        return
    next_step_s = inst.window.last_step_s
    if inst.budget.would_pass(next_step_s, final_save_estimate_s(s.checkpoint_manager) + EXIT_RESERVE_S):
        exit_request.request(inst.budget.reason())


# GLOBAL saves of the same state took up to 1.43x their median on this project's benchmark machine
# (README, "GLOBAL against torch.distributed.checkpoint": the spread between blocks)
FINAL_SAVE_MARGIN = 1.5
# After the final save the run still closes (trackers, the loss curve, the process groups) before
# it exits: about 1 s for the default recipe here (`make pretrain`: GLOBAL published at 17:10:35,
# mlflow's run FINISHED at 17:10:36, 2026-12-04). The budget is for the job, not for the save.
EXIT_RESERVE_S = 2.0


def final_save_estimate_s(manager) -> float:
    """Seconds the planned exit's final save is expected to take until it is durable: the last
    finalized save of the tier it goes to (``CheckpointManager.final_tier``, GLOBAL when
    configured), from its start to its sealed/published agreement (which covers the time it
    blocked), times :data:`FINAL_SAVE_MARGIN`; 0.0 before that tier has finalized a save.

    Not the blocked time alone, as before: an async save blocks the loop for a fraction of a second
    and is durable seconds later, and the final save is waited for until it is durable; and with no
    margin a sync run stopped by ``train.exit_duration_in_mins`` published its last checkpoint
    after the budget in CI (``test_exit_duration``: 0.06 s late on 75 s, counted from the test's
    start).
    """
    tier = manager.final_tier()
    durable = None if tier is None else manager.last_durable_s(tier)
    return 0.0 if durable is None else FINAL_SAVE_MARGIN * durable


def _checkpoint_metrics(s: SetupOutput) -> dict:
    """``checkpoint/<tier>_durable_s`` and ``checkpoint/<tier>_blocked_s``: the last finalized save's
    time to its sealed agreement and the time it blocked the loop, per tier (seconds)."""
    from tierstack.checkpointing import CheckpointTier

    out = {}
    for tier in CheckpointTier:
        try:
            durable = s.checkpoint_manager.last_durable_s(tier)
        except KeyError:  # the tier is off
            continue
        if durable is not None:
            out[f"checkpoint/{tier.value}_durable_s"] = durable
        blocked = s.checkpoint_manager.last_blocked_s(tier)
        if blocked is not None:
            out[f"checkpoint/{tier.value}_blocked_s"] = blocked
    return out


class _ThroughputWindow:
    """Tokens and seconds since the last log line: tokens/s, mean step time and TFLOP/s per rank."""

    def __init__(self, flops_per_rank_per_iter: float = 0.0) -> None:
        self.seconds, self.tokens, self.steps = 0.0, 0, 0
        self.skipped, self.nan = 0, 0  # iterations whose update was skipped / whose loss was not finite
        self.last_step_s = 0.0
        self.flops_per_rank_per_iter = flops_per_rank_per_iter  # model FLOPs of one iteration / world size

    def add(self, result) -> None:
        self.last_step_s = result.seconds  # seconds of the latest step (the time budget's estimate)
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


def _run_step(s: SetupOutput, forward_step_func: Callable, shape: BatchShape, data_iterator, timers):
    args = (forward_step_func, data_iterator, s.model, s.optimizer, s.scheduler, shape, timers)
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
    s.loggers.log_metrics(step, tracker_metrics(s.config.logger.format, metrics, s.config.train.global_batch_size))


def _current_lr(optimizer) -> float:
    for group in optimizer.param_groups:
        return float(group["lr"])
    return math.nan
