"""CheckpointManager's policy, single process, with recording tiers in place of LOCAL and GLOBAL.

The fakes implement the tier Protocol and record every call in one shared journal, so the tests
check what the manager decides (intervals, once per step and tier, order, the non-finite guard,
failures, the final tier, close) and nothing of how a tier writes. A fake tier reports a non-finite
staged state as a real one does after its writer's check (``nonfinite``; the real check has its
tests in test_nonfinite_guard.py). The model is a real (tiny) torch module with a real torch Adam.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from tierstack.checkpointing import CheckpointManager, CheckpointSaveError, CheckpointTier, TrainingObjects
from tierstack.checkpointing import nonfinite_guard as guard_module
from tierstack.config import CheckpointConfig
from tierstack.errors import BadInputError
from tierstack.runtime import ParallelLayout
from tierstack.train_state import TrainState

LAYOUT = ParallelLayout(rank=0, world_size=1, local_rank=0, tensor_model_parallel_size=1,
                        pipeline_model_parallel_size=1, data_parallel_size=1, tensor_model_parallel_rank=0,
                        pipeline_model_parallel_rank=0, data_parallel_rank=0)


class FakeTier:
    """A tier that records calls; ``fail_at`` steps fail (as a real tier reports it: in ``failures``)."""

    def __init__(self, tier, journal, *, interval=None, saves=True, persistent=False, fail_at=(), close_error=None,
                 nonfinite_at=()):
        self.tier, self.journal = tier, journal
        self.interval, self.saves, self.persistent = interval, saves, persistent
        self.enabled = saves
        self.run_root: Optional[Path] = None
        self.failures: list[int] = []
        self.nonfinite: list[tuple[int, list[int]]] = []
        self.fail_at, self.close_error = set(fail_at), close_error
        self.nonfinite_at = set(nonfinite_at)  # steps whose staged state the writer finds non-finite on rank 0
        self.in_flight, self.staging_bytes = 0, 0
        self.sealed: list[int] = []
        self.captured: list[tuple] = []  # (step, best records of the TrainState the save captured)
        self.closed = False

    def claim(self, run_id):
        self.journal.append(("claim", self.tier.value, run_id))

    def prepare_resume(self, run_id):
        self.journal.append(("prepare_resume", self.tier.value, run_id))

    def candidates(self, run_id):
        return []

    def interrupted_steps(self):
        return []

    def abandon(self, step):
        raise AssertionError("no candidates, nothing to abandon")

    def verify(self, candidate):
        return None

    def quarantine(self, candidate, reason):
        raise AssertionError("no candidates, nothing to quarantine")

    def load(self, step, objs):
        raise AssertionError("no candidates, nothing to load")

    def save(self, objs, *, run_id):
        step = objs.train_state.step
        self.journal.append(("save", self.tier.value, step))
        self.captured.append((step, [list(r) for r in objs.train_state.state_dict()["best_checkpoints"]]))
        if step in self.fail_at:
            self.failures.append(step)
            return None
        if step in self.nonfinite_at:  # as a real tier reports it after its (here synchronous) finalize
            self.nonfinite.append((step, [0]))
            return 0.0
        self.sealed.append(step)
        return 0.0

    def finalize(self, blocking):
        self.journal.append(("finalize", self.tier.value, blocking))

    in_flight_step = None  # saves are synchronous here

    def release_retention(self, settled_through):
        self.journal.append(("release_retention", self.tier.value, settled_through))

    def veto(self, step):
        self.journal.append(("veto", self.tier.value, step))
        if step in self.sealed:
            self.sealed.remove(step)

    def saved_steps(self):
        return list(self.sealed)

    def close(self):
        self.closed = True
        self.journal.append(("close", self.tier.value))
        if self.close_error is not None:
            raise self.close_error

    def close_alone(self):
        self.closed = True
        self.journal.append(("close_alone", self.tier.value))

    retention_pending, last_durable_s, last_blocked_s = False, None, None

    def wait_retention(self, timeout_s=None):
        self.journal.append(("wait_retention", self.tier.value))
        return True

    def close_retention(self):
        self.journal.append(("close_retention", self.tier.value))


def make(journal, *, local=None, global_=None, **cfg):
    local = FakeTier(CheckpointTier.LOCAL, journal, **(local or {}))
    global_ = FakeTier(CheckpointTier.GLOBAL, journal, persistent=True, **(global_ or {}))
    manager = CheckpointManager(CheckpointConfig(**cfg), LAYOUT, tiers=[local, global_])
    model = torch.nn.Linear(4, 4)
    objs = TrainingObjects(model=[model], optimizer=torch.optim.Adam(model.parameters()), scheduler=None,
                           train_state=TrainState())
    return manager, objs, local, global_


def run_steps(manager, objs, steps):
    for _ in range(steps):
        objs.train_state.step += 1
        manager.maybe_save(objs)


def saves(journal):
    return [(tier, step) for kind, tier, step in (e for e in journal if e[0] == "save")]


def test_intervals_decide_and_local_starts_before_global():
    journal: list = []
    manager, objs, _, _ = make(journal, local={"interval": 2}, global_={"interval": 4})
    run_steps(manager, objs, 8)
    assert saves(journal) == [("local", 2), ("local", 4), ("global", 4), ("local", 6), ("local", 8), ("global", 8)]
    # every step first finalizes whatever ended, in both tiers, before any new save; a tier's save
    # waits for its previous one (and reports how it ended) before the guard and the staging
    calls = [e for e in journal if e[0] in ("finalize", "save")]
    first_save = calls.index(("save", "local", 2))
    assert calls[first_save - 3:first_save] == [("finalize", "local", False), ("finalize", "global", False),
                                                  ("finalize", "local", True)]


def test_once_per_step_and_tier():
    journal: list = []
    manager, objs, _, _ = make(journal, local={"interval": 1}, global_={"interval": 1})
    objs.train_state.step = 3
    manager.maybe_save(objs)
    manager.save(CheckpointTier.GLOBAL, objs)  # e.g. a planned exit at the same step
    manager.save(CheckpointTier.LOCAL, objs)
    manager.save_final(objs)
    assert saves(journal) == [("local", 3), ("global", 3)]
    assert manager.last_saved_step(CheckpointTier.GLOBAL) == 3


def test_a_tier_that_does_not_save_is_skipped():
    journal: list = []
    manager, objs, _, _ = make(journal, local={"interval": 1}, global_={"interval": 1, "saves": False})
    run_steps(manager, objs, 2)
    assert saves(journal) == [("local", 1), ("local", 2)]


def test_the_guard_runs_once_per_step_for_all_tiers(monkeypatch):
    calls = []
    real = guard_module._agree
    monkeypatch.setattr(guard_module, "_agree", lambda steps: calls.append(1) or real(steps))
    journal: list = []
    manager, objs, _, _ = make(journal, local={"interval": 2}, global_={"interval": 2})
    run_steps(manager, objs, 4)
    assert len(saves(journal)) == 4 and len(calls) == 2  # two steps with saves, one agreement each


def test_a_non_finite_staged_state_blocks_that_step_and_skip_trains_on():
    journal: list = []
    manager, objs, local, global_ = make(journal, local={"interval": 2, "nonfinite_at": [2]},
                                         global_={"interval": 2, "nonfinite_at": [2]}, on_nonfinite="skip")
    run_steps(manager, objs, 2)
    assert saves(journal) == [("local", 2), ("global", 2)]  # staged, then blocked by the writers' check
    assert manager.blocked_steps == [2] and local.failures == [] and global_.failures == []
    assert local.sealed == global_.sealed == [] and local.nonfinite == global_.nonfinite == []  # taken
    run_steps(manager, objs, 2)
    assert saves(journal)[-2:] == [("local", 4), ("global", 4)] and local.sealed == global_.sealed == [4]


def test_a_step_blocked_in_one_tier_is_vetoed_in_the_others():
    """GLOBAL's writer finds the staged state of step 2 non-finite (it checks every replica it
    stages; LOCAL writes, and checks, fewer): LOCAL's save of step 2 is not kept either."""
    journal: list = []
    manager, objs, local, global_ = make(journal, local={"interval": 2}, global_={"interval": 2, "nonfinite_at": [2]},
                                         on_nonfinite="skip")
    run_steps(manager, objs, 2)
    assert ("veto", "local", 2) in journal and ("veto", "global", 2) not in journal
    assert local.sealed == [] and manager.blocked_steps == [2]


