"""The non-finite guard on one process: per-step flags, the check of what a checkpoint writes
(real torch Adam parameters and moments, staged into a real tier's buffers and checked on its
writer thread before anything is written), the verdict once per step, stop and skip."""

import math
from types import SimpleNamespace

import pytest
import torch

from tierstack.checkpointing.local_tier import LocalTier, _InFlight
from tierstack.checkpointing.nonfinite_guard import (
    NonFiniteError, NonFiniteGuard, NonFiniteStateError, check_staged, tensors_finite,
)
from tierstack.checkpointing.staging import Stager
from tierstack.config import CheckpointConfig
from tierstack.runtime import ParallelLayout

LAYOUT = ParallelLayout(rank=0, world_size=1, local_rank=0, tensor_model_parallel_size=1,
                        pipeline_model_parallel_size=1, data_parallel_size=1, tensor_model_parallel_rank=0,
                        pipeline_model_parallel_rank=0, data_parallel_rank=0)


def adam_after_one_step():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def step_result(loss=1.0, grad_norm=1.0, update_successful=True, local_loss_finite=True):
    return SimpleNamespace(loss=loss, grad_norm=grad_norm, update_successful=update_successful,
                           local_loss_finite=local_loss_finite)


def adam_state_tensors(model, opt):
    """What a save stages of a torch Adam: parameters, moments and the integer-like step counters."""
    return [*model.parameters(), *(v for st in opt.state.values() for v in st.values())]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", ["param", "exp_avg", "exp_avg_sq"])
def test_one_non_finite_value_in_what_is_staged_fails(bad, where):
    model, opt = adam_after_one_step()
    stager = Stager("test")
    buffers = stager.stage(adam_state_tensors(model, opt))
    check_staged(buffers, "step 1")  # finite: passes
    target = model.weight.data if where == "param" else opt.state[model.weight][where]
    target[1, 2] = bad
    check_staged(buffers, "step 1")  # the live tensors changed after the hand-off: not what is written
    buffers = stager.stage(adam_state_tensors(model, opt))
    with pytest.raises(NonFiniteStateError, match=r"step 2: non-finite parameters or optimizer moments on rank 0"):
        check_staged(buffers, "step 2")
    stager.close()


def test_integer_buffers_are_skipped_and_huge_finite_values_pass_although_their_sum_overflows():
    t = torch.full((4,), 3e38)
    assert not math.isfinite(float(t.sum())) and tensors_finite([t, torch.zeros(0)])
    assert not tensors_finite([t, torch.tensor([1.0, math.nan])])
    check_staged([t, torch.tensor([2**62, 2**62], dtype=torch.int64), torch.tensor([True])], "huge")


def hand_off_local_save(tier, model, opt, *, step):
    """What ``LocalTier.save`` does after building the state: stage the Adam state into the tier's
    buffers and hand the checked write to its writer thread (an empty header: these files are
    never loaded). Returns the writer's future."""
    buffers = tier._stager.stage(adam_state_tensors(model, opt))
    job = tier._submit_checked(f"LOCAL checkpoint of step {step}", tier._write_and_seal, step, "runA",
                               {"step": step}, b"", buffers, {})
    tier._in_flight = _InFlight(step, "runA", 0.0, 0.0, job)
    return job


@pytest.mark.parametrize("when", ["in flight", "sealed"])
def test_a_local_save_vetoed_by_the_guard_is_discarded_in_flight_or_removed_once_sealed(tmp_path, when):
    model, opt = adam_after_one_step()
    tier = LocalTier(CheckpointConfig(load=str(tmp_path / "g"), local_dir=str(tmp_path / "local")), LAYOUT)
    try:
        job = hand_off_local_save(tier, model, opt, step=20)
        if when == "in flight":
            tier.veto(20)
        tier.finalize(blocking=True)
        if when == "sealed":
            assert tier.sealed == [20] and len(list((tmp_path / "local" / "0").iterdir())) == 2
            tier.veto(20)
        assert tier.sealed == [] and tier.failures == [] and tier.nonfinite == []
        assert list((tmp_path / "local" / "0").iterdir()) == []
    finally:
        tier.close()


@pytest.mark.parametrize("finite", [True, False])
def test_a_local_save_of_a_non_finite_state_writes_nothing_and_is_the_guards_verdict_not_a_failure(tmp_path, finite):
    """A real LOCAL tier: the state is staged, the writer thread checks the buffers before it writes,
    and finalize records the step in ``nonfinite`` with the ranks (the manager applies on_nonfinite)."""
    model, opt = adam_after_one_step()
    if not finite:
        opt.state[model.weight]["exp_avg_sq"][0, 0] = math.inf
    tier = LocalTier(CheckpointConfig(load=str(tmp_path / "g"), local_dir=str(tmp_path / "local")), LAYOUT)
    try:
        job = hand_off_local_save(tier, model, opt, step=20)
        tier.finalize(blocking=True)
        assert tier.failures == []
        if finite:  # the control: the same save of a finite state is sealed
            assert tier.sealed == [20] and tier.nonfinite == []
            return
        assert tier.sealed == [] and tier.nonfinite == [(20, [0])]
        assert isinstance(job.exception(), NonFiniteStateError)
        assert not (tmp_path / "local" / "0").exists() or list((tmp_path / "local" / "0").iterdir()) == []
    finally:
        tier.close()


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
    verdict = guard.check(10)
    assert not verdict.ok and verdict.message.startswith("first non-finite step 7 on rank(s) 0")
    guard.observe(10, step_result(), opt)
    assert guard.check(10) is verdict  # the second tier of the step: same verdict, no new check
    assert guard.check(15).ok  # the next interval is judged on its own steps


