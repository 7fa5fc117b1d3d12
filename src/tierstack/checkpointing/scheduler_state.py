"""What a checkpoint keeps of megatron-core's ``OptimizerParamScheduler``, and how it is put back.

``training.optim.build_scheduler`` builds the scheduler (and marks it with the config's choices:
``override_opt_param_scheduler`` and ``tierstack_configured_groups``); this module only reads and
restores its state, so the checkpointing layer does not import the training layer.
"""

from __future__ import annotations


def scheduler_state(scheduler) -> dict:
    """What a checkpoint keeps of the scheduler: megatron-core's ``state_dict()`` plus the WSD
    anneal length and style, which it leaves out (a WSD run resumed under another config could not
    continue its own schedule without them)."""
    sd = scheduler.state_dict()
    sd["wsd_decay_steps"] = getattr(scheduler, "wsd_decay_steps", None)
    sd["lr_wsd_decay_style"] = getattr(scheduler, "lr_wsd_decay_style", None)
    return sd


def load_scheduler_state(scheduler, optimizer, sd: dict) -> None:
    """Restore the scheduler from a checkpoint's ``sd`` (after the optimizer's state was loaded).

    Without ``scheduler.override_opt_param_scheduler`` the checkpoint's schedule goes on, WSD
    anneal included (from ``sd``, or ``lr_decay_steps // 10`` as :func:`build_scheduler` sets it
    for a checkpoint that does not record it). With it, this config's schedule applies from the
    resumed iteration, the param groups' peak and floor LR included, and the LR and weight decay
    of the resumed iteration are recomputed.
    """
    override = getattr(scheduler, "override_opt_param_scheduler", False)
    if not override and sd.get("lr_decay_style", sd.get("decay_style")) == "WSD":
        decay_steps = sd.get("lr_decay_steps", sd.get("decay_steps", sd.get("end_iter")))
        scheduler.wsd_decay_steps = sd.get("wsd_decay_steps") or max(1, int(decay_steps) // 10)
        scheduler.lr_wsd_decay_style = sd.get("lr_wsd_decay_style") or "cosine"
    scheduler.load_state_dict({k: v for k, v in sd.items() if k not in ("wsd_decay_steps", "lr_wsd_decay_style")})
    groups = getattr(scheduler, "tierstack_configured_groups", None)
    if override and groups is not None:
        for group, (max_lr, min_lr) in zip(optimizer.param_groups, groups):
            if max_lr is not None:
                group["max_lr"] = max_lr
            if min_lr is not None:
                group["min_lr"] = min_lr
        scheduler.step(0)  # the resumed iteration's LR and weight decay under this config
