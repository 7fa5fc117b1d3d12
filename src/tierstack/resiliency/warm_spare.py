"""Warm spares: what a spare rank does before any failure, so that taking a rank costs little.

A spare of in-process restart (:mod:`tierstack.resiliency.in_process`) waits for a rank. Two
things make its first set-up after a failure as quick as a healthy rank's re-set-up: the imports
are done in the rank slot before the fork (:func:`warm_imports`, every rank shares them), and the
spare rehearses set-up and one step on a private 1-rank world when the job starts (:func:`warm_up`).
Measured on 2 CPU ranks: a kill's fail -> first step went from 2.7 s to 1.0 s with the rehearsal.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import time
from typing import Any, Callable

from tierstack.config import ConfigContainer

log = logging.getLogger(__name__)

_WARM_MODULES = (  # what set-up and the first step import on their way (a spare's first set-up is on the clock)
    "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
    "megatron.core.distributed", "megatron.core.dist_checkpointing", "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict", "nvidia_resiliency_ext.inprocess",
    "tierstack.checkpointing", "tierstack.checkpointing.local_tier", "tierstack.checkpointing.global_tier",
    "tierstack.data.datasets", "tierstack.data.samplers", "tierstack.data.tokenizers", "tierstack.models.gpt",
    "tierstack.observability.run_loggers", "tierstack.observability.console", "tierstack.observability.history",
    # the loss curve's plotting modules: imported here, an import is never cut in half by NVRx's
    # interruption of an attempt (a half-imported matplotlib failed every later plot of the job)
    "tierstack.observability.plots", "matplotlib.backends.backend_agg", "matplotlib.figure",
    "tierstack.resiliency.restarts", "tierstack.hf.pretrained", "tierstack.training.optim",
    "tierstack.training.forward", "tierstack.training.setup", "tierstack.training.train",
)


def warm_imports() -> None:
    """What set-up imports, imported once in the slot before the fork: a spare starts warm."""
    import importlib

    for name in _WARM_MODULES:
        importlib.import_module(name)  # by name: resiliency never imports training (imports go downwards)

    # Everything imported so far lives as long as the process: out of the collector's sight, so
    # the full collections NVRx runs before each restart (``while gc.collect()``) stay short.
    gc.collect()
    gc.freeze()


_FIRST_USE_MODULES = (  # imported lazily by the first set-up, steps and saves (found by diffing sys.modules)
    "torch._dynamo", "numpy.fft", "megatron.core.models.mimo",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader",
    "tierstack.observability.tensorboard_logger", "tierstack.training.closers", "tierstack.training.reporting",
    "tierstack.training.pretrain", "torch.profiler._cupti_monitor", "torch.utils.serialization",
    "megatron.core.datasets.helpers", "tierstack.resiliency.heartbeat",
    # the loss curve's first PNG: Pillow's image plugins (PIL.Image.preinit)
    "PIL.BmpImagePlugin", "PIL.GifImagePlugin", "PIL.JpegImagePlugin", "PIL.PpmImagePlugin", "PIL.PngImagePlugin",
)


def import_first_use_modules() -> float:
    """Import, in the rank's own process before NVRx's wrapper exists, what the first attempt would
    import lazily on its way; returns the seconds it took (about 0.5 s here, mostly torch._dynamo).

    Why: NVRx interrupts an attempt by raising in the main thread wherever it is. An import cut in
    half leaves its package without the attribute (``sympy.core``, ``torch._dynamo.utils``) and
    every later attempt of the process then fails the same way (a break-it pass: a spare killed
    while the ranks set up; reproduced by raising into ``import torch._dynamo`` at 0.2-1.0 s).
    Before the wrapper nothing interrupts. Not in the rank slot before the fork (with the imports
    of :func:`warm_imports`): tried there, a fresh clone's suite had an in-process launch that
    never ended, not understood; here each rank pays it once, as its first step did before.
    """
    import importlib

    t0 = time.perf_counter()
    for name in _FIRST_USE_MODULES:
        importlib.import_module(name)
    return time.perf_counter() - t0


_WARM_ENV = ("RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def warm_up(config: ConfigContainer, train: Callable[[ConfigContainer], Any]) -> float:
    """A spare's rehearsal: ``train`` on a private 1-rank world (no port; a temporary run directory
    that holds its checkpoints; no loggers; 1 step), so that what a process does the first time (lazy imports,
    first kernels and allocator pools, the data pipeline's first batch) is paid before any failure,
    not between a failure and the first step. Logged quietly; any error of it only means a cold
    spare (logged), never a failed job. Returns its seconds.
    """
    import logging as _logging
    import tempfile

    t0, failed = time.perf_counter(), None
    saved = {k: os.environ.pop(k) for k in _WARM_ENV if k in os.environ}
    _logging.disable(_logging.ERROR)  # a rehearsal: its own lines (a step, a save, a refusal) are not the run's
    try:
        with tempfile.TemporaryDirectory(prefix="tierstack-warm-") as tmp:
            rehearsal = copy.deepcopy(config)
            rehearsal.apply_overrides([
                f"logger.run_dir={tmp}", "logger.tensorboard_dir=null", "logger.loss_curve=false",
                "logger.progress_bar=false", "logger.rank_log_dir=null", f"checkpoint.save={tmp}/global",
                "checkpoint.load=null", "checkpoint.ckpt_step=null", f"checkpoint.local_dir={tmp}/local",
                "checkpoint.pretrained_checkpoint=null", "checkpoint.exit_on_missing_checkpoint=false",  # (resumes nothing)
                "checkpoint.replication_factor=1", "checkpoint.memory_save_interval=null",  # (in-process only)
                "checkpoint.memory_dir=null",
                "distributed.tensor_model_parallel_size=1", "distributed.pipeline_model_parallel_size=1",
                "train.train_iters=1", "train.eval_interval=null", "train.exit_interval=null",
                f"train.global_batch_size={config.train.micro_batch_size}", "mlflow=null", "wandb=null",
                "straggler=null", "resiliency.restart=launcher", "resiliency.spare_ranks=0",
            ])
            train(rehearsal)
    except Exception as e:  # noqa: BLE001 - a cold spare still works
        failed = e
    finally:
        _logging.disable(_logging.NOTSET)
        os.environ.update(saved)
        from tierstack.runtime import release_distributed

        release_distributed()
    seconds = time.perf_counter() - t0
    # which process: node and local rank (RANK says nothing here: NVRx sets it to "None" in a spare)
    who = f"spare (node {os.environ.get('GROUP_RANK', '0')}, local rank {saved.get('LOCAL_RANK', '?')}, pid {os.getpid()})"
    from tierstack.errors import BadInputError

    if isinstance(failed, BadInputError):  # the ranks refuse the same input, and rank 0 says why
        log.warning("%s: warm-up refused its input after %.2f s (%s; the ranks report it); it starts cold", who,
                    seconds, type(failed).__name__)
    elif failed is not None:  # said once logging is on again (it was off for the rehearsal's own lines)
        log.warning("%s: warm-up failed after %.2f s (%s: %s); it starts cold", who, seconds, type(failed).__name__, failed)
    else:
        log.info("%s: warmed up in %.2f s", who, seconds)
    return seconds
