"""Per-phase timers (real clocks, the data wait taken out of forward-backward) and the profiler
window over real torch work, its trace read back as JSON."""

import json
import time

import torch

from tierstack.config import ProfileConfig
from tierstack.observability.profiler import StepProfiler
from tierstack.observability.timers import PhaseTimers, metric_key, short_summary


def _slow_batches(n, seconds):
    for i in range(n):
        time.sleep(seconds)
        yield i


def test_phase_means_per_step_with_the_data_wait_taken_out_of_forward_backward():
    timers = PhaseTimers()
    batches = timers.timed(_slow_batches(4, 0.1))
    for _ in range(2):
        with timers.phase("forward_backward"):
            next(batches), next(batches)  # the schedule pulls its micro-batches inside the phase
            time.sleep(0.01)
        with timers.phase("optimizer"):
            time.sleep(0.01)
        timers.step_done()
    out = timers.take(per_rank={"memory/rss_gib": 1.5})
    assert out["memory/rss_gib"] == 1.5 and out["memory/rss_gib_rank"] == 0
    assert out[metric_key("data")] >= 0.2  # two 100 ms waits per step
    assert 0.009 <= out[metric_key("forward_backward")] < 0.1  # 10 ms of its own: the 200 ms of waits removed
    assert out[metric_key("optimizer")] >= 0.009
    assert out[metric_key("checkpoint")] == 0.0 and out["timers/slowest_rank"] == 0  # one process: rank 0
    assert timers.take()[metric_key("optimizer")] == 0.0  # a new window


def test_the_forward_steps_own_compute_is_timed_without_their_data_waits():
    timers = PhaseTimers()
    batches = timers.timed(_slow_batches(2, 0.1))

    def forward_step(data_iterator, model):
        next(data_iterator)
        time.sleep(0.02)
        return "output", "loss_func"

    forward = timers.wrap_forward(forward_step)
    with timers.phase("forward_backward"):
        assert forward(batches, None) == ("output", "loss_func")
        assert forward(batches, None) == ("output", "loss_func")
    timers.step_done()
    out = timers.take()
    assert 0.039 <= out[metric_key("forward")] < 0.1  # 2 x 20 ms, the 2 x 100 ms waits left out
    assert out[metric_key("data")] >= 0.2


def test_disabled_timers_time_nothing_and_return_nothing():
    timers = PhaseTimers(enabled=False)
    it = iter([1])
    assert timers.timed(it) is it and timers.wrap_forward(len) is len
    with timers.phase("optimizer"):
        pass
    assert timers.take() == {}


def test_short_summary():
    metrics = {metric_key("forward_backward"): 1.0213, metric_key("optimizer"): 0.1, metric_key("data"): 0.001,
               "timers/slowest_rank": 3}
    assert short_summary(metrics) == "fb 1.02 opt 0.10 max r3"
    assert short_summary({}) == ""


def test_profiler_window_writes_a_chrome_trace_and_the_top_operators(tmp_path):
    profiler = StepProfiler(ProfileConfig(enabled=True, step_start=2, step_end=3), tmp_path, rank=0)
    timers = PhaseTimers()
    a = torch.randn(64, 64)
    for step in range(1, 6):
        profiler.step_begin(step)
        with timers.phase("forward_backward"):
            (a @ a).sum()
        profiler.step_end(step)
    trace = json.loads(profiler.trace_path.read_text())
    names = [e.get("name") for e in trace["traceEvents"]]
    assert names.count("forward_backward") == 2  # steps 2 and 3 only
    assert "aten::mm" in names
    assert profiler.trace_path.name == "rank0_steps2-3.trace.json"
    table = profiler.table_path.read_text()
    assert "aten::mm" in table and "Self CPU" in table


def test_profiler_is_off_on_other_ranks_and_closes_a_window_cut_short(tmp_path):
    cfg = ProfileConfig(enabled=True, step_start=1, step_end=9, ranks=[1])
    other = StepProfiler(cfg, tmp_path / "a", rank=0)
    other.step_begin(1)
    other.close()
    assert not (tmp_path / "a").exists()
    cut = StepProfiler(cfg, tmp_path / "b", rank=1)
    cut.step_begin(1)
    torch.ones(3).add_(1)
    cut.close()  # the run stopped at step 1, inside the window
    assert cut.trace_path.is_file() and cut.table_path.is_file()
