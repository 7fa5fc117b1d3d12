"""A rewind (``checkpoint.ckpt_step``) on 2 CPU ranks: the abandoned timeline is moved aside and
named in the log, and the next launch, without ``ckpt_step`` or with it kept, continues the new
timeline exactly."""

import json
import shutil
from pathlib import Path

import pytest

from launcher import run_torchrun

WORKER = Path(__file__).with_name("ckpt_worker.py")


def run(out: Path, root: Path, *overrides: str) -> tuple[str, dict]:
    proc = run_torchrun([WORKER, out, f"logger.run_dir={out}/run", f"checkpoint.save={root}/global",
                         f"checkpoint.local_dir={root}/local", "checkpoint.save_interval=10",
                         "checkpoint.local_save_interval=5", "checkpoint.most_recent_k=-1",
                         "checkpoint.collective_timeout_s=60", *overrides], timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log, json.loads((out / "rank0.json").read_text())


def losses(rec: dict, first: int, last: int) -> list:
    return [rec["losses"][str(s)] for s in range(first, last + 1)]


@pytest.mark.slow
def test_a_rewind_is_not_undone_by_the_next_launch(tmp_path):
    root, ref_root = tmp_path / "ckpt", tmp_path / "ref_ckpt"
    run(tmp_path / "a", root, "train.train_iters=40")
    shutil.copytree(root, ref_root)  # the same history, for the reference run 20 -> 50 below

    log, rewound = run(tmp_path / "b", root, "checkpoint.ckpt_step=20", "train.train_iters=30")
    assert rewound["resume"]["step"] == 20, log[-4000:]
    named = "LOCAL step 25, LOCAL step 30, LOCAL step 35, LOCAL step 40, GLOBAL step 30, GLOBAL step 40"
    assert f"moved aside (renamed *.rewound-to-20, never resumed): {named}" in log, log[-4000:]
    for step in (30, 40):  # renamed, never deleted
        assert (root / "global" / f"iter_{step:07d}.rewound-to-20").is_dir()
    for rank in (0, 1):
        assert (root / "local" / str(rank) / f"iter_0000040_{rank}_local.pt.rewound-to-20").exists()

    log, plain = run(tmp_path / "c", root, "train.train_iters=50")
    assert plain["resume"]["step"] == 30, log[-4000:]  # the new timeline, not the abandoned 40

    _, ref = run(tmp_path / "ref", ref_root, "checkpoint.ckpt_step=20", "train.train_iters=50")
    assert losses(rewound, 21, 30) == losses(ref, 21, 30)
    assert losses(plain, 31, 50) == losses(ref, 31, 50)  # bit for bit (float hex)

    log, kept = run(tmp_path / "d", root, "checkpoint.ckpt_step=20", "train.train_iters=50")  # a requeued job
    assert kept["resume"]["step"] == 50, log[-4000:]
    assert "this run was rewound to step 20 by an earlier launch" in log, log[-4000:]
