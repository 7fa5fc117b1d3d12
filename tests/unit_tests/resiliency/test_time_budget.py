"""TimeBudget: the next step and the final save must end before the deadline."""

import os

import psutil
import pytest

from tierstack.resiliency.time_budget import TimeBudget, job_start_time


class Clock:
    def __init__(self, now):
        self.now = now

    def __call__(self):
        return self.now


def test_stops_when_the_next_step_and_the_final_save_would_pass_the_budget():
    clock = Clock(1000.0)
    budget = TimeBudget(2, start=1000.0, clock=clock)  # 120 s
    assert budget.deadline == 1120.0
    clock.now = 1100.0
    assert not budget.would_pass(next_step_s=5.0, final_save_s=10.0)  # ends at 1115
    assert budget.would_pass(next_step_s=5.0, final_save_s=16.0)  # would end at 1121
    assert "train.exit_duration_in_mins=2 reached (1.67 min" in budget.reason()


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="train.exit_duration_in_mins=0"):
        TimeBudget(0)


def test_the_job_starts_with_this_process_outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert job_start_time() == psutil.Process().create_time()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")  # under torchrun: the launcher (parent) started the job
    assert job_start_time() == min(psutil.Process().create_time(), psutil.Process(os.getppid()).create_time())
