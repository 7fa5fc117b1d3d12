"""A writer thread that never returns (a hung file system on one rank) cannot hang the run: the
blocking wait for it is bounded by checkpoint.async_write_timeout_s, agreed by both ranks; that save
fails on every rank with a message naming the tier, step and rank, and training goes on."""

import json
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("ckpt_worker.py")


@pytest.mark.slow
def test_hung_global_writer_fails_that_save_on_every_rank_and_training_goes_on(torchrun, tmp_path):
    g = tmp_path / "global"
    proc = torchrun([WORKER, tmp_path, "--hang-global-writer-on", "1", f"logger.run_dir={tmp_path}/run",
                     "train.train_iters=6", f"checkpoint.save={g}", "checkpoint.save_interval=2",
                     "checkpoint.async_save=true", "checkpoint.async_write_timeout_s=3"], timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]  # the stuck (daemon) thread does not keep the process alive
    assert (tmp_path / "hung_global_write_rank1").exists()  # the injected hang did run, on rank 1 only
    assert not (tmp_path / "hung_global_write_rank0").exists()
    assert ("GLOBAL checkpoint of step 2: the writer thread of rank(s) [1] is still running after "
            "checkpoint.async_write_timeout_s=3s") in log
    assert log.count("GLOBAL checkpoint of step 2 NOT published") == 2, log[-6000:]  # on both ranks
    for r in range(2):
        rec = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert sorted(rec["losses"], key=int) == ["1", "2", "3", "4", "5", "6"]
    assert not (g / "iter_0000002").exists()
    assert (g / "iter_0000004" / "manifest.json").exists() and (g / "iter_0000006" / "manifest.json").exists()
    assert (g / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
