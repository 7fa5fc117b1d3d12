"""Top-K best GLOBAL checkpoints on 2 real gloo ranks: keep_best_k=2 beside most_recent_k=1.

The validation loss goes down, then up (from step 7 the worker adds noise to the weights). An
uninterrupted run is compared with the same run stopped at step 9 and resumed from the GLOBAL tier
(the node-local directory lost) and from the LOCAL tier (the GLOBAL checkpoint of step 9 lost): the
same records, the same directories kept, the same ``best`` tracker.
"""

import json
import shutil
from pathlib import Path

import pytest

from tierstack.checkpointing import listing

WORKER = Path(__file__).parents[1] / "training" / "worker.py"
NOISE = {"TIERSTACK_TEST_NOISE_FROM": "7"}


def _args(out: Path, *extra: str) -> list:
    run = out / "tiny"
    return [
        WORKER, out, "train.train_iters=12", "train.eval_interval=2", "distributed.tensor_model_parallel_size=1",
        f"checkpoint.save={run}/checkpoints", "checkpoint.save_interval=5", "checkpoint.async_save=true",
        f"checkpoint.local_dir={run}/local", "checkpoint.local_save_interval=4", "checkpoint.most_recent_k=1",
        "checkpoint.keep_best_k=2", "checkpoint.save_on_best=true", *extra,
    ]


def _launch(torchrun, out: Path, *extra: str) -> str:
    proc = torchrun(_args(out, *extra), env=NOISE, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


def _outcome(out: Path) -> dict:
    ckpt = out / "tiny" / "checkpoints"
    state = json.loads((out / "rank0.json").read_text())["train_state"]
    text, status = listing.verify(str(ckpt))  # trackers, records and directories agree
    assert status == 0, text
    return {
        "marks": sorted((line.split()[1], line.split()[7]) for line in text.splitlines()
                        if line.startswith("global") and line.split()[7] in ("best", "top-k")),
        "global": sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")),
        "local": sorted(p.name for p in (out / "tiny" / "local" / "0").iterdir() if p.name.endswith("_local.pt")),
        "best": (ckpt / "best_checkpointed_iteration.txt").read_text().strip(),
        "records": state["best_checkpoints"],
    }


@pytest.mark.slow
def test_two_best_and_the_latest_are_kept_and_a_resume_from_either_tier_decides_the_same(tmp_path, torchrun):
    _launch(torchrun, tmp_path / "a")
    val = {}
    for line in (tmp_path / "a" / "tiny" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "val_loss" in rec:
            val[rec["step"]] = rec["val_loss"]
    assert sorted(val) == [2, 4, 6, 8, 10, 12]
    low = min(val, key=val.get)
    assert val[2] > val[low] < val[12]  # down, then up
    top2 = sorted(val, key=lambda s: (val[s], s))[:2]
    a = _outcome(tmp_path / "a")
    assert [s for s, _ in a["records"]] == top2 and a["records"][0][1] == pytest.approx(val[top2[0]], rel=1e-6)
    assert a["global"] == [f"iter_{s:07d}" for s in sorted(set(top2) | {12})]  # the two best and the latest
    assert a["best"] == str(low)
    assert a["local"] == ["iter_0000012_0_local.pt"]
    assert a["marks"] == sorted([(str(low), "best"), (str(top2[1]), "top-k")])  # `tierstack checkpoints ls`

    b = tmp_path / "b"
    _launch(torchrun, b, "train.exit_interval=9")  # stops at 9: GLOBAL 9 (final), LOCAL 8
    c = tmp_path / "c"
    shutil.copytree(b, c)
    shutil.rmtree(c / "tiny" / "local")  # the node is lost: resume from GLOBAL 9
    log_c = _launch(torchrun, c)
    shutil.rmtree(b / "tiny" / "checkpoints" / "iter_0000009")  # the GLOBAL save of 9 is lost: LOCAL 8
    log_b = _launch(torchrun, b)
    assert "resumed from global checkpoint of step 9" in log_c
    assert "resumed from local checkpoint of step 8" in log_b
    for out in (b, c):
        got = _outcome(out)
        assert got["global"] == a["global"] and got["best"] == a["best"] and got["local"] == a["local"]
        assert got["marks"] == a["marks"]
        assert [s for s, _ in got["records"]] == top2
        assert [v for _, v in got["records"]] == pytest.approx([v for _, v in a["records"]], rel=1e-6)
