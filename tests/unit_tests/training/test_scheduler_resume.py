"""The LR schedule across a resume: the checkpoint's goes on (WSD anneal included) unless
``scheduler.override_opt_param_scheduler``; real megatron-core ``OptimizerParamScheduler``s."""

import pytest
import torch

from tierstack.recipes import gpt_tiny_config
from tierstack.training.optim import build_scheduler, load_scheduler_state, scheduler_state, schedule_changes


def _scheduler(*overrides):
    cfg = gpt_tiny_config().apply_overrides(["scheduler.lr_warmup_iters=5", *overrides])
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([{"params": [param], "max_lr": cfg.optimizer.lr, "min_lr": cfg.optimizer.min_lr}],
                                lr=cfg.optimizer.lr)
    return build_scheduler(cfg, optimizer), optimizer


def _lrs(scheduler, optimizer, steps):
    out = []
    for _ in range(steps):
        scheduler.step(1)
        out.append(optimizer.param_groups[0]["lr"])
    return out


def test_a_wsd_run_resumed_under_a_cosine_config_continues_its_own_anneal():
    """megatron-core leaves the WSD anneal length out of its state dict; a WSD checkpoint resumed
    under a config of another style used to fail in get_lr (None anneal length) on every rank."""
    first, opt = _scheduler("train.train_iters=20", "scheduler.lr_decay_style=WSD")
    _lrs(first, opt, 12)
    sd = scheduler_state(first)
    uninterrupted = _lrs(first, opt, 8)  # steps 13..20: the anneal is the last 2 steps

    resumed, opt2 = _scheduler("train.train_iters=40", "scheduler.lr_decay_style=cosine")
    load_scheduler_state(resumed, opt2, sd)
    assert resumed.lr_decay_style == "WSD" and resumed.wsd_decay_steps == 2
    assert _lrs(resumed, opt2, 8) == pytest.approx(uninterrupted, rel=1e-12)
    changes = "; ".join(schedule_changes(resumed))
    assert "scheduler.lr_decay_style: WSD (this config: cosine)" in changes and "WSD anneal steps (lr_decay_iters // 10): 2 (this config: None)" in changes

    # a checkpoint written before the anneal length was recorded: derived as build_scheduler does
    old = {k: v for k, v in sd.items() if k not in ("wsd_decay_steps", "lr_wsd_decay_style")}
    again, opt3 = _scheduler("train.train_iters=40")
    load_scheduler_state(again, opt3, old)
    assert again.wsd_decay_steps == 2 and _lrs(again, opt3, 8) == pytest.approx(uninterrupted, rel=1e-12)


def test_override_follows_this_configs_schedule_and_peak_lr_from_the_resumed_iteration():
    first, opt = _scheduler("train.train_iters=20")
    _lrs(first, opt, 10)
    sd = scheduler_state(first)
    opt_state = opt.state_dict()

    reference, ref_opt = _scheduler("train.train_iters=40", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4")
    expected = _lrs(reference, ref_opt, 20)[10:]  # steps 11..20 of a run configured like this from the start

    resumed, opt2 = _scheduler("train.train_iters=40", "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",
                               "scheduler.override_opt_param_scheduler=true")
    opt2.load_state_dict(opt_state)  # brings back the checkpoint's max_lr / min_lr in the param group
    assert opt2.param_groups[0]["max_lr"] == pytest.approx(3e-3)
    load_scheduler_state(resumed, opt2, sd)
    assert opt2.param_groups[0]["max_lr"] == pytest.approx(1e-3)
    assert _lrs(resumed, opt2, 10) == pytest.approx(expected, rel=1e-12)
    assert schedule_changes(resumed) == []
