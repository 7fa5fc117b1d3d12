"""SIGTERM on one rank: every rank stops after the same step, a GLOBAL checkpoint is published, exit 0."""

import json
import re
from pathlib import Path

import pytest

from launcher import started_launch

WORKER = Path(__file__).with_name("worker.py")


@pytest.mark.slow
def test_sigterm_on_one_rank_saves_global_and_stops_all(tmp_path, torchrun):
    run = tmp_path / "tiny"
    proc = torchrun(
        [WORKER, tmp_path, "distributed.tensor_model_parallel_size=1",
         f"checkpoint.save={run}/checkpoints", "checkpoint.save_interval=100", "checkpoint.async_save=true"],
        env={"TIERSTACK_TEST_SIGTERM_AT": "5"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "received SIGTERM on rank 1: saving a GLOBAL checkpoint of iteration 5, then stopping" in proc.stderr
    assert "stopping at iteration 5: SIGTERM received on some rank" in proc.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["train_state"]["step"] for r in ranks] == [5, 5]
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert (run / "checkpoints" / "iter_0000005").is_dir()


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_the_ranks_with_a_planned_exit_and_status_143(tmp_path):
    """Found by the break-it pass: SIGTERM to `tierstack pretrain --nproc-per-node N` (what a scheduler
    sends) printed torchrun's raw SignalException traceback and exited 1. Now torchrun stops the
    ranks, each saves at its planned exit, and the launcher says what happened and exits 128 + 15."""
    import os
    import signal
    import sys
    import time

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "tierstack.cli", "pretrain", "gpt_tiny", "--nproc-per-node", "1",
           "distributed.tensor_model_parallel_size=1", "dataset.mock=true", "train.train_iters=100000",
           "train.eval_interval=null", "mlflow=null", "straggler=null", f"logger.run_dir={run}",
           f"checkpoint.save={run}/checkpoints", "checkpoint.save_interval=2", "checkpoint.local_save_interval=null",
           f"checkpoint.local_dir={run}/local"]  # never the default runs/gpt_tiny/local of the user
    tracker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    with open(tmp_path / "out.txt", "w+") as out, open(tmp_path / "err.txt", "w+") as err, started_launch(
            cmd, stdout=out, stderr=err, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}) as proc:
        deadline = time.monotonic() + 240
        while not tracker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert tracker.exists(), (tmp_path / "err.txt").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)  # the launcher only, as `kill <pid>` or a scheduler would
        rc = proc.wait(timeout=180)
    stderr = (tmp_path / "err.txt").read_text()
    assert rc == 128 + signal.SIGTERM, stderr[-4000:]
    assert "the launcher received SIGTERM; torchrun stopped the ranks (exit status 143)" in stderr
    assert "SignalException" not in stderr and "Traceback" not in stderr, stderr[-4000:]
    assert "received SIGTERM" in stderr.replace("the launcher received SIGTERM", "")  # the rank's planned exit
    saved = int(tracker.read_text())
    assert saved >= 2 and (run / "checkpoints" / f"iter_{saved:07d}").is_dir()


@pytest.mark.slow
def test_ranks_whose_launcher_is_killed_checkpoint_and_stop_instead_of_training_on_as_orphans(tmp_path):
    """Found by the break-it pass: SIGKILL to `tierstack pretrain --nproc-per-node N` left its ranks
    (each in a session of its own) training as orphans, and a relaunch on the same run directory
    wrote beside them. Each rank now gets SIGHUP when its launcher dies: a planned exit, with its
    GLOBAL checkpoint. (SIGHUP, not SIGTERM: the signal came 2-3 times as the dying launcher's
    threads exited one by one, and a third SIGTERM killed the rank before it saved.)"""
    import os
    import signal
    import sys
    import time

    import psutil

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "tierstack.cli", "pretrain", "gpt_tiny", "--nproc-per-node", "2",
           "dataset.mock=true", "train.train_iters=100000", "train.eval_interval=null", "mlflow=null",
           "straggler=null", "logger.log_interval=1", f"logger.run_dir={run}", "checkpoint.save_interval=100000",
           "checkpoint.local_save_interval=null"]
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_path, "w+") as out, open(err_path, "w+") as err, started_launch(
            cmd, stdout=out, stderr=err, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}) as proc:
        deadline = time.monotonic() + 240
        while "iter 3/" not in out_path.read_text() + err_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.2)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "tierstack.cli" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        proc.send_signal(signal.SIGKILL)  # the launcher only (an OOM kill, kill -9)
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs(ranks, timeout=120)
        assert not alive, f"ranks still running 120 s after their launcher died: {alive}"
    log = out_path.read_text() + err_path.read_text()
    # announced once the ranks agreed to stop (when the save can happen), not by the signal handler
    assert re.search(r"received SIGHUP \(the launcher is gone\) on rank [0-9, ]+: saving a GLOBAL checkpoint of "
                     r"iteration \d+, then stopping", log), log[-4000:]
    tracker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert tracker.exists(), log[-6000:]
    saved = int(tracker.read_text())  # the planned exit's GLOBAL checkpoint
    assert saved >= 3 and (run / "checkpoints" / f"iter_{saved:07d}").is_dir()


