"""Two simulated nodes x 1 rank (scripts/launch_nodes.sh): lose node 1 and its node-local disk.

With ``checkpoint.replication_factor=2`` the relaunch retrieves rank 1's LOCAL step 10 from the
replica on node 0 and goes on bit for bit; when that replica is damaged, the copy is refused and
the ranks take the older step 5 from the replicas; when rank 1's own file of step 10 is damaged
instead, rank 1 takes step 10 from its replica; without replicas the same loss cannot resume from
LOCAL: the error names the rank that misses step 10, and no good file on the surviving node is renamed.
When the relaunch gives each node the other's disk (the rendezvous decides which agent becomes which
node), every file is still on the right node, only in the other folder: the run resumes from LOCAL.
"""

import json
import re
import shutil
from pathlib import Path

import pytest

from launcher import run_nodes
from tierstack.checkpointing import paths

WORKER = Path(__file__).with_name("nodes_worker.py")
COMMON = ["train.train_iters=12", "checkpoint.local_save_interval=5"]  # GLOBAL only at the end


def _launch(out: Path, label: str, *overrides: str, env=None):
    proc = run_nodes([WORKER, out, f"logger.run_dir={out}/run", f"checkpoint.save={out}/run/global", *COMMON,
                      *overrides], timeout=240, env={"TIERSTACK_TEST_LAUNCH": label, **(env or {})})
    return proc, proc.stdout + proc.stderr