def test_a_non_finite_staged_state_with_stop_raises_naming_the_step_tier_and_rank():
    journal: list = []
    manager, objs, _, _ = make(journal, local={"interval": 2, "nonfinite_at": [2]}, global_={"interval": 4})
    objs.train_state.step = 1
    with pytest.raises(guard_module.NonFiniteError,
                       match=r"step 2: non-finite parameters or optimizer moments on rank\(s\) 0 \(found by the LOCAL save\)"):
        run_steps(manager, objs, 1)
    assert manager.blocked_steps == [2]


def test_non_finite_steps_block_every_tier_before_anything_is_staged():
    journal: list = []
    manager, objs, _, _ = make(journal, local={"interval": 2}, global_={"interval": 2})
    objs.train_state.step = 1
    manager.observe_step(objs, SimpleNamespace(update_successful=True, local_loss_finite=False, grad_norm=1.0))
    with pytest.raises(guard_module.NonFiniteError, match=r"step 2: first non-finite step 1 on rank\(s\) 0"):
        run_steps(manager, objs, 1)
    assert saves(journal) == []


def test_a_failure_stops_the_run_only_when_configured():
    journal: list = []
    manager, objs, _, _ = make(journal, local={"interval": 1, "fail_at": [2]})
    run_steps(manager, objs, 3)  # goes on: exit_on_save_failure is false
    assert saves(journal) == [("local", 1), ("local", 2), ("local", 3)]

    journal = []
    manager, objs, _, _ = make(journal, local={"interval": 1, "fail_at": [2]}, exit_on_save_failure=True)
    with pytest.raises(CheckpointSaveError, match=r"'local': \[2\]"):
        run_steps(manager, objs, 3)
    assert saves(journal) == [("local", 1), ("local", 2)]