def test_stop_raises_with_the_steps_and_skip_does_not():
    guard = NonFiniteGuard("stop")
    guard.bad_steps = [7, 8, 9]
    with pytest.raises(NonFiniteError, match=r"step 10: first non-finite step 7 on rank\(s\) 0; .*3 steps from 7 to 9"):
        guard.check(10)
    with pytest.raises(NonFiniteError, match=r"step 20: non-finite parameters or optimizer moments on rank\(s\) 1 "
                                             r"\(found by the LOCAL save\); step 20: .* rank\(s\) 0, 1 \(found by the GLOBAL"):
        guard.state_blocked([("LOCAL", 20, [1]), ("GLOBAL", 20, [0, 1])])
    NonFiniteGuard("skip").state_blocked([("GLOBAL", 20, [0, 1])])  # logged, not raised
    with pytest.raises(ValueError, match="checkpoint.on_nonfinite='maybe'"):
        NonFiniteGuard("maybe")


def test_distributed_optimizer_padding_is_zeroed_so_its_garbage_never_blocks_a_save(monkeypatch):
    """megatron's DistributedOptimizer pads the gaps between parameters (sizes not a multiple of its
    alignment: hidden 40 here) with ``torch.empty`` shards of param, exp_avg and exp_avg_sq. Such
    memory may hold NaN bit patterns; here it does for certain (``torch.empty`` returns NaN), and the
    staged state must still pass: the padding is zeroed when the state dict is built."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from tierstack.checkpointing import state as ckpt_state
    from tierstack.hf import checkpoint_io
    from tierstack.recipes import gpt_config

    cfg = gpt_config("tiny", num_layers=1, hidden_size=40, num_attention_heads=2, seq_length=16, train_iters=2,
                     micro_batch_size=1, global_batch_size=1, lr=1e-3, run_root="unused")
    cfg = cfg.apply_overrides(["optimizer.use_distributed_optimizer=true", "mlflow=null", "straggler=null"])
    with checkpoint_io.parallel_world(cfg):
        objs = checkpoint_io.build_objects(cfg, 257)
        for opt in objs.optimizer.chained_optimizers:
            opt._init_optimizer_states_with_dummy_values()  # Adam state as after a first step
        real_empty = torch.empty
        monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(math.nan))
        sd = ckpt_state.build(objs, is_loading=False, optim=True, rng=False)
        monkeypatch.setattr(torch, "empty", real_empty)
        data = [v.data for v in nested_values(sd) if isinstance(v, ShardedTensor) and v.data is not None]
        padding = [v for d in _dicts(sd) if getattr(d.get("padding"), "obj", False) is True
                   for v in d.values() if isinstance(v, ShardedTensor)]
        assert len(padding) >= 3 and all(int(p.data.count_nonzero()) == 0 for p in padding)
        check_staged(data, "step 1")  # without the zeroing: NonFiniteStateError on a healthy state


def _dicts(tree):
    if isinstance(tree, dict):
        yield tree
        for v in tree.values():
            yield from _dicts(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _dicts(v)


def _guard_rank(rank: int, store: str, out) -> None:
    """One of 2 real gloo ranks: only rank 1 flags a bad step (its own loss, at the boundary step
    itself, where no gradient all-reduce could have shown it to rank 0); both check the boundary."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        guard = NonFiniteGuard("skip")
        _, opt = adam_after_one_step()
        guard.observe(10, step_result(local_loss_finite=rank != 1), opt)
        verdict = guard.check(10)
        out.put((rank, verdict.ok, verdict.message, list(guard.bad_steps)))
    finally:
        dist.destroy_process_group()


def test_only_another_ranks_row_is_bad_and_every_rank_blocks(tmp_path, start_ranks):
    procs, out = start_ranks(_guard_rank, str(tmp_path / "store"))
    got = {r: (ok, msg, left) for r, ok, msg, left in (out.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    assert got[0][0] is False and got[1][0] is False  # rank 0's own flags were clean
    assert got[0][1] == got[1][1] and got[0][1].startswith("first non-finite step 10 on rank(s) 1")
    assert got[0][2] == got[1][2] == []  # the interval's flags are spent on both
