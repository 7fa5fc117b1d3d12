"""The non-finite guard on one process: per-step flags, the boundary check of what a checkpoint
writes (real torch Adam parameters and moments), the verdict once per step, stop and skip."""

import math
from types import SimpleNamespace

import pytest
import torch

from tierstack.checkpointing.nonfinite_guard import NonFiniteError, NonFiniteGuard, _sums_finite, state_finite


def adam_after_one_step():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def step_result(loss=1.0, grad_norm=1.0, update_successful=True, local_loss_finite=True):
    return SimpleNamespace(loss=loss, grad_norm=grad_norm, update_successful=update_successful,
                           local_loss_finite=local_loss_finite)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["param", "exp_avg", "exp_avg_sq"])
def test_one_non_finite_value_in_what_is_written_fails(bad, where):
    model, opt = adam_after_one_step()
    assert state_finite(opt)
    target = model.weight.data if where == "param" else opt.state[model.weight][where]
    target[1, 2] = bad
    assert not state_finite(opt)
    if where != "param":
        assert state_finite(opt, moments=False)  # save_optim=false: moments are not written


def test_huge_but_finite_values_pass_although_their_sum_overflows():
    t = torch.full((4,), 3e38)
    assert not math.isfinite(float(t.sum())) and _sums_finite([t, torch.zeros(0)])
    assert not _sums_finite([t, torch.tensor([1.0, math.nan])])


def test_a_step_the_optimizer_skipped_does_not_trip_an_applied_one_does():
    model, opt = adam_after_one_step()
    guard = NonFiniteGuard("skip")
    guard.observe(1, step_result(loss=math.inf, grad_norm=math.inf, update_successful=False, local_loss_finite=False), opt)
    assert guard.bad_steps == []  # skipped: counted in skipped_train_samples, nothing reached the state
    guard.observe(2, step_result(local_loss_finite=False, loss=math.nan), opt)
    model.weight.grad[0, 0] = math.inf
    guard.observe(3, step_result(grad_norm=1.0), opt)  # a finite global norm: the gradients are not read
    guard.observe(4, step_result(grad_norm=math.inf), opt)  # non-finite norm: this rank's gradients are
    guard.observe(5, step_result(grad_norm=math.nan), opt)  # not reported (nan): read them too
    assert guard.bad_steps == [2, 4, 5]
    model.weight.grad.zero_()
    guard.observe(6, step_result(grad_norm=math.inf), opt)  # another rank's gradients: not this rank's flag
    assert guard.bad_steps == [2, 4, 5]


def test_the_verdict_is_once_per_step_spends_the_interval_and_names_steps_and_rank():
    _, opt = adam_after_one_step()
    guard = NonFiniteGuard("skip")
    guard.bad_steps = [7]
    verdict = guard.check(10, opt)
    assert not verdict.ok and verdict.message.startswith("first non-finite step 7 on rank(s) 0")
    guard.observe(10, step_result(), opt)
    assert guard.check(10, opt) is verdict  # the second tier of the step: same verdict, no new check
    assert guard.check(15, opt).ok  # the next interval is judged on its own steps


def test_stop_raises_with_the_steps_and_skip_does_not():
    _, opt = adam_after_one_step()
    guard = NonFiniteGuard("stop")
    guard.bad_steps = [7, 8, 9]
    with pytest.raises(NonFiniteError, match=r"step 10: first non-finite step 7 on rank\(s\) 0; .*3 steps from 7 to 9"):
        guard.check(10, opt)
    with pytest.raises(ValueError, match="checkpoint.on_nonfinite='maybe'"):
        NonFiniteGuard("maybe")
