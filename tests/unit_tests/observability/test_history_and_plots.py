"""MetricsHistory across a resume, and the loss curve PNG drawn from it."""

import json
import math

import pytest

from tierstack.observability.history import MetricsHistory
from tierstack.observability.plots import plot_loss_curve


def _train(history, steps):
    for step in steps:
        history.append(step, {"loss": 5.0 * math.exp(-step / 40) + 1.5, "lr": 1e-3})
        if step % 20 == 0:
            history.append(step, {"val_loss": 5.0 * math.exp(-step / 40) + 1.7})
            history.add_checkpoint(step, "GLOBAL")
        elif step % 10 == 0:
            history.add_checkpoint(step, "LOCAL")


def test_resume_truncates_beyond_the_resumed_step_and_appends(tmp_path):
    first = MetricsHistory(tmp_path)
    _train(first, range(5, 75, 5))  # ran to 70, last checkpoint kept: LOCAL 70; say it resumes at 50
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 71, "lo')  # torn line from a killed run
    resumed = MetricsHistory(tmp_path)
    kept = resumed.load(resume_step=50)
    assert max(r["step"] for r in kept) == 50
    resumed.add_resume(50)
    _train(resumed, range(55, 105, 5))

    again = MetricsHistory(tmp_path)
    again.load()
    steps = [r["step"] for r in again.metrics() if "loss" in r]
    assert steps == list(range(5, 105, 5))  # once each, no duplicates of 55..70
    assert again.resume_steps() == [50]
    assert again.checkpoint_steps() == {"LOCAL": [10, 30, 50, 70, 90], "GLOBAL": [20, 40, 60, 80, 100]}
    assert all(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_other_ranks_write_nothing(tmp_path):
    h = MetricsHistory(tmp_path, rank=1)
    h.append(1, {"loss": 1.0})
    assert not (tmp_path / "metrics.jsonl").exists() and h.load() == []


def test_plot_writes_a_png_with_both_curves(tmp_path):
    history = MetricsHistory(tmp_path)
    _train(history, range(1, 101))
    history.add_resume(60)
    out = plot_loss_curve(
        history.metrics(), tmp_path / "plots" / "loss.png", history.checkpoint_steps(), history.resume_steps()
    )
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_without_losses_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no 'loss'"):
        plot_loss_curve([{"step": 1, "lr": 0.1}], tmp_path / "x.png")


def test_file_path_and_resume_step_at_construction(tmp_path):
    first = MetricsHistory(tmp_path / "metrics.jsonl", rank=0, resume_step=0)
    _train(first, range(1, 31))
    resumed = MetricsHistory(tmp_path / "metrics.jsonl", rank=0, resume_step=20)
    assert max(r["step"] for r in resumed.records) == 20
    fresh = MetricsHistory(tmp_path, rank=0, resume_step=0)  # a fresh start clears the old file
    assert fresh.records == [] and (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_full_disk_never_stops_the_history_and_the_file_is_caught_up(tmp_path, caplog):
    """``metrics.jsonl`` on a full disk (a link to ``/dev/full``: every write fails with ENOSPC):
    before, the append raised out of the training loop and ended the run. Now one warning, the
    records stay in memory, and once the file can be written again it gets every record in order."""
    import errno
    import json
    import logging

    full = tmp_path / "metrics.jsonl"
    full.symlink_to("/dev/full")
    try:
        open("/dev/full", "a").close()
    except OSError:
        pytest.skip("no /dev/full on this machine")
    history = MetricsHistory(tmp_path, rank=0)
    caplog.set_level(logging.INFO)
    for step in (1, 2, 3):
        history.append(step, {"loss": float(step)})
    assert [r["step"] for r in history.metrics()] == [1, 2, 3]
    warnings = [r for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and f"[Errno {errno.ENOSPC}]" in warnings[0].getMessage()
    full.unlink()  # the disk has room again
    history.add_checkpoint(4, "LOCAL")
    lines = [json.loads(x) for x in full.read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4] and lines[-1]["event"] == "checkpoint"
    assert "written again, 4 records caught up" in caplog.text
    assert [r["step"] for r in MetricsHistory(tmp_path, rank=0, resume_step=4).records] == [1, 2, 3, 4]


def test_a_rank_log_file_on_a_full_disk_is_said_once_not_per_record(tmp_path, capfd):
    """logging's FileHandler printed ``--- Logging error ---`` and a traceback for every record it
    could not write (41 in a 40-iteration run whose run_dir filled up). The rank's log file now says it
    once per failing stretch; its records still reach the other handlers."""
    import logging

    from tierstack.training.reporting import _RankLogFile

    try:
        open("/dev/full", "a").close()
    except OSError:
        pytest.skip("no /dev/full on this machine")
    (tmp_path / "rank0.log").symlink_to("/dev/full")
    handler = _RankLogFile(tmp_path / "rank0.log", mode="a", encoding="utf-8")
    logger = logging.getLogger("tierstack.test_full_log")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        handler.write_line("==== rank 0, pid 1, torchrun restart count 0 ====")  # raised in setup before the fix
        for n in range(5):
            logger.info("record %d", n)
    finally:
        logger.removeHandler(handler)
        handler.stream = None  # its buffered bytes can never be flushed to /dev/full
    err = capfd.readouterr().err
    assert err.count("cannot write the log file") == 1 and "No space left on device" in err
    assert "Logging error" not in err and handler.failing