def _losses(out: Path, rank: int, label: str) -> dict[int, str]:
    lines = [json.loads(x) for x in (out / f"losses_rank{rank}.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if r["launch"] == label}


@pytest.mark.slow
def test_a_lost_node_resumes_from_a_replica_and_without_one_says_which_ranks_miss_the_step(tmp_path):
    """Four launches. The first runs all 12 steps uninterrupted and is killed (node 1, SIGKILL) after
    the last one, before the final GLOBAL save: it is the reference for every resumed loss and
    leaves only LOCAL steps 5 and 10. The others resume from copies of what it left."""
    lost = tmp_path / "lost"
    lost.mkdir()
    proc, log = _launch(lost, "killed", "checkpoint.replication_factor=2",
                        env={"TIERSTACK_TEST_KILL_AT": "12", "TIERSTACK_TEST_KILL_NODE": "1"})
    assert proc.returncode != 0, log[-5000:]
    assert "LOCAL checkpoint of step 10 replicated" in log and "LOCAL checkpoint of step 10 sealed on every rank" in log
    global_root = lost / "run" / "global"  # killed before the final GLOBAL save: nothing published
    assert not [p for p in global_root.glob("iter_*") if paths.parse_step_dir(p.name) is not None]
    reference = {rank: _losses(lost, rank, "killed") for rank in (0, 1)}
    assert all(sorted(reference[rank]) == list(range(1, 13)) for rank in (0, 1))
    node_dir = Path(re.search(r"KILLING node 1 rank 1 after step 12; local_dir=(\S+)", log).group(1)).parent
    unreplicated, damaged = tmp_path / "unreplicated", tmp_path / "damaged"
    shutil.copytree(lost, unreplicated)  # the same loss, for the cases below
    shutil.copytree(lost, damaged)
    shutil.rmtree(node_dir)  # the node is replaced: its node-local disk is empty

    proc, log = _launch(lost, "resumed", "checkpoint.replication_factor=2")
    assert proc.returncode == 0, log[-5000:]
    assert "LOCAL step 10 of rank 1 retrieved from rank 0:" in log and "(checksum verified)" in log
    assert "resumed from LOCAL checkpoint at iteration 10" in log
    assert "FINAL step=12 resumed_from=[10]" in log
    for rank in (0, 1):
        expected = {s: v for s, v in reference[rank].items() if s > 10}
        assert _losses(lost, rank, "resumed") == expected and sorted(expected) == [11, 12]  # float hex: bit for bit

    # The replica of rank 1's step 10 is damaged: refused after the transfer, step 5 is rebuilt instead.
    shutil.rmtree(damaged / node_dir.relative_to(lost))
    (replica,) = (damaged / "run").glob("node*/local/replicas/1/iter_0000010_1_local.pt")
    data = bytearray(replica.read_bytes())
    data[len(data) // 2] ^= 0xFF
    replica.write_bytes(bytes(data))
    # (This relaunch replicates the LOCAL step 10 it saves in the finalize, as on a GPU.)
    proc, log = _launch(damaged, "damaged", "checkpoint.replication_factor=2",
                        env={"TIERSTACK_TEST_REPLICATE_IN_FINALIZE": "1"})
    assert proc.returncode == 0, log[-5000:]
    assert "LOCAL checkpoint of step 10 replicated (factor 2" in log  # replicate_step's own line
    assert "LOCAL step 10 of rank 1 retrieved from rank 0 is damaged (checksum-mismatch" in log
    assert "LOCAL step 5 of rank 1 retrieved from rank 0:" in log and "resumed from LOCAL checkpoint at iteration 5" in log
    for rank in (0, 1):
        assert _losses(damaged, rank, "damaged") == {s: v for s, v in reference[rank].items() if s > 5}

    # Without replication: no copy of rank 1's files anywhere.
    run = unreplicated / "run"
    shutil.rmtree(run / node_dir.relative_to(lost / "run"))
    for replicas in run.glob("node*/local/replicas"):
        shutil.rmtree(replicas)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and "local" in p.parts)
    proc, log = _launch(unreplicated, "unreplicated")
    assert proc.returncode != 0
    assert "local step 10: missing on rank(s) [1]" in log and "local step 5: missing on rank(s) [1]" in log
    assert "checkpoint.allow_fresh_start_on_invalid=true" in log
    after = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and "local" in p.parts)
    assert after == before and not any(".invalid-" in p for p in after)  # no good file renamed
    assert any(p.endswith("iter_0000010_0_local.pt") for p in after)


@pytest.mark.slow
def test_a_damaged_own_file_is_replaced_by_its_replica_instead_of_falling_back_to_an_older_step(tmp_path):
    """A launch killed after step 12 (LOCAL steps 5 and 10 sealed and replicated, no GLOBAL); then
    rank 1's own file of step 10 is damaged (same size: only its checksum tells), its replica on
    node 0 is good. The relaunch quarantines rank 1's file and retrieves step 10 from the replica,
    and goes on bit for bit. (Before the fix, found by the chaos soak: every rank fell back to step 5,
    losing a LOCAL interval that a peer held intact.)"""
    proc, log = _launch(tmp_path, "killed", "checkpoint.replication_factor=2",
                        env={"TIERSTACK_TEST_KILL_AT": "12", "TIERSTACK_TEST_KILL_NODE": "1"})
    assert proc.returncode != 0 and "LOCAL checkpoint of step 10 sealed on every rank" in log, log[-5000:]
    reference = {rank: _losses(tmp_path, rank, "killed") for rank in (0, 1)}
    (own,) = (tmp_path / "run").glob("node*/local/1/iter_0000010_1_local.pt")
    data = bytearray(own.read_bytes())
    data[len(data) // 2] ^= 0xFF
    own.write_bytes(bytes(data))

    proc, log = _launch(tmp_path, "own_damaged", "checkpoint.replication_factor=2")
    assert proc.returncode == 0, log[-5000:]
    assert "rank 1's own LOCAL file of step 10 is damaged (checksum-mismatch" in log, log[-5000:]
    assert "LOCAL step 10 of rank 1 retrieved from rank 0:" in log and "(checksum verified)" in log
    assert "resumed from LOCAL checkpoint at iteration 10" in log and "FINAL step=12 resumed_from=[10]" in log
    assert list(own.parent.glob("iter_0000010_1_local.pt.invalid-checksum-mismatch*"))  # kept for inspection
    assert not list(own.parent.glob("iter_0000005_1_local.pt.invalid-*"))
    for rank in (0, 1):
        expected = {s: v for s, v in reference[rank].items() if s > 10}
        assert _losses(tmp_path, rank, "own_damaged") == expected and sorted(expected) == [11, 12]


@pytest.mark.slow
def test_nodes_that_swapped_disks_resume_from_local_bit_for_bit(tmp_path):
    """Issue 9. The rendezvous gives node indices anew at every launch (and a requeued job lands on
    other hosts), so node 0's ranks may find node 1's disk: their own files under ``replicas/<rank>``
    and the other node's rank folder. Simulated by swapping the two node-local directories between
    a launch killed after step 12 (LOCAL steps 5 and 10 sealed and replicated, no GLOBAL) and the
    relaunch, which must move the files into place, resume from step 10 and go on bit for bit."""
    proc, log = _launch(tmp_path, "killed", "checkpoint.replication_factor=2",
                        env={"TIERSTACK_TEST_KILL_AT": "12", "TIERSTACK_TEST_KILL_NODE": "1"})
    assert proc.returncode != 0, log[-5000:]
    assert "LOCAL checkpoint of step 10 sealed on every rank" in log, log[-5000:]
    reference = {rank: _losses(tmp_path, rank, "killed") for rank in (0, 1)}
    # where each rank ran (the agents keep their node index across launches: torchrun sorts them by pid)
    node = {r: next(d for d in (tmp_path / "run").glob("node*") if (d / "local" / str(r)).is_dir()) for r in (0, 1)}
    swap = tmp_path / "run" / "swap"
    node[0].rename(swap), node[1].rename(node[0]), swap.rename(node[1])
    assert (node[0] / "local" / "replicas" / "0" / "iter_0000010_0_local.pt").is_file()  # rank 0's, a replica there

    proc, log = _launch(tmp_path, "swapped", "checkpoint.replication_factor=2")
    assert proc.returncode == 0, log[-5000:]
    # (before the fix (#9): no rank found a file of its own, and the launch stopped)
    assert "resumed from LOCAL checkpoint at iteration 10" in log, log[-5000:]
    assert "FINAL step=12 resumed_from=[10]" in log
    for rank, other in ((0, 1), (1, 0)):  # on its node: its own files as replicas, and the other rank's folder
        root = node[rank] / "local"
        assert f"LOCAL step(s) [5, 10] of rank {rank} found under {root}/replicas/{rank} on the node of rank(s) " \
               f"[{rank}]: moved to {root}/{rank}, adopted" in log, log[-5000:]
        assert f"LOCAL step(s) [5, 10] of rank {other} found under {root}/{other} on the node of rank(s) [{rank}]: " \
               f"moved to {root}/replicas/{other}, held as a replica" in log, log[-5000:]
    assert "retrieved from rank" not in log  # every file was on its node
    for rank in (0, 1):
        expected = {s: v for s, v in reference[rank].items() if s > 10}
        assert _losses(tmp_path, rank, "swapped") == expected and sorted(expected) == [11, 12]  # float hex: bit for bit
    layout = sorted(str(p.relative_to(node[0])) for p in node[0].rglob("iter_*"))
    assert layout == [f"local/{d}/iter_00000{s:02d}_{r}_local.{x}" for d, r in (("0", 0), ("replicas/1", 1))
                      for s in (5, 10) for x in ("manifest.json", "pt")]  # the other rank's folder is gone


@pytest.mark.slow
def test_swapped_disks_without_replicas_stop_the_launch_and_name_the_files(tmp_path):
    """Without replication nothing can move the files to the node that needs them: the relaunch
    finds the run's LOCAL checkpoints only in other ranks' folders. The GLOBAL directory holds only
    the run's ``run.json``, so this looks like a run that failed before its first checkpoint; the
    LOCAL files are its history and the launch stops, naming them, never a silent fresh start."""
    proc, log = _launch(tmp_path, "killed", env={"TIERSTACK_TEST_KILL_AT": "12", "TIERSTACK_TEST_KILL_NODE": "1"})
    assert proc.returncode != 0 and "LOCAL checkpoint of step 10 sealed on every rank" in log, log[-5000:]
    node = {r: next(d for d in (tmp_path / "run").glob("node*") if (d / "local" / str(r)).is_dir()) for r in (0, 1)}
    swap = tmp_path / "run" / "swap"
    node[0].rename(swap), node[1].rename(node[0]), swap.rename(node[1])
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("iter_*"))
    proc, log = _launch(tmp_path, "swapped")
    assert proc.returncode != 0, log[-5000:]
    assert "an earlier run left files here but no valid checkpoint to resume from" in log, log[-5000:]
    assert "iter_0000010_1_local.pt" in log and "never completed a checkpoint" not in log
    assert "swapped" not in {json.loads(x)["launch"] for x in (tmp_path / "losses_rank0.jsonl").read_text().splitlines()}
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("iter_*")) == before  # all left as found


