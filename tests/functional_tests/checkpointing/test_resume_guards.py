"""Resume guards on 2 CPU ranks: a quarantine names the rank whose file failed, evidence of an
earlier run never leads to a silent fresh start, and a checkpoint without RNG state says so."""

import json
import shutil
from pathlib import Path

import pytest

from launcher import run_torchrun

WORKER = Path(__file__).with_name("ckpt_worker.py")


def run(out: Path, *overrides: str) -> tuple[int, str, list]:
    proc = run_torchrun([WORKER, out, f"logger.run_dir={out}/run", "checkpoint.collective_timeout_s=30", *overrides],
                        timeout=240)
    recs = [json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None
            for r in range(2)]
    return proc.returncode, proc.stdout + proc.stderr, recs


@pytest.mark.slow
def test_quarantine_names_the_rank_and_evidence_stops_every_relaunch(tmp_path):
    loc = tmp_path / "local"
    rc, log, _ = run(tmp_path / "a", "train.train_iters=2", f"checkpoint.local_dir={loc}", "checkpoint.local_save_interval=2")
    assert rc == 0, log[-4000:]
    victim = loc / "1" / "iter_0000002_1_local.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    victim.write_bytes(bytes(data))
    for attempt in ("b", "c"):  # however many times it is relaunched
        rc, log, _ = run(tmp_path / attempt, "train.train_iters=3", f"checkpoint.local_dir={loc}")
        assert rc != 0, log[-4000:]
        assert "allow_fresh_start_on_invalid" in log and "no fresh start" not in log
        if attempt == "b":
            assert "local checkpoint of step 2 failed its check on rank 1 (checksum-mismatch" in log, log[-4000:]
            assert "of rank 0 is invalid" not in log
        else:
            assert "found " in log and ".invalid-checksum-mismatch-rank1" in log, log[-4000:]
    # Only the file that failed its own check is quarantined (issue 9): rank 0's intact file stays.
    assert [p.name for p in (loc / "1").glob("iter_0000002_1_local.pt.invalid-checksum-mismatch*")], list((loc / "1").iterdir())
    assert (loc / "0" / "iter_0000002_0_local.pt").exists() and not list((loc / "0").glob("*.invalid-*"))
    rc, log, recs = run(tmp_path / "d", "train.train_iters=1", f"checkpoint.local_dir={loc}",
                        "checkpoint.allow_fresh_start_on_invalid=true")
    assert rc == 0 and recs[0]["resume"] is None, log[-4000:]


@pytest.mark.slow
def test_resume_without_saved_rng_says_so_once(tmp_path):
    g = tmp_path / "global"
    rc, log, _ = run(tmp_path / "a", "train.train_iters=2", f"checkpoint.save={g}", "checkpoint.save_rng=false")
    assert rc == 0, log[-4000:]
    rc, log, recs = run(tmp_path / "b", "train.train_iters=3", f"checkpoint.save={g}")
    assert rc == 0 and recs[0]["resume"]["step"] == 2, log[-4000:]
    assert log.count("saved with checkpoint.save_rng=false: RNG state not restored") == 1, log[-4000:]


@pytest.mark.slow
def test_a_deleted_best_checkpoint_and_load_optim_false_are_said_once(tmp_path):
    """A best record naming a checkpoint deleted by hand is reported once at resume and dropped;
    ``load_optim=false`` says once, on rank 0, that the optimizer state was not loaded."""
    g = tmp_path / "global"
    best_args = (f"checkpoint.save={g}", "checkpoint.save_interval=3", "checkpoint.keep_best_k=2")
    rc, log, recs = run(tmp_path / "a", "train.train_iters=9", *best_args)
    assert rc == 0, log[-4000:]
    records = recs[0]["train_state"]["best_checkpoints"]
    victim = next(int(s) for s, _ in records if int(s) != 9)  # a record that is not the step resumed
    shutil.rmtree(g / f"iter_{victim:07d}")
    rc, log, recs = run(tmp_path / "b", "train.train_iters=10", "checkpoint.load_optim=false", *best_args)
    assert rc == 0 and recs[0]["resume"]["step"] == 9, log[-4000:]
    assert log.count(f"best record step {victim} (val_loss") == 1, log[-4000:]
    assert victim not in [int(s) for s, _ in recs[0]["train_state"]["best_checkpoints"]]
    assert log.count("checkpoint.load_optim=false: the optimizer state of GLOBAL step 9") == 1, log[-4000:]


@pytest.mark.slow
def test_a_damaged_global_file_is_found_by_the_rank_whose_share_holds_it(tmp_path):
    """Each rank checks its share of a GLOBAL step's files: a damaged file in either rank's share
    refuses the step, naming the file and that rank, and the run falls back to the step before."""
    from tierstack.checkpointing import manifest

    pristine = tmp_path / "pristine"
    rc, log, _ = run(tmp_path / "a", "train.train_iters=4", f"checkpoint.save={pristine}", "checkpoint.save_interval=2")
    assert rc == 0, log[-4000:]
    files = json.loads((pristine / "iter_0000004" / "manifest.json").read_text())["files"]
    for rank in (0, 1):
        g = tmp_path / f"global{rank}"
        shutil.copytree(pristine, g)
        victim = manifest.share(files, rank, 2)[0]
        data = bytearray((g / "iter_0000004" / victim).read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
        (g / "iter_0000004" / victim).write_bytes(bytes(data))
        rc, log, recs = run(tmp_path / f"b{rank}", "train.train_iters=5", f"checkpoint.save={g}")
        assert rc == 0 and recs[0]["resume"]["step"] == 2, log[-4000:]
        assert f"global checkpoint of step 4 failed its check on rank {rank} (checksum-mismatch {victim})" in log, \
            log[-4000:]
        assert f"moved to iter_0000004.invalid-checksum-mismatch-rank{rank}" in log, log[-4000:]