@pytest.mark.parametrize("local_saves,global_saves,expected", [
    (True, True, CheckpointTier.GLOBAL),  # persistent first: it survives losing the node
    (True, False, CheckpointTier.LOCAL),
    (False, True, CheckpointTier.GLOBAL),
    (False, False, None),
])
def test_choice_of_the_final_save_tier(local_saves, global_saves, expected):
    journal: list = []
    manager, objs, _, _ = make(journal, local={"saves": local_saves}, global_={"saves": global_saves})
    assert manager.final_tier() is expected
    objs.train_state.step = 5
    manager.save_final(objs)
    assert saves(journal) == ([] if expected is None else [(expected.value, 5)])


def test_close_closes_every_tier_after_a_failure_then_reports_it():
    journal: list = []
    manager, objs, local, global_ = make(journal, local={"interval": 1, "close_error": OSError("disk gone")},
                                         global_={"interval": 1, "fail_at": [1]}, exit_on_save_failure=False)
    run_steps(manager, objs, 1)
    with pytest.raises(OSError, match="disk gone"):
        manager.close()
    assert local.closed and global_.closed  # GLOBAL closed although LOCAL's close raised
    manager.close()  # idempotent: nothing is closed twice
    assert [e for e in journal if e[0] == "close"] == [("close", "local"), ("close", "global")]
    run_steps(manager, objs, 1)
    assert saves(journal) == [("local", 1), ("global", 1)]  # nothing is saved after close


def test_close_raises_the_save_failure_when_configured():
    journal: list = []
    manager, objs, local, global_ = make(journal, global_={"fail_at": [1]}, exit_on_save_failure=True)
    objs.train_state.step = 1
    with pytest.raises(CheckpointSaveError):
        manager.save(CheckpointTier.GLOBAL, objs)
    with pytest.raises(CheckpointSaveError, match=r"'global': \[1\]"):
        manager.close()
    assert local.closed and global_.closed


def test_fresh_start_claims_every_tier_for_one_run_id():
    journal: list = []
    manager, objs, _, _ = make(journal)
    assert manager.resume(objs) is None
    run_id = objs.train_state.run_id
    assert run_id and [e for e in journal if e[0] == "claim"] == [("claim", "local", run_id), ("claim", "global", run_id)]


def test_save_on_best_commits_the_candidate_into_every_tier_saving_at_that_step():
    journal: list = []
    manager, objs, local, global_ = make(journal, local={"interval": 4}, global_={"interval": 10},
                                         save="/unused", keep_best_k=2, save_on_best=True)
    objs.train_state.step = 4
    assert manager.propose_best(objs, {"val_loss": 2.0})
    assert objs.train_state.best_checkpoints == []  # proposed: nothing changed yet
    manager.maybe_save(objs)
    assert saves(journal) == [("local", 4), ("global", 4)]  # GLOBAL at once, beside LOCAL's interval
    assert local.captured == global_.captured == [(4, [[4, 2.0]])]  # a LOCAL resume keeps the record
    assert objs.train_state.best_checkpoints == [[4, 2.0]]  # sealed (the fake tier saves synchronously)
    objs.train_state.step = 5
    assert not manager.propose_best(objs, {"val_loss": math.nan})
    manager.maybe_save(objs)
    assert saves(journal)[-1] == ("global", 4)  # no candidate, no interval: nothing saved