@pytest.mark.slow
def test_a_step_replicated_by_the_writers_survives_a_node_lost_before_it_was_sealed(tmp_path):
    """The clique exchange runs on the LOCAL writer right after the write (CPU), not at the next
    agreement: node 1 dies after step 11, with step 10's writers ended on both ranks and no rank
    having sealed step 10 (that agreement comes after step 11); its disk is wiped, and the relaunch still resumes from step 10 (rank 1's file from the
    replica on node 0). With the exchange at the agreement, no replica of 10 existed yet: step 5."""
    proc, log = _launch(tmp_path, "unsealed", "checkpoint.replication_factor=2",
                        env={"TIERSTACK_TEST_KILL_AT": "11", "TIERSTACK_TEST_KILL_NODE": "1",
                             "TIERSTACK_TEST_KILL_UNSEALED": "1"})
    assert proc.returncode != 0, log[-5000:]
    assert "rank 1: LOCAL writer of step 10 ended, step not sealed" in log, log[-5000:]
    assert "LOCAL checkpoint of step 10 sealed" not in log
    node_dir = Path(re.search(r"KILLING node 1 rank 1 after step 11; local_dir=(\S+)", log).group(1)).parent
    assert list((tmp_path / "run").glob("node*/local/replicas/1/iter_0000010_1_local.pt")), log[-8000:]  # on node 0
    shutil.rmtree(node_dir)
    proc, log = _launch(tmp_path, "resumed", "checkpoint.replication_factor=2")
    assert proc.returncode == 0, log[-5000:]
    assert "LOCAL step 10 of rank 1 retrieved from rank 0:" in log
    assert "FINAL step=12 resumed_from=[10]" in log



