"""``logger.format=megatron``: Megatron-LM's training log line, parsed with a regex written from the
format Megatron-LM prints, carries the numbers of the default line; the tracker gets Megatron's names."""

import logging
import math
import re
from datetime import datetime

from tierstack.config import ConfigError, LoggerConfig
from tierstack.observability.console import ProgressLogger, format_step_line
from tierstack.observability.megatron_log import format_megatron_line, format_megatron_validation, tracker_metrics

# Megatron-LM (megatron/training/training.py, training_log) prints, per log interval:
#  " [%Y-%m-%d %H:%M:%S] iteration {:8d}/{:8d} | consumed samples: {:12d} | elapsed time per iteration (ms): {:.1f} |
#    learning rate: {:.6E} | global batch size: {:5d} | lm loss: {:.6E} | loss scale: {:.1f} | grad norm: {:.3f} |
#    number of skipped iterations: {:3d} | number of nan iterations: {:3d} |"
NUM = r"[-+]?\d+(?:\.\d+)?(?:E[-+]\d+)?"
MEGATRON_LINE = re.compile(
    r" \[(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] iteration\s+(?P<iteration>\d+)/\s*(?P<train_iters>\d+) \|"
    r" consumed samples:\s+(?P<consumed>\d+) \|"
    rf" elapsed time per iteration \(ms\): (?P<ms>{NUM}) \|"
    rf" learning rate: (?P<lr>{NUM}) \|"
    r" global batch size:\s+(?P<gbs>\d+) \|"
    rf" lm loss: (?P<loss>{NUM}) \|"
    rf" loss scale: (?P<loss_scale>{NUM}) \|"
    rf" grad norm: (?P<grad_norm>{NUM}) \|"
    r" number of skipped iterations:\s+(?P<skipped>\d+) \|"
    r" number of nan iterations:\s+(?P<nan>\d+) \|$"
)
# evaluate_and_print_results: " validation loss at iteration N | lm loss value: {:.6E} | lm loss PPL: {:.6E} | "
MEGATRON_VALIDATION = re.compile(
    rf" validation loss at iteration (?P<iteration>\d+) \| lm loss value: (?P<loss>{NUM}) \| lm loss PPL: (?P<ppl>{NUM}) \| $"
)
DEFAULT_LINE = re.compile(r"iter (?P<iteration>\d+)/\d+ \| loss (?P<loss>[\d.]+)\b.* \| lr (?P<lr>[\d.e+-]+) "
                          r"gnorm (?P<grad_norm>[\d.]+) \|.* (?P<s_per_it>[\d.]+) s/it")

METRICS = {"loss": 2.91344, "val_loss": 2.80111, "lr": 2.1e-3, "grad_norm": 0.8412, "tokens_per_s": 1712.0,
           "step_time_s": 1.2134, "tflops_per_rank": 0.002}


def test_the_line_parses_with_megatrons_regex_and_carries_the_default_lines_numbers():
    line = format_megatron_line(120, 200, METRICS, global_batch_size=8, now=datetime(2026, 1, 2, 3, 4, 5))
    m = MEGATRON_LINE.fullmatch(line)
    assert m, line
    d = DEFAULT_LINE.search(format_step_line(120, 200, METRICS))
    assert m["time"] == "2026-01-02 03:04:05"
    assert (int(m["iteration"]), int(m["train_iters"]), int(m["consumed"]), int(m["gbs"])) == (120, 200, 960, 8)
    assert int(m["iteration"]) == int(d["iteration"])
    assert round(float(m["loss"]), 3) == float(d["loss"]) and math.isclose(float(m["loss"]), 2.91344, rel_tol=1e-6)
    assert float(m["lr"]) == float(d["lr"]) == 2.1e-3
    assert round(float(m["grad_norm"]), 2) == float(d["grad_norm"])
    assert round(float(m["ms"]) / 1000, 2) == float(d["s_per_it"])
    assert (float(m["loss_scale"]), int(m["skipped"]), int(m["nan"])) == (1.0, 0, 0)
    skipped = format_megatron_line(5, 200, {**METRICS, "skipped_iters": 2, "nan_iters": 1}, global_batch_size=8)
    assert MEGATRON_LINE.fullmatch(skipped)["skipped"] == "2" and MEGATRON_LINE.fullmatch(skipped)["nan"] == "1"


def test_validation_line_and_perplexity():
    m = MEGATRON_VALIDATION.fullmatch(format_megatron_validation(50, 2.80111))
    assert m and int(m["iteration"]) == 50
    assert math.isclose(float(m["loss"]), 2.80111, rel_tol=1e-6)
    assert math.isclose(float(m["ppl"]), math.exp(2.80111), rel_tol=1e-6)


def test_the_progress_logger_writes_megatrons_lines(caplog):
    progress = ProgressLogger(LoggerConfig(format="megatron", progress_bar=False), total_iters=200, global_batch_size=8)
    with caplog.at_level(logging.INFO, logger="tierstack.progress"):
        progress.log_step(50, METRICS)
    lines = [r.getMessage() for r in caplog.records]
    assert MEGATRON_VALIDATION.fullmatch(lines[0]) and MEGATRON_LINE.fullmatch(lines[1]), lines


def test_tracker_names_are_megatrons_only_for_that_format():
    assert tracker_metrics("tierstack", METRICS, 8) == METRICS
    named = tracker_metrics("megatron", METRICS, 8)
    assert named["lm loss"] == METRICS["loss"] and named["lm loss validation"] == METRICS["val_loss"]
    assert named["learning-rate"] == METRICS["lr"] and named["grad-norm"] == METRICS["grad_norm"]
    assert named["iteration-time"] == METRICS["step_time_s"] and named["batch-size"] == 8
    assert named["loss-scale"] == 1.0 and "loss" not in named


def test_an_unknown_format_is_refused_naming_the_field():
    import pytest

    with pytest.raises(ConfigError, match=r"logger.format='json': use one of \['tierstack', 'megatron'\]"):
        LoggerConfig(format="json").validate()