def test_a_save_blocked_or_failed_at_a_best_candidate_leaves_the_records_unchanged():
    journal: list = []
    manager, objs, _, global_ = make(journal, global_={"fail_at": [6]}, save="/unused", keep_best_k=2,
                                     save_on_best=True, on_nonfinite="skip")
    objs.train_state.best_checkpoints = [[2, 3.0]]
    objs.train_state.step = 4
    manager.propose_best(objs, {"val_loss": 2.0})
    manager.guard.bad_steps = [3]  # a non-finite step in the interval
    manager.maybe_save(objs)
    assert saves(journal) == [] and manager.blocked_steps == [4]
    assert objs.train_state.best_checkpoints == [[2, 3.0]] and manager.best.pending is None
    objs.train_state.step = 6
    manager.propose_best(objs, {"val_loss": 1.0})
    manager.maybe_save(objs)
    assert saves(journal) == [("global", 6)] and global_.captured == [(6, [[6, 1.0], [2, 3.0]])]
    assert objs.train_state.best_checkpoints == [[2, 3.0]]  # the save failed: records unchanged


def test_close_waits_for_retention_only_after_every_tiers_collective_close():
    """A rank still deleting an old checkpoint (slow file system) must not make the others time out in
    a checkpoint collective: retention is waited for after every tier's (collective) close."""
    journal: list = []
    manager, objs, _, _ = make(journal, local={"interval": 1}, global_={"interval": 1})
    run_steps(manager, objs, 1)
    manager.close()
    ends = [e for e in journal if e[0] in ("close", "close_retention")]
    assert ends == [("close", "local"), ("close", "global"), ("close_retention", "local"),
                    ("close_retention", "global")]


def test_a_rank_unwinding_from_its_own_error_closes_without_collectives():
    """An error only this rank may have (a bug, an OOM, a failed collective): no tier's collective
    close (its finalize polls are WORLD all-reduces the other ranks never enter); nothing raised."""
    journal: list = []
    manager, objs, _, _ = make(journal, local={"interval": 1}, global_={"interval": 1, "fail_at": [1]},
                               exit_on_save_failure=True)
    objs.train_state.step = 1
    manager.save(CheckpointTier.LOCAL, objs)
    manager.close(error=MemoryError("this rank only"))  # the failed GLOBAL save is not raised either
    ends = [e for e in journal if e[0] in ("close", "close_alone", "close_retention")]
    assert ends == [("close_alone", "local"), ("close_retention", "local"), ("close_alone", "global"),
                    ("close_retention", "global")]


@pytest.mark.parametrize("error", [CheckpointSaveError("agreed"), guard_module.NonFiniteError("agreed"),
                                   BadInputError("agreed")])
def test_an_error_every_rank_raised_alike_closes_together(error):
    journal: list = []
    manager, objs, _, _ = make(journal, local={"interval": 1}, global_={"interval": 1})
    run_steps(manager, objs, 1)
    manager.close(error=error)
    assert [e for e in journal if e[0] in ("close", "close_alone")] == [("close", "local"), ("close", "global")]


def test_the_time_budget_reserves_the_final_tiers_save_until_durable():
    """``train.exit_duration_in_mins`` stops when the next step and the final save would pass the
    budget; the final save goes to GLOBAL and is waited for until durable, so what is reserved is
    GLOBAL's time to durable (with a margin), not a LOCAL save's nor an async save's blocked time."""
    from tierstack.training.train import FINAL_SAVE_MARGIN, final_save_estimate_s

    journal: list = []
    manager, objs, local, global_ = make(journal, local={"interval": 1}, global_={"interval": 10})
    assert final_save_estimate_s(manager) == 0.0  # nothing saved yet: nothing known
    run_steps(manager, objs, 3)
    local.last_durable_s, local.last_blocked_s = 0.01, 0.005  # LOCAL saves only: not the final tier's
    assert manager.final_tier() is CheckpointTier.GLOBAL
    assert final_save_estimate_s(manager) == 0.0
    global_.last_durable_s, global_.last_blocked_s = 2.0, 0.1  # an async GLOBAL save: durable after 2 s
    run_steps(manager, objs, 8)  # step 10 saves GLOBAL, step 11 LOCAL: the last save is a LOCAL one
    assert saves(journal)[-1] == ("local", 11)
    assert final_save_estimate_s(manager) == pytest.approx(FINAL_SAVE_MARGIN * 2.0)
    global_.last_durable_s, global_.last_blocked_s = 3.0, 3.0  # a sync save: durable when it returns
    assert final_save_estimate_s(manager) == pytest.approx(FINAL_SAVE_MARGIN * 3.0)