def _launch_then_signal(tmp_path, sig, *, slow_save_s: float = 0.0, timeout: float = 300):
    """``tierstack pretrain --nproc-per-node 2`` until iteration 3, then ``sig`` to the launcher only;
    with ``slow_save_s``, rank 0's first GLOBAL write after the signal waits that long (a slow file
    system: the faults of tests/functional_tests/resiliency). Returns (status, log, run dir, seconds
    from the signal to the launcher's exit)."""
    import json as json_mod
    import os
    import sys
    import time

    run = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)  # the launcher's own grace, not one inherited
    if slow_save_s:
        inject = Path(__file__).parents[1] / "resiliency" / "inject"
        (tmp_path / "faults").mkdir()
        env.update(TIERSTACK_FAULT_DIR=str(tmp_path / "faults"), PYTHONPATH=os.pathsep.join(
            [str(inject), env.get("PYTHONPATH", "")]), TIERSTACK_FAULTS=json_mod.dumps([{
                "id": "slow-final-save", "op": "write", "path": f"{run}/checkpoints/*staging*", "rank": 0,
                "sleep": slow_save_s, "times": 1, "if_exists": str(tmp_path / "signalled")}]))
    cmd = [sys.executable, "-m", "tierstack.cli", "pretrain", "gpt_tiny", "--nproc-per-node", "2",
           "dataset.mock=true", "train.train_iters=100000", "train.eval_interval=null", "mlflow=null",
           "straggler=null", "logger.log_interval=1", f"logger.run_dir={run}", "checkpoint.save_interval=null",
           "checkpoint.local_save_interval=null"]
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_path, "w+") as out, open(err_path, "w+") as err, started_launch(
            cmd, stdout=out, stderr=err, env=env) as proc:
        deadline = time.monotonic() + 240
        while "iter 3/" not in out_path.read_text() + err_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.2)
        (tmp_path / "signalled").touch()
        t0 = time.monotonic()
        proc.send_signal(sig)  # the launcher only, as a scheduler would
        rc = proc.wait(timeout=timeout)
        seconds = time.monotonic() - t0
    return rc, out_path.read_text() + err_path.read_text(), run, seconds


@pytest.mark.slow
def test_a_planned_exit_save_longer_than_torchruns_30_s_is_published(tmp_path):
    """Found by reading torchrun: it SIGKILLs the ranks 30 s after forwarding SIGTERM
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), so a final save that needs 40 s was lost. The launcher now
    gives the ranks the grace the checkpoint settings bound."""
    import signal

    rc, log, run, seconds = _launch_then_signal(tmp_path, signal.SIGTERM, slow_save_s=40)
    assert "slow-final-save" in (tmp_path / "faults" / "fired.log").read_text(), log[-4000:]
    assert rc == 128 + signal.SIGTERM, log[-4000:]
    assert seconds >= 40, seconds  # the save really outlasted torchrun's default
    tracker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert tracker.exists(), log[-6000:]
    assert (run / "checkpoints" / f"iter_{int(tracker.read_text()):07d}").is_dir()


@pytest.mark.slow
def test_the_early_warning_signal_makes_the_same_planned_exit(tmp_path):
    """SIGUSR1 (train.exit_signal, what SLURM's --signal=USR1@N sends) to the launcher: torchrun
    forwards it, every rank checkpoints at the same step and stops."""
    import signal

    rc, log, run, _ = _launch_then_signal(tmp_path, signal.SIGUSR1)
    assert rc == 128 + signal.SIGUSR1, log[-4000:]
    assert re.search(r"received SIGUSR1 \(train.exit_signal\) on rank [0-9, ]+: saving a GLOBAL checkpoint of "
                     r"iteration \d+, then stopping", log), log[-4000:]
    assert "SIGUSR1 (train.exit_signal) received on some rank" in log
    tracker = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert tracker.exists() and (run / "checkpoints" / f"iter_{int(tracker.read_text()):07d}").is_dir(), log[-6000:]


@pytest.mark.slow
def test_a_rank_failing_alone_runs_no_checkpoint_collective_while_it_unwinds(tmp_path, torchrun):
    """Found by reading: rank 1 failed alone (an error of its own in a forward) while a LOCAL save
    was in flight, and its close finalized that save with WORLD all-reduces that rank 0, inside the
    step's collectives, never entered. It now closes without collectives: its own error is what
    ends the launch, at once, and no closer fails on a collective."""
    import time

    run = tmp_path / "tiny"
    t0 = time.monotonic()
    proc = torchrun([WORKER, tmp_path, "distributed.tensor_model_parallel_size=2", "train.train_iters=20",
                     "train.eval_interval=null", f"checkpoint.local_dir={run}/local", "checkpoint.local_save_interval=4",
                     "checkpoint.collective_timeout_s=60"], env={"TIERSTACK_TEST_RAISE_AT": "5"}, timeout=300)
    seconds = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-4000:]
    assert "injected: an error of rank 1 only, in the forward of step 5" in log, log[-4000:]
    assert "LOCAL save of step 4 abandoned on rank 1" in log, log[-4000:]
    assert "rank 1 stops on an error of its own (RuntimeError)" in log
    assert "closing checkpoint manager failed" not in log and "CollectiveError" not in log, log[-4000:]
    assert seconds < 60 + 30, seconds  # never a collective timeout on the way out
