"""In-process restart (``resiliency.restart=in-process``) on real torchrun ranks: 2 active ranks and
1 warm spare (``--nproc-per-node 3``, ``resiliency.spare_ranks=1``), 30 steps of the tiny GPT, LOCAL
every 5. After step 12 one rank raises, is SIGKILLed, or is SIGSTOPped: the healthy ranks keep their
processes, resume step 10 from host memory, a dead (or hung, then killed) rank is replaced by the
spare, and the job ends with the losses of an uninterrupted run, bit for bit. Without a spare,
``torchrun --max-restarts`` takes over (the outer layer). With a memory step every iteration
(``checkpoint.memory_save_interval=1``) a rank that raises costs only the step in flight (resumed
from 11, in memory); a killed one still costs the steps since the file (its spare holds no memory
step: every rank resumes the file of step 10), unless the memory steps are in the node's shared
memory (``checkpoint.memory_dir``): then the spare adopts the dead process's and resumes 11 too.

Each scenario prints its fail -> first step time (the fault's unix time to the end of the first
step after the restart; under ``-s``), the number the README reports.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from launcher import run_nodes, run_torchrun

WORKER = Path(__file__).with_name("inprocess_worker.py")
REPO = Path(__file__).resolve().parents[3]
ACTIVE = 2  # ranks that train; a launch starts ACTIVE + resiliency.spare_ranks processes


def _launch(out: Path, fault: str = "", heartbeat_s: float = 2.0, spares: int = 1, launcher_args=(), extra=(),
            fault_at="12"):
    out.mkdir()
    run = out / "run"
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR"}  # gloo's and the store's per-poll warnings
    if fault:
        env.update(TIERSTACK_TEST_FAULT=fault, TIERSTACK_TEST_FAULT_AT=str(fault_at), TIERSTACK_TEST_FAULT_RANK="1")
    proc = run_torchrun([WORKER, out, f"logger.run_dir={run}", "train.train_iters=30", "checkpoint.local_save_interval=5",
                         f"checkpoint.save={run}/global", f"checkpoint.local_dir={run}/local",
                         "resiliency.restart=in-process", f"resiliency.heartbeat_timeout_s={heartbeat_s}",
                         f"resiliency.spare_ranks={spares}", "logger.loss_curve=true", *extra], nproc=ACTIVE + spares, timeout=240, env=env,
                        launcher_args=list(launcher_args))
    records = {r: [json.loads(x) for x in (out / f"losses_rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    return proc, proc.stdout + proc.stderr, records


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    proc, log, records = _launch(tmp_path_factory.mktemp("inprocess") / "uninterrupted")
    assert proc.returncode == 0, log[-6000:]
    for rank in (0, 1):
        assert [x["step"] for x in records[rank]] == list(range(1, 31))
    return records


def _fail_to_first_step_s(out: Path, records: list) -> float:
    """Seconds from the fault to the end of the first step of the restarted attempt."""
    t = json.loads((out / "fault.json").read_text())["t"]
    steps = [x["step"] for x in records]
    again = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])  # the first step done again
    return records[again]["t"] - t


def _check(tmp_path, uninterrupted, fault: str, resumed: int = 10, in_memory=(0,), extra=(), healthy=0):
    """``resumed``: the step every rank must resume; ``in_memory``: the ranks that take it from
    memory; ``healthy``: a rank that must keep its process."""
    out = tmp_path / fault
    proc, log, records = _launch(out, fault, extra=extra)
    assert proc.returncode == 0, log[-6000:]
    assert f"FAULT {fault} on rank 1" in log
    assert "in-process restart 1: rank 0 of 2 continues" in log
    for rank in (0, 1):  # every rank's log file (the console has rank 0's INFO lines only)
        taken = f"rank {rank}: LOCAL step {resumed} taken from host memory (no file read)"
        assert (taken in (out / "run" / "logs" / f"rank{rank}.log").read_text()) == (rank in in_memory), taken
    assert f"resumed from LOCAL checkpoint at iteration {resumed}" in log
    assert f"FINAL step=30 resumed_from=[{resumed}]" in log
    for rank in (0, 1):
        assert [x["step"] for x in records[rank]][:12] == list(range(1, 13))
        assert [x["step"] for x in records[rank]][-(30 - resumed):] == list(range(resumed + 1, 31))
        final = {x["step"]: x["loss"] for x in records[rank]}  # the last record of each step
        assert final == {x["step"]: x["loss"] for x in uninterrupted[rank]}, rank
    assert len({x["pid"] for x in records[healthy]}) == 1  # the healthy rank kept its process
    # the loss curve is drawn at the end, not on the restart's path (where NVRx's interruption cut
    # a matplotlib import in half and every later plot of the job failed)
    assert "could not write the loss curve" not in log, log[-6000:]
    assert (out / "run" / "loss_curve.png").is_file()
    fail_s = max(_fail_to_first_step_s(out, records[r]) for r in (0, 1))
    print(f"in-process restart, {fault}: fail -> first step {fail_s:.2f} s")
    return records, fail_s


@pytest.mark.slow
def test_a_rank_that_raises_restarts_in_its_own_process(tmp_path, uninterrupted):
    records, _ = _check(tmp_path, uninterrupted, "raise", in_memory=(0, 1))  # both ranks hold step 10
    assert len({x["pid"] for x in records[1]}) == 1  # the rank that raised is healthy: same process


@pytest.mark.slow
def test_with_dataloader_workers_a_rank_that_raises_still_restarts_in_process(tmp_path, uninterrupted):
    # Forked DataLoader workers held copies of the rank's gloo sockets: the rank that raised closed
    # its groups, its peer's collective never saw the connection close and stayed blocked in C
    # until NVRx's hard timeout killed it (the spare then took rank 0: a restart lost a process).
    records, _ = _check(tmp_path, uninterrupted, "raise", in_memory=(0, 1), extra=("dataset.num_workers=2",))
    assert len({x["pid"] for x in records[1]}) == 1


@pytest.mark.slow
def test_a_killed_rank_is_replaced_by_the_spare(tmp_path, uninterrupted):
    records, _ = _check(tmp_path, uninterrupted, "kill")
    pids = [x["pid"] for x in records[1]]
    assert len(set(pids[:12])) == 1 and len(set(pids[12:])) == 1 and pids[0] != pids[-1]  # the spare took rank 1


@pytest.mark.slow
def test_a_stopped_rank_is_killed_after_the_heartbeat_timeout_and_replaced(tmp_path, uninterrupted):
    records, fail_s = _check(tmp_path, uninterrupted, "stop")
    pids = [x["pid"] for x in records[1]]
    assert pids[0] != pids[-1]
    assert fail_s > 2.0  # found by the heartbeat timeout (resiliency.heartbeat_timeout_s=2), not before


@pytest.mark.slow
def test_a_rank_blocked_in_c_after_the_abort_is_killed_and_replaced_not_waited_for(tmp_path, uninterrupted):
    """Rank 1 raises while rank 0 is blocked in C (a 600 s sleep; a break-it pass saw a rank stuck
    in process-group creation for ``distributed.timeout_s``, 4 minutes, and the whole job with it):
    an async exception cannot reach it, so after the abort nothing vouches for it any more, NVRx's
    hard timeout (2 s + 1 s here) kills it and the spare takes rank 0. Rank 1 keeps its process and
    its memory; the spare reads rank 0's file; the losses are the uninterrupted run's."""
    records, fail_s = _check(tmp_path, uninterrupted, "raise_peer_blocked", in_memory=(1,), healthy=1)
    pids0, pids1 = [x["pid"] for x in records[0]], [x["pid"] for x in records[1]]
    assert pids0[0] != pids0[-1] and len(set(pids1)) == 1  # rank 0 replaced; rank 1 restarted in its process
    assert fail_s < 60.0, fail_s  # not the 600 s block, nor distributed.timeout_s


@pytest.mark.slow
def test_a_process_that_fails_every_set_up_after_a_restart_is_replaced_by_the_spare(tmp_path, uninterrupted):
    """Rank 1 raises after step 12, and every later attempt of its process fails before any step
    with the same error (what an import cut in half by NVRx's interruption leaves): at the second
    such failure the process leaves the job and the spare takes rank 1, instead of the job burning
    ``resiliency.max_in_process_restarts`` on it. Rank 0 keeps its process; losses as uninterrupted."""
    records, _ = _check(tmp_path, uninterrupted, "damaged", in_memory=(0,))
    pids = [x["pid"] for x in records[1]]
    assert pids[0] != pids[-1]  # the spare took rank 1
    log = (tmp_path / "damaged" / "run" / "logs" / "rank1.log").read_text()
    assert "attempt 2 failed before its first step as the one before it did (AttributeError" in log, log[-3000:]


MEMORY_STEPS = ["checkpoint.memory_save_interval=1"]


@pytest.mark.slow
def test_with_memory_steps_a_rank_that_raises_loses_only_the_step_in_flight(tmp_path, uninterrupted):
    """Step 11 was a memory step, sealed before the fault (the worker waits for the saves in
    flight): both ranks hold it, so both resume it from memory, with no file of it anywhere."""
    records, _ = _check(tmp_path, uninterrupted, "raise", resumed=11, in_memory=(0, 1), extra=MEMORY_STEPS)
    assert len({x["pid"] for x in records[1]}) == 1
    assert not list((tmp_path / "raise" / "run" / "local").glob("*/iter_0000011_*"))  # never a file


@pytest.mark.slow
def test_with_memory_steps_a_killed_rank_resumes_every_rank_from_the_file_step(tmp_path, uninterrupted):
    """The spare that takes rank 1 holds no memory step: selection skips step 11 as missing on
    rank 1, and every rank resumes the file of step 10 (rank 0's held step is 11, so it reads it)."""
    records, _ = _check(tmp_path, uninterrupted, "kill", resumed=10, in_memory=(), extra=MEMORY_STEPS)
    pids = [x["pid"] for x in records[1]]
    assert pids[0] != pids[-1]


@pytest.fixture
def node_memory_dir():
    with tempfile.TemporaryDirectory(prefix="tierstack-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        yield Path(d)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_with_memory_steps_in_node_memory_a_replaced_rank_loses_only_the_step_in_flight(tmp_path, uninterrupted,
                                                                                        node_memory_dir, fault):
    """With ``checkpoint.memory_dir`` the memory steps live in the node's shared memory: the spare
    that takes rank 1 after its process was killed (or hung, then killed) adopts the memory step 11
    the dead process left there, so every rank resumes 11 from memory, as after a raise. At the end
    nothing of the job is left in the node's memory."""
    extra = [*MEMORY_STEPS, f"checkpoint.memory_dir={node_memory_dir}"]
    records, _ = _check(tmp_path, uninterrupted, fault, resumed=11, in_memory=(0, 1), extra=extra)
    pids = [x["pid"] for x in records[1]]
    assert pids[0] != pids[-1]  # the spare took rank 1
    assert "rank 1: adopted memory step 11 from node memory" in (tmp_path / fault / "run" / "logs" / "rank1.log").read_text()
    assert not list((tmp_path / fault / "run" / "local").glob("*/iter_0000011_*"))  # never a file
    assert [p for p in node_memory_dir.rglob("*") if p.is_file()] == []


@pytest.mark.slow
def test_with_memory_steps_a_kill_before_the_first_file_starts_fresh(tmp_path, uninterrupted):
    """Killed after step 4, before the first LOCAL file (step 5): rank 0 holds memory step 3, the
    spare nothing. A memory step has no files, so it is no lost checkpoint that would refuse a
    fresh start (found by a break-it pass: every attempt refused it until the restarts ran out)."""
    out = tmp_path / "early-kill"
    proc, log, records = _launch(out, "kill", extra=MEMORY_STEPS, fault_at=4)
    assert proc.returncode == 0, log[-6000:]
    assert "LOCAL memory step 3 skipped: rank(s) [1] do not hold it" in log, log[-6000:]
    assert "FINAL step=30 resumed_from=[]" in log
    for rank in (0, 1):
        assert [x["step"] for x in records[rank]] == [1, 2, 3, 4, *range(1, 31)]
        final = {x["step"]: x["loss"] for x in records[rank][4:]}
        assert final == {x["step"]: x["loss"] for x in uninterrupted[rank]}, rank


@pytest.mark.slow
def test_a_non_finite_state_with_on_nonfinite_stop_ends_the_job_without_restarts(tmp_path):
    """``checkpoint.on_nonfinite=stop`` is a decision every rank takes together, not a fault: the
    job stops once, with the reason, instead of restarting in-process until the restarts run out
    (found by a break-it pass: 8 attempts, each stopped again by the same state)."""
    out = tmp_path / "nonfinite"
    proc, log, records = _launch(out, "nonfinite", extra=[*MEMORY_STEPS, "checkpoint.on_nonfinite=stop"])
    assert proc.returncode != 0
    assert "LOCAL memory step 12: non-finite parameters or optimizer moments on rank 1" in log, log[-6000:]
    assert "rank 0 stops: NonFiniteError: step 12" in log and "not restarted in-process" in log, log[-6000:]
    assert "in-process restart 1" not in log
    assert [x["step"] for x in records[0]] == list(range(1, 13))


@pytest.mark.slow
def test_spare_replacements_after_a_launcher_restart_are_not_counted_as_launcher_restarts(tmp_path, uninterrupted,
                                                                                          node_memory_dir):
    """Under ``torchrun --max-restarts 1`` with one spare: a kill after step 8 (the spare takes rank
    1), one after step 14 (no spare left: torchrun restarts the job, a new spare with it), one
    after step 20 (that spare takes rank 1). Only the second is a launcher restart (found by a
    break-it pass: every in-process attempt after a launcher restart counted as one more, so the
    third kill ended the job with "restarted 2 times, more than --max-restarts=1"). The memory
    steps are in node memory, so each resume, the launcher's included, takes the step before the kill."""
    out = tmp_path / "three-kills"
    proc, log, records = _launch(out, "kill", fault_at="8,14,20", launcher_args=["--max-restarts", "1"],
                                 extra=[*MEMORY_STEPS, f"checkpoint.memory_dir={node_memory_dir}"])
    assert proc.returncode == 0, log[-6000:]
    assert json.loads((out / "run" / "restarts.json").read_text())["restarts"] == 1
    assert "more than --max-restarts" not in log
    assert "FINAL step=30 resumed_from=[7, 13, 19]" in log, log[-6000:]
    for rank in (0, 1):
        final = {x["step"]: x["loss"] for x in records[rank]}
        assert final == {x["step"]: x["loss"] for x in uninterrupted[rank]}, rank


@pytest.mark.slow
def test_a_planned_exit_is_not_trained_past_when_the_spare_dies_of_the_same_sigterm(tmp_path):
    """SIGTERM to torchrun after step 12: every rank (the spare too) gets it; the active ranks
    agree, save GLOBAL and stop. The spare dies of it, which NVRx takes for a fault; the restart
    that follows must not train again (found by a break-it pass: it resumed the planned exit's
    checkpoint and trained on to the last iteration after the job was told to stop). When the
    restart cuts the planned exit's save short, the stop request is held for the next attempt,
    which resumes and stops after one step with its checkpoint kept."""
    out = tmp_path / "term"
    proc, log, records = _launch(out, "term", fault_at="12")
    rank0 = (out / "run" / "logs" / "rank0.log").read_text()
    stops = [int(line.split("stopping at iteration ")[1].split(":")[0]) for line in rank0.splitlines()
             if "stopping at iteration " in line]
    assert stops and 12 <= stops[0] and stops[-1] <= stops[0] + 1, log[-6000:]
    for rank in (0, 1):  # the last step trained is the stop's (an earlier one when a cut-short save lost steps)
        assert records[rank][-1]["step"] == stops[-1], rank
    assert (out / "run" / "global" / f"iter_{stops[-1]:07d}" / "manifest.json").is_file(), log[-6000:]


@pytest.mark.slow
def test_without_a_spare_the_launchers_restart_takes_over(tmp_path, uninterrupted):
    """``resiliency.spare_ranks=0`` under ``torchrun --max-restarts 1``: a killed rank cannot be
    replaced in-process, so the job ends (never a silently smaller world) and torchrun restarts it."""
    out = tmp_path / "no-spare"
    proc, log, records = _launch(out, "kill", spares=0, launcher_args=["--max-restarts", "1"])
    assert proc.returncode == 0, log[-6000:]
    assert "1 rank(s) left of 2 (resiliency.spare_ranks=0 used up)" in log
    assert "stops: in-process restart 1: 1 rank(s) left of 2" in log  # one line per rank, no traceback
    assert "tierstack.resiliency.in_process.RestartLimitReached:" not in log, log[-6000:]
    assert json.loads((out / "run" / "restarts.json").read_text())["restarts"] == 1
    assert "resumed from LOCAL checkpoint at iteration 10" in log and "FINAL step=30 resumed_from=[10]" in log
    for rank in (0, 1):
        final = {x["step"]: x["loss"] for x in records[rank]}
        assert final == {x["step"]: x["loss"] for x in uninterrupted[rank]}, rank


@pytest.mark.slow
def test_on_two_nodes_a_killed_rank_is_replaced_by_a_spare_of_its_own_node(tmp_path, uninterrupted, node_memory_dir):
    """2 simulated nodes x (1 rank + 1 spare) (``resiliency.spare_ranks=2``, replicas on the other
    node): rank 0 trains on node 0, rank 1 on node 1. Rank 1's process is killed after step 12: the
    spare of node 1 takes rank 1 (never node 0's, which would find neither its node-local files nor
    its node memory), adopts the memory step 11 the dead process left in node 1's memory, and every
    rank resumes 11 with no file read; rank 0 keeps its process."""
    out = tmp_path / "nodes"
    out.mkdir()
    run = out / "run"
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "TIERSTACK_TEST_FAULT": "kill", "TIERSTACK_TEST_FAULT_AT": "12",
           "TIERSTACK_TEST_FAULT_RANK": "1"}
    proc = run_nodes([WORKER, out, f"logger.run_dir={run}", "train.train_iters=30", "checkpoint.local_save_interval=5",
                      f"checkpoint.save={run}/global", "checkpoint.replication_factor=2", "resiliency.restart=in-process",
                      "resiliency.heartbeat_timeout_s=2", "resiliency.spare_ranks=2", *MEMORY_STEPS,
                      f"checkpoint.memory_dir={node_memory_dir}"], nodes=2, nproc=2, timeout=300, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    records = {r: [json.loads(x) for x in (out / f"losses_rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    for rank in (0, 1):  # each rank trained on its own node, before the kill and after it
        assert {x["node"] for x in records[rank]} == {rank}, rank
        final = {x["step"]: x["loss"] for x in records[rank]}
        assert final == {x["step"]: x["loss"] for x in uninterrupted[rank]}, rank
    assert len({x["pid"] for x in records[0]}) == 1
    pids = [x["pid"] for x in records[1]]
    assert pids[0] != pids[-1]  # node 1's spare took rank 1
    assert "rank 1: adopted memory step 11 from node memory" in (run / "logs" / "rank1.log").read_text(), log[-6000:]
    assert "FINAL step=30 resumed_from=[11]" in log, log[-6000:]



@pytest.mark.slow
def test_a_relaunch_with_a_changed_model_is_refused_once_and_not_restarted(tmp_path):
    """Bad input under in-process restart (the model changed between two launches of one run,
    ``tierstack pretrain gpt_tiny --nproc-per-node 3 --restart in-process``): exit status 2 at once,
    no in-process restart, and the refusal (its list of fields) printed once, by rank 0. Before,
    the same text came five more times (each rank's stop line, NVRx's exit line of each rank, the
    woken spare's line), and a spare's rehearsal printed a refusal of its own
    (``checkpoint.exit_on_missing_checkpoint`` in its empty rehearsal directory)."""
    run = tmp_path / "run"
    common = ["--nproc-per-node", "3", "--restart", "in-process", "resiliency.heartbeat_timeout_s=3",
              "resiliency.spare_ranks=1", "dataset.mock=true", "mlflow=null", "straggler=null", "train.eval_interval=null",
              f"logger.run_dir={run}", f"checkpoint.save={run}/global", f"checkpoint.local_dir={run}/local",
              "checkpoint.save_interval=null", "checkpoint.local_save_interval=5"]

    def launch(*args):
        proc = subprocess.run([sys.executable, "-m", "tierstack.cli", "pretrain", "gpt_tiny", *common, *args],
                              capture_output=True, text=True, timeout=300, cwd=REPO,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})
        return proc, proc.stdout + proc.stderr

    first, log = launch("train.train_iters=5")
    assert first.returncode == 0, log[-6000:]
    second, log = launch("train.train_iters=10", "model.num_layers=3", "checkpoint.exit_on_missing_checkpoint=true")
    assert second.returncode == 2, log[-6000:]
    assert log.count("model.num_layers: 4 in the checkpoint, 3 now") == 1, log[-6000:]
    assert "rank 0 stops: CheckpointMismatchError (bad input, said above by rank 0)" in log, log[-6000:]
    assert "in-process restart 1" not in log, log[-6000:]
    # the spare's rehearsal resumes nothing: it is never refused for that (it may still be cut short
    # by the job's stop, which only means a cold spare)
    assert "no checkpoint was found" not in log, log[-6000:]
    assert "tierstack.progress: iter " not in log, log[-6000:]  # no step trained
