"""Model wrapping (megatron DDP), optimizer and LR schedule, all from megatron-core."""

from __future__ import annotations

from typing import Callable

import torch

from tierstack.checkpointing.scheduler_state import load_scheduler_state, scheduler_state  # noqa: F401 - re-exported
from tierstack.config import ConfigContainer


def build_model(cfg: ConfigContainer, provider: Callable[..., torch.nn.Module]) -> list[torch.nn.Module]:
    """Build this rank's pipeline stage and wrap it in megatron-core ``DistributedDataParallel``.

    Returns:
        A list with one model chunk (virtual pipeline stages are not used), on
        :func:`tierstack.runtime.device`, fp32 or bf16 per ``model.bf16``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from tierstack import runtime

    model = provider(
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    model.to(runtime.device())
    tcfg = provider.transformer_config  # type: ignore[attr-defined]
    if cfg.model.bf16:
        model = Float16Module(tcfg, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # our non-finite guard (checkpointing/nonfinite_guard.py) owns it
    )
    ddp = DistributedDataParallel(config=tcfg, ddp_config=ddp_config, module=model)
    # Parameters are initialised per TP rank from the tracker seed; DP replicas must agree exactly.
    ddp.broadcast_params()
    return [ddp]


def build_optimizer(cfg: ConfigContainer, model: list[torch.nn.Module]):
    """Adam via megatron-core ``get_megatron_optimizer`` (a ``ChainedOptimizer`` on 0.16).

    Gradient clipping by global norm ``optimizer.clip_grad`` (0 disables) is applied inside
    ``optimizer.step()``, which returns ``(update_successful, grad_norm, num_zeros)``.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = cfg.optimizer
    ocfg = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=cfg.model.bf16,
        params_dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32,
        use_distributed_optimizer=o.use_distributed_optimizer,
    )
    return get_megatron_optimizer(ocfg, model)


def build_scheduler(cfg: ConfigContainer, optimizer):
    """megatron-core ``OptimizerParamScheduler``; steps are counted in iterations (``step(1)``).

    Warmup is linear over ``scheduler.lr_warmup_iters`` from 0 to ``optimizer.lr``, then the decay
    style over ``lr_decay_iters`` (default ``train.train_iters``) down to ``optimizer.min_lr``.
    At resume the checkpoint's schedule is kept unless ``scheduler.override_opt_param_scheduler``;
    the values this config implies are kept on the scheduler for :func:`schedule_changes`.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s, o = cfg.scheduler, cfg.optimizer
    decay_iters = s.lr_decay_iters or cfg.train.train_iters
    start_wd = o.weight_decay if s.start_weight_decay is None else s.start_weight_decay
    end_wd = o.weight_decay if s.end_weight_decay is None else s.end_weight_decay
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=s.lr_warmup_iters,
        lr_decay_steps=max(decay_iters, s.lr_warmup_iters + 1),
        lr_decay_style=s.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=cfg.train.train_iters,
        wd_incr_style="constant" if start_wd == end_wd else "linear",
        use_checkpoint_opt_param_scheduler=not s.override_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
        wsd_decay_steps=max(1, decay_iters // 10) if s.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style="cosine" if s.lr_decay_style == "WSD" else None,
    )
    scheduler.tierstack_configured = _schedule_values(scheduler)
    # the peak and floor LR of each param group as this config sets them: get_lr reads the group's
    # max_lr/min_lr first, and loading the optimizer's state brings back the checkpoint's
    scheduler.tierstack_configured_groups = [(g.get("max_lr"), g.get("min_lr")) for g in optimizer.param_groups]
    return scheduler


# what a resume can take from the checkpoint: (attribute of OptimizerParamScheduler, what it is in this config)
_SCHEDULE_FIELDS = (
    ("max_lr", "optimizer.lr"),
    ("min_lr", "optimizer.min_lr"),
    ("lr_warmup_steps", "scheduler.lr_warmup_iters"),
    ("lr_decay_steps", "scheduler.lr_decay_iters (default train.train_iters)"),
    ("lr_decay_style", "scheduler.lr_decay_style"),
    ("start_wd", "scheduler.start_weight_decay"),
    ("end_wd", "scheduler.end_weight_decay"),
    ("wd_incr_steps", "train.train_iters (weight decay steps)"),
    ("wsd_decay_steps", "WSD anneal steps (lr_decay_iters // 10)"),
)


def _schedule_values(scheduler) -> dict:
    return {attr: getattr(scheduler, attr, None) for attr, _ in _SCHEDULE_FIELDS}


def schedule_changes(scheduler) -> list[str]:
    """After a resume: where the schedule in use (the checkpoint's, unless
    ``scheduler.override_opt_param_scheduler``) differs from the one this config implies.

    Returns:
        One ``"<field>: <in use> (this config: <configured>)"`` per difference; empty when none
        or when the scheduler was not built by :func:`build_scheduler`.
    """
    configured = getattr(scheduler, "tierstack_configured", None)
    if configured is None:
        return []
    now = _schedule_values(scheduler)
    constant_wd = now["start_wd"] == now["end_wd"] and configured["start_wd"] == configured["end_wd"]
    return [f"{name}: {now[attr]} (this config: {configured[attr]})"
            for attr, name in _SCHEDULE_FIELDS
            if now[attr] != configured[attr] and not (attr == "wd_incr_steps" and constant_wd)]


def wire_model_config(model: list[torch.nn.Module], optimizer) -> None:
    """Hand the schedules what they call back into: gradient finalization and loss scaling.

    megatron-core's pipeline schedules run ``config.finalize_model_grads_func`` after the last
    backward: it is where the data-parallel gradient all-reduce (or reduce-scatter with the
    DistributedOptimizer) and the pipeline tied-embedding all-reduce happen. Without it each
    data-parallel rank would step on its own gradients. ``grad_scale_func`` scales the loss for
    fp16/bf16 loss scaling (identity in fp32); ``no_sync_func`` defers gradient reduction over
    micro-batches.
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    config = get_model_config(model[0])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model[0].no_sync if len(model) == 1 else [m.no_sync for m in model]
