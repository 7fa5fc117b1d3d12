"""The non-finite guard on 2 real gloo ranks: a fault on rank 1 only blocks every tier on every rank.

Saves every 5 iterations in both tiers (sync GLOBAL, so that what is on disk is final when a rank
raises). Data parallel 2 (TP=1): rank 0's own gradients stay finite at the faulty step, so only the
agreement tells it.
"""

import json
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker.py")


def _common(run: Path) -> list[str]:
    return [
        "distributed.tensor_model_parallel_size=1", f"checkpoint.save={run}/checkpoints", "checkpoint.save_interval=5",
        "checkpoint.async_save=false", f"checkpoint.local_dir={run}/local", "checkpoint.local_save_interval=5",
        "checkpoint.most_recent_k=-1",
    ]


def _global_steps(run: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (run / "checkpoints").iterdir() if p.name.startswith("iter_"))


def _local_steps(run: Path, rank: int) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run / "local" / str(rank)).iterdir() if p.name.endswith("_local.pt"))


@pytest.mark.slow
def test_inf_gradient_on_rank_1_at_step_7_blocks_step_10_everywhere_and_stops(tmp_path, torchrun):
    run = tmp_path / "tiny"
    proc = torchrun([WORKER, tmp_path, "train.train_iters=12", "train.eval_interval=null", *_common(run)],
                    env={"TIERSTACK_TEST_INF_GRAD_AT": "7"}, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-4000:]  # on_nonfinite=stop (the default)
    assert "NonFiniteError: step 10: first non-finite step 7 on rank(s) 1" in log, log[-4000:]
    assert "checkpoint of step 10 blocked in every tier on every rank" in log
    assert _global_steps(run) == [5]  # the finite control at the regular boundary 5 survives
    assert all(_local_steps(run, r) == [5] for r in (0, 1))
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert not list(run.rglob("*staging*")) and not list(run.rglob("*.dirty*"))
    assert not (tmp_path / "rank0.json").exists()  # the run stopped before its end


@pytest.mark.slow
def test_inf_parameter_on_rank_1_after_step_10_blocks_both_tiers_of_step_10_and_stops(tmp_path, torchrun):
    """Nothing in the steps up to 10 was non-finite: rank 1's shard of a parameter turns inf after
    step 10's update. The writer threads find it in the staged state of step 10 (rank 1) before
    writing; no tier seals or publishes step 10, and the run stops saying so. TP=2: the shard is
    rank 1's own, written by rank 1 in both tiers (a data-parallel replica is written, and checked,
    by one rank only)."""
    run = tmp_path / "tiny"
    proc = torchrun([WORKER, tmp_path, "train.train_iters=12", "train.eval_interval=null", *_common(run),
                     "distributed.tensor_model_parallel_size=2"],
                    env={"TIERSTACK_TEST_INF_PARAM_AT": "10"}, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-4000:]
    assert "NonFiniteError: step 10: non-finite parameters or optimizer moments on rank(s) 1" in log, log[-4000:]
    assert "LOCAL checkpoint of step 10: non-finite parameters or optimizer moments on rank 1" in log
    assert "checkpoint of step 10 blocked in every tier on every rank (found by GLOBAL)" in log
    assert _global_steps(run) == [5]
    assert all(_local_steps(run, r) == [5] for r in (0, 1))
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert not list(run.rglob("*staging*")) and not list(run.rglob("*.dirty*"))


@pytest.mark.slow
def test_a_replica_turning_inf_is_blocked_in_both_tiers_and_local_keeps_its_previous_step(tmp_path, torchrun):
    """DP=2: rank 1's replica of a parameter turns inf after step 10. LOCAL writes that tensor from
    rank 0 (finite) and seals step 10; GLOBAL, which stages every replica, blocks it and the step is
    vetoed in LOCAL. LOCAL's retention (most_recent_k=1) is held until GLOBAL's verdict, so step 5,
    the previous one, is still there on both ranks (found by a break-it pass: it was deleted)."""
    run = tmp_path / "tiny"
    proc = torchrun([WORKER, tmp_path, "train.train_iters=15", "train.eval_interval=null", *_common(run),
                     "checkpoint.save_interval=10", "checkpoint.async_save=true", "checkpoint.most_recent_k=1"],
                    env={"TIERSTACK_TEST_INF_PARAM_AT": "10"}, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-4000:]
    assert "NonFiniteError: step 10: non-finite parameters or optimizer moments on rank(s) 1 (found by the GLOBAL" in log
    assert not (run / "checkpoints").exists() or _global_steps(run) == []
    assert all(_local_steps(run, r) == [5] for r in (0, 1)), [_local_steps(run, r) for r in (0, 1)]
    assert all((run / "local" / str(r) / f"iter_0000005_{r}_local.manifest.json").exists() for r in (0, 1))


@pytest.mark.slow
def test_skip_trains_on_a_blocked_best_candidate_changes_nothing_and_the_next_clean_boundary_saves(tmp_path, torchrun):
    """A transient fault (rank 1's loss is non-finite at step 7, the state stays finite): the best
    candidate of step 9 is blocked, the regular boundary 10 and the final step 13 save; the records
    and the best tracker never name 9."""
    run = tmp_path / "tiny"
    proc = torchrun([
        WORKER, tmp_path, "train.train_iters=13", "train.eval_interval=3", "checkpoint.on_nonfinite=skip",
        "checkpoint.keep_best_k=10", "checkpoint.save_on_best=true", *_common(run),
    ], env={"TIERSTACK_TEST_INF_LOSS_AT": "7"}, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    blocked = [line for line in log.splitlines() if "checkpoint of step 9 blocked in every tier on every rank" in line]
    # Rank 0's own check found nothing (its loss and gradients were finite); it blocks all the same.
    assert len(blocked) == 2 and sum("[rank 1]" in line for line in blocked) == 1, blocked
    for line in blocked:
        assert line.endswith(": first non-finite step 7 on rank(s) 1; non-finite loss or gradients at step 7 on rank 1")
    # Finite controls: best boundaries 3, 6, 12; regular 5, 10; final 13. Blocked: 9 (best) only.
    assert _global_steps(run) == [3, 5, 6, 10, 12, 13]
    assert all(_local_steps(run, r) == [5, 10] for r in (0, 1))
    manifests = {s: json.loads((run / "checkpoints" / f"iter_{s:07d}" / "manifest.json").read_text())
                 for s in (6, 10, 13)}
    records = {s: m["train_state"]["best_checkpoints"] for s, m in manifests.items()}
    assert [s for s, _ in records[6]] and 9 not in [s for s, _ in records[13]]
    assert records[10] == records[6]  # the blocked candidate between them changed nothing
    assert sorted(s for s, _ in records[13]) == [3, 6, 12]
    best = (run / "checkpoints" / "best_checkpointed_iteration.txt").read_text().strip()
    assert int(best) == records[13][0][0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["train_state"]["step"] == 13 and ranks[1]["train_state"]["best_checkpoints"] == records[13]
    # Seen at the start of step 7 (after the boundary of 6) and of step 10 (after the blocked 9):
    # the same records and best tracker on every rank, although 9's candidate was the best yet.
    val = {r["step"]: r["val_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
           if "val_loss" in r}
    assert val[9] < min(val[3], val[6])  # the blocked candidate would have become the best
    for r in ranks:
        assert r["best_seen"]["10"] == r["best_seen"]["7"]
        assert r["best_seen"]["7"]["tracker"] == str(records[6][0][0]) and r["best_seen"]["7"]["records"] == records[6]
