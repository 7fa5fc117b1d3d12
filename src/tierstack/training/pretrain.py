"""``pretrain(config, forward_step_func)``: the lifecycle of a run, and nothing else."""

from __future__ import annotations

import logging
from typing import Callable, Optional

from tierstack.config import ConfigContainer
from tierstack.train_state import TrainState

log = logging.getLogger(__name__)


def pretrain(
    config: ConfigContainer,
    forward_step_func: Optional[Callable] = None,
    on_step: Optional[Callable] = None,
) -> TrainState:
    """Set up, train, and always clean up: async checkpoint writers, trackers, process groups.

    Args:
        config: the run config; validated before any rank does work.
        forward_step_func: megatron-core ``forward_step(data_iterator, model) -> (output,
            loss_func)``; default :func:`tierstack.training.forward.gpt_forward_step`.

    Returns:
        The final :class:`TrainState` (same on every rank).

    Raises:
        ConfigError: invalid config (nothing started yet).
        Any error of training, re-raised after cleanup; in-flight checkpoint saves are completed
        (or cleanly aborted) before the process groups go away.
    """
    from tierstack import runtime
    from tierstack.training.reporting import configure_logging, run_reporters
    from tierstack.resiliency.signals import ExitRequest
    from tierstack.training.forward import gpt_forward_step
    from tierstack.training.setup import setup
    from tierstack.training.train import train

    configure_logging()
    forward_step_func = forward_step_func or gpt_forward_step
    exit_request = ExitRequest()
    s = None
    status = "FAILED"
    try:
        s = setup(config)
        with run_reporters(s) as (progress, history):
            state = train(
                s, forward_step_func, exit_request=exit_request, history=history, progress=progress, on_step=on_step
            )
        status = "FINISHED"
        return state
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        exit_request.restore()
        try:
            if s is not None:
                s.checkpoint_manager.close()  # never exit while a save is in flight
                if s.straggler is not None:
                    s.straggler.close()
                if s.experiment_tracker is not None:
                    s.experiment_tracker.finish(status)
        finally:
            runtime.destroy_distributed()