@pytest.mark.slow
def test_a_write_failing_on_one_rank_fails_the_replicated_step_everywhere_without_a_hang(tmp_path):
    """Rank 1 cannot write its LOCAL file (its folder is a file): its writer still takes part in the
    clique exchange, sending nothing; rank 0 refuses the empty copy. Every rank agrees the step
    failed, no replica of it stays, and training goes on to the end (GLOBAL save at the end)."""
    blocked = tmp_path / "run" / "node1" / "local" / "1"
    blocked.parent.mkdir(parents=True)
    blocked.write_text("not a folder")
    proc, log = _launch(tmp_path, "blocked", "checkpoint.replication_factor=2", "train.train_iters=6")
    assert proc.returncode == 0, log[-5000:]
    assert "LOCAL checkpoint of step 5 NOT saved" in log, log[-5000:]
    assert "LOCAL write of step 5 failed on rank 1" in log
    assert "LOCAL checkpoint of step 5 sealed" not in log and "FINAL step=6" in log
    assert not list((tmp_path / "run").glob("node*/local/replicas/*/iter_0000005_*"))
    assert not list((tmp_path / "run").glob("node0/local/0/iter_0000005_*"))  # rank 0's own file removed


@pytest.mark.slow
def test_a_slow_write_waits_for_the_write_timeout_and_a_timed_out_one_leaves_replication_working(tmp_path):
    """The writers' exchange waits for the slowest member's write as long as the training thread
    does (``checkpoint.async_write_timeout_s``), not the shorter collective or training timeouts:
    rank 1's write of step 5 takes longer than both and step 5 is still sealed. Its write of step 10
    outlasts the write timeout: step 10 fails on every rank, its writers are left behind, and step
    15 is exchanged on new clique groups and sealed (a timed-out gloo pair stays closed, and the
    writer left behind must not meet the next exchange)."""
    proc, log = _launch(tmp_path, "slow", "checkpoint.replication_factor=2", "train.train_iters=17",
                        "distributed.timeout_s=8", "checkpoint.collective_timeout_s=2",
                        "checkpoint.async_write_timeout_s=14",
                        env={"TIERSTACK_TEST_SLOW_LOCAL_WRITE": "1:5:10,1:10:18"})
    assert proc.returncode == 0, log[-5000:]
    assert "rank 1: LOCAL writer of step 5 sleeps 10 s" in log
    assert "LOCAL checkpoint of step 5 sealed on every rank" in log, log[-5000:]
    assert "LOCAL checkpoint of step 10 NOT saved" in log and "async_write_timeout_s=14" in log
    assert "LOCAL checkpoint of step 15 replicated by the writer" in log
    assert "LOCAL checkpoint of step 15 sealed on every rank" in log and "FINAL step=17" in log

