"""No rank publishes a checkpoint while any rank has a non-finite gradient."""

import json
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker.py")


@pytest.mark.slow
def test_nan_gradient_on_one_rank_blocks_both_tiers_at_that_step(tmp_path, torchrun):
    run = tmp_path / "tiny"
    proc = torchrun(
        [
            WORKER, tmp_path, "train.train_iters=6", "distributed.tensor_model_parallel_size=1",
            f"checkpoint.save={run}/checkpoints", "checkpoint.save_interval=2", "checkpoint.async_save=false",
            f"checkpoint.local_dir={run}/local", "checkpoint.local_save_interval=2", "checkpoint.most_recent_k=-1",
        ],
        env={"TIERSTACK_TEST_NAN_GRAD_AT": "4"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "non-finite parameters or gradients on some rank" in proc.stderr
    global_steps = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("iter_"))
    assert global_steps == ["iter_0000002", "iter_0000006"]
    for rank in (0, 1):
        local = sorted(p.name for p in (run / "local" / str(rank)).iterdir() if p.name.endswith(".pt"))
        assert not any("0000004" in name for name in local), local
        assert any("0000006" in name for name in local) and any("0000002" in name for name in local)
    assert not list(run.rglob("*staging*"))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["train_state"]["step"] == 6  # training went on
