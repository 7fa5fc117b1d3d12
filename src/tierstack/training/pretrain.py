"""``pretrain(config, forward_step_func)``: the lifecycle of a run, and nothing else."""

from __future__ import annotations

import contextlib
import logging
import os
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
        Any error of training or setup, re-raised after cleanup: in-flight checkpoint saves are
        completed (or cleanly aborted), the straggler monitor closed and the mlflow run finished
        before the process groups go away; a failing closer is logged and never hides that error.
    """
    from tierstack.training.reporting import configure_logging, run_reporters
    from tierstack.resiliency.heartbeat import Heartbeat
    from tierstack.resiliency.in_process import watch_steps
    from tierstack.resiliency.signals import ExitRequest
    from tierstack.training.forward import gpt_forward_step
    from tierstack.training.closers import register
    from tierstack.training.setup import setup
    from tierstack.training.train import train

    configure_logging(log_file=config.logger.rank_log_path(int(os.environ.get("RANK", "0"))))
    forward_step_func = forward_step_func or gpt_forward_step
    on_step = watch_steps(on_step)  # under in-process restart: its first step is logged with its time
    with contextlib.ExitStack() as closers:
        exit_request = ExitRequest(early_warning=config.train.exit_signal)
        register(closers, "signal handlers", exit_request.restore, with_error=True)
        heartbeat = Heartbeat.from_environment()  # under NVRx ft_launcher only: a hung rank gets restarted
        if heartbeat is not None:
            register(closers, "heartbeat", heartbeat.close)
            on_step = _beating(heartbeat, on_step)
        s = setup(config, closers=closers)  # registers every resource it starts on `closers`
        if heartbeat is not None:  # again, to close it first: a long final save is no hang
            register(closers, "heartbeat", heartbeat.close)
        with run_reporters(s) as (progress, history):
            return train(
                s, forward_step_func, exit_request=exit_request, history=history, progress=progress, on_step=on_step
            )


def _beating(heartbeat, on_step: Optional[Callable]) -> Callable:
    """``on_step`` preceded by one heartbeat to the rank monitor per iteration."""

    def step_done(train_state, result) -> None:
        heartbeat.beat()
        if on_step is not None:
            on_step(train_state, result)

    return step_done
