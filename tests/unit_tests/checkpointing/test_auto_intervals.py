"""``auto`` save intervals: Young/Daly from the measured save cost, step time and checkpoint.mtbf_s."""

import math

import pytest

from tierstack.checkpointing.intervals import FIRST_GUESS_ITERATIONS, IntervalPlanner, young_daly_interval
from tierstack.config import CheckpointConfig, ConfigContainer, ConfigError


def test_young_daly_interval_in_iterations():
    # sqrt(2 * 2 s * 3600 s) = 120 s of training = 240 iterations of 0.5 s
    assert young_daly_interval(2.0, 0.5, 3600.0) == 240
    assert young_daly_interval(0.0, 0.5, 3600.0) == 1  # free saves: every iteration
    assert young_daly_interval(1e-6, 10.0, 60.0) == 1
    with pytest.raises(ValueError, match="mtbf_s"):
        young_daly_interval(1.0, 1.0, 0.0)


def test_planner_starts_with_a_guess_and_adopts_the_agreed_estimate(caplog):
    planner = IntervalPlanner("LOCAL", mtbf_s=3600.0)
    assert planner.interval == FIRST_GUESS_ITERATIONS and planner.due(FIRST_GUESS_ITERATIONS)
    for _ in range(20):
        planner.record_step(0.5)
    proposal = planner.record_save(FIRST_GUESS_ITERATIONS, 2.0)
    assert proposal == 240 and planner.interval == FIRST_GUESS_ITERATIONS  # not before the ranks agree
    with caplog.at_level("INFO"):
        planner.adopt(proposal, announce=True)
    assert planner.interval == 240 and "LOCAL save interval auto: 240 iterations" in caplog.text
    assert f"{math.sqrt(2 * 2.0 * 3600):.1f}s" in caplog.text
    assert not planner.due(249) and planner.due(250)
    assert planner.record_save(250, None) == 240  # a failed save adds no cost sample


def test_auto_needs_mtbf_and_other_words_are_refused_naming_the_field():
    with pytest.raises(ConfigError) as err:
        ConfigContainer(checkpoint=CheckpointConfig(local_dir="/tmp/x", local_save_interval="auto")).validate(1)
    assert "checkpoint.local_save_interval=auto needs checkpoint.mtbf_s" in str(err.value)
    cfg = ConfigContainer().apply_overrides(["checkpoint.save=/tmp/g", "checkpoint.save_interval=often"])
    with pytest.raises(ConfigError) as err:
        cfg.validate(1)
    assert "checkpoint.save_interval='often': give a number of iterations, auto, or null" in str(err.value)
    cfg = ConfigContainer().apply_overrides(["checkpoint.save=/tmp/g", "checkpoint.save_interval=auto",
                                             "checkpoint.mtbf_s=3600"])
    cfg.validate(1)
    assert cfg.checkpoint.save_interval == "auto"
    assert ConfigContainer().apply_overrides(["checkpoint.save_interval=25"]).checkpoint.save_interval == 25
