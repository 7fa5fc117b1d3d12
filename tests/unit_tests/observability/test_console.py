"""Console line format and the rank-0 ProgressLogger (real tqdm, real logging)."""

import io
import logging

from tierstack.config.sections import LoggerConfig
from tierstack.observability.console import ProgressLogger, format_duration, format_step_line

METRICS = {
    "loss": 2.91349,
    "val_loss": 2.8011,
    "lr": 2.1e-3,
    "grad_norm": 0.8412,
    "tokens_per_s": 1712.4,
    "step_time_s": 1.2149,
}


def test_line_reads_like_the_example():
    line = format_step_line(120, 200, METRICS)
    assert line == (
        "iter 120/200 | loss 2.913 val 2.801 | lr 2.1e-03 gnorm 0.84 | 1712 tok/s 1.21 s/it | eta 1m37s"
    )


def test_missing_metrics_are_left_out_and_extras_appended():
    line = format_step_line(200, 200, {"loss": 1.0, "val_loss": None, "tflops": 0.51234})
    assert line == "iter 200/200 | loss 1.000 | tflops 0.5123"


def test_straggler_scores_are_summarised_as_the_lowest_of_each_kind():
    metrics = {
        "loss": 2.0,
        "straggler/train_step_relative_min": 0.97,
        "straggler/train_step_relative_max": 1.0,
        "straggler/forward_step_relative_min": 0.04,
        "straggler/forward_step_individual_min": 0.9,
    }
    assert format_step_line(4, 16, metrics) == "iter 4/16 | loss 2.000 | straggler rel 0.04 ind 0.90"


TIMERS = {
    "timers/forward_backward_s": 1.0213, "timers/optimizer_s": 0.1234, "timers/data_s": 0.0112,
    "timers/checkpoint_s": 0.0521, "timers/eval_s": 0.3099, "timers/slowest_rank": 1,
}


def test_timers_in_short_form_with_the_slowest_rank_and_namespaced_metrics_left_to_the_loggers():
    metrics = {**METRICS, "tflops_per_rank": 0.01234, **TIMERS, "timers/eval_s": 0.001, "memory/rss_gib": 1.5,
               "checkpoint/local_durable_s": 0.2}
    line = format_step_line(120, 200, metrics)
    assert line == ("iter 120/200 | loss 2.913 val 2.801 | lr 2.1e-03 gnorm 0.84 | 1712 tok/s 1.21 s/it 0.0123 TF/s"
                    " | fb 1.02 opt 0.12 data 0.01 ckpt 0.05 max r1 | eta 1m37s")  # eval under 5 ms: left out


def test_a_line_with_everything_fits_in_160_characters():
    metrics = {**METRICS, "tflops_per_rank": 123.4, **TIMERS, "straggler/train_step_relative_min": 0.04,
               "straggler/train_step_individual_min": 0.9, "tflops": 0.5, "skipped": 3}
    for iteration, total in ((120, 200), (12345, 100000), (999999, 1000000)):
        line = format_step_line(iteration, total, metrics)
        assert len(line) <= 160, line
        assert "fb 1.02 opt 0.12 data 0.01 ckpt 0.05 eval 0.31 max r1" in line  # the timers always fit
    short = format_step_line(120, 200, metrics)
    assert short.endswith("| eta 1m37s")  # the ETA is kept; what did not fit is left to the loggers


def test_durations():
    assert [format_duration(s) for s in (9.4, 130, 3725)] == ["9s", "2m10s", "1h02m"]


def test_rank0_logs_each_line_the_loop_asks_for(caplog):
    cfg = LoggerConfig(log_interval=5, progress_bar=True)
    progress = ProgressLogger(cfg, total_iters=12, start_iter=0, rank=0, stream=io.StringIO())
    assert not progress.bar_shown  # not a TTY
    with caplog.at_level(logging.INFO, logger="tierstack.progress"):
        progress.advance(4)
        lines = [progress.log_step(i, {"loss": 3.0}) for i in (1, 5, 12)]
    progress.close()
    assert [line.split(" |")[0] for line in lines] == ["iter 1/12", "iter 5/12", "iter 12/12"]
    assert [r.getMessage() for r in caplog.records] == lines


def test_other_ranks_stay_quiet(caplog):
    progress = ProgressLogger(LoggerConfig(log_interval=1), total_iters=3, rank=1)
    with caplog.at_level(logging.INFO, logger="tierstack.progress"):
        assert progress.log_step(1, METRICS) is None
    assert not caplog.records


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_bar_on_a_tty_resumes_at_start_iter():
    stream = _Tty()
    progress = ProgressLogger(LoggerConfig(log_interval=2), total_iters=10, start_iter=4, rank=0, stream=stream)
    assert progress.bar_shown
    progress.advance(5)
    progress.log_step(6, {"loss": 2.4})
    progress.close()
    out = stream.getvalue()
    assert "6/10" in out and "loss=2.400" in out
    no_bar = ProgressLogger(LoggerConfig(progress_bar=False), total_iters=10, rank=0, stream=_Tty())
    assert not no_bar.bar_shown
