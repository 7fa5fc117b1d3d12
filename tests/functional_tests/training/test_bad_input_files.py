"""Bad input never silently changes a run (issue 15, and issue 17 item 3): real files, 2 torchrun ranks.

Every launch goes through the recipe file, as a user's does (exit status, what is printed). One base
run (10 steps, both tiers) is trained once per module; tests that launch over it work on their own copy.
"""

import hashlib
import json
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "gpt_tiny.py"
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
         "train.micro_batch_size=4", "train.global_batch_size=4", "train.eval_interval=5", "train.eval_iters=1",
         "straggler=null", "mlflow=null", "logger.progress_bar=false", "checkpoint.async_save=false",
         "dataset.split=90,10,0"]  # (a split with no tokens spins forever in megatron-core 0.16.1)
BASE_RUN_ID_FILE = "run.json"

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit_tests" / "data"))
from bpe_tokenizer import train_bpe  # noqa: E402  (the same real 2,000-id tokenizer as the unit tests)


def _stdlib_files(n=40):
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(root.glob("*.py"))[:n]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A byte-level corpus, a damaged copy of each kind, and the same text in a 2,000-id BPE."""
    from tierstack.data.preprocess import preprocess
    from tierstack.data.tokenizers import ByteTokenizer

    d = tmp_path_factory.mktemp("data")
    files = _stdlib_files()
    preprocess(files, d / "byte", ByteTokenizer())
    hf = train_bpe(d / "tokenizer.json")
    preprocess(files, d / "hf", hf)
    for name in ("cut_idx", "short_bin"):
        for ext in (".bin", ".idx", ".meta.json"):
            if (d / f"byte{ext}").exists():  # (no sidecar before issue 15)
                shutil.copy(d / f"byte{ext}", d / f"{name}{ext}")
    idx = (d / "cut_idx.idx").read_bytes()
    (d / "cut_idx.idx").write_bytes(idx[: len(idx) // 2])  # a copy cut short
    os.truncate(d / "short_bin.bin", os.path.getsize(d / "short_bin.bin") - 1000)
    return d


def _launch(torchrun, tmp, *overrides, timeout=300):
    proc = torchrun([RECIPE, *SMALL, f"dataset.cache_dir={tmp}/cache", *overrides], timeout=timeout)
    return proc, proc.stdout + proc.stderr


def _assert_one_clean_failure(log):
    """Exit status 2 on both ranks; one message (rank 0), one line (rank 1); no traceback of ours."""
    # Both ranks exit 2 at the same point; torchrun may still stop the later one (-15) in the instant
    # between the two exits, which is torchrun's doing, not a failure of that rank.
    codes = re.findall(r"exitcode  : (-?\d+)", log)
    assert len(codes) == 2 and "2" in codes and set(codes) <= {"2", "-15"}, log[-4000:]
    assert re.search(r"Root Cause.*?exitcode  : 2 ", log, re.S)
    assert log.count("rank 1 stopped: bad input (rank 0 says which)") == 1
    # The only traceback is torchrun's own report that its workers exited non-zero.
    assert log.count("Traceback") == 1 and "ChildFailedError" in log, log[-6000:]
    assert "[rank0]:" not in log and "[rank1]:" not in log  # torch's prefix of a worker's traceback
    assert "ConnectionResetError" not in log and "EOFError" not in log


def _tree_digest(path):
    h = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(path)} {st.st_size} {st.st_mtime_ns}".encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.mark.slow
def test_damaged_or_foreign_data_stops_before_any_run_artifact(tmp_path, data, torchrun):
    # Cases 1-3 in one launch: a blend of the three files; each problem is named with its file.
    run = tmp_path / "run"
    proc, log = _launch(
        torchrun, tmp_path, f"dataset.data_path=[{data}/cut_idx,{data}/short_bin,{data}/hf]",
        f"logger.run_dir={run}", f"checkpoint.save={run}/checkpoints", f"checkpoint.local_dir={run}/local",
        "mlflow.experiment_name=bad-data",  # mlflow on: its run must not be created either
    )
    assert proc.returncode != 0
    assert f"{data}/cut_idx.idx: not a readable Megatron index" in log
    assert f"{data}/short_bin.bin: " in log and "(a short or foreign .bin)" in log
    assert "re-run `tierstack preprocess` to rebuild it" in log
    assert f"{data}/hf.bin: token ids 0..1999" not in log  # the max id is the data's own, not the vocab's
    assert f"{data}/hf.bin/.idx were tokenized with the Hugging Face tokenizer" in log
    assert "but this run uses the byte tokenizer (vocabulary 257)" in log
    assert "outside the vocabulary 0..256" in log
    # said once by rank 0; torchrun's report of the failed ranks repeats it as its root cause
    assert "4 problem(s)" in log and log.split("ChildFailedError")[0].count("bad training data") == 1
    assert "bad training data" in log.split("Root Cause")[-1]
    _assert_one_clean_failure(log)
    # no checkpoint directory, no mlflow store: nothing was started but the ranks' own log files
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == ["logs", "logs/rank0.log", "logs/rank1.log"]
    assert "bad training data" in (run / "logs" / "rank0.log").read_text()


@pytest.fixture(scope="module")
def base(tmp_path_factory, data):
    """10 steps of the byte-tokenizer run: LOCAL at 5 and 10, GLOBAL at 10."""
    from launcher import run_torchrun  # the functional tests' launcher (module scope cannot take the fixture)

    root = tmp_path_factory.mktemp("base")
    proc, log = _launch(run_torchrun, root, f"dataset.data_path=[{data}/byte]", "train.train_iters=10",
                        f"logger.run_dir={root}", f"checkpoint.save={root}/ckpt", "checkpoint.save_interval=10",
                        f"checkpoint.local_dir={root}/local", "checkpoint.local_save_interval=5")
    assert proc.returncode == 0, log[-6000:]
    return root


def _copy_base(base, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(base, dst, symlinks=True, ignore=shutil.ignore_patterns("cache"))
    return dst


def _common(run, data, prefix="byte"):
    return [f"dataset.data_path=[{data}/{prefix}]", f"logger.run_dir={run}", f"checkpoint.save={run}/ckpt",
            "checkpoint.save_interval=10", f"checkpoint.local_dir={run}/local", "checkpoint.local_save_interval=5"]


def _run_id(root):
    return json.loads((Path(root) / BASE_RUN_ID_FILE).read_text())["run_id"]


@pytest.mark.slow
def test_resume_with_another_tokenizer_and_width_stops_naming_both(tmp_path, base, data, torchrun):
    # Cases 4 and 5 in one launch: every difference is reported at once, before any load.
    run = _copy_base(base, tmp_path)
    before = _tree_digest(run / "ckpt")
    proc, log = _launch(torchrun, tmp_path, *_common(run, data, "hf"), "train.train_iters=12",
                        "tokenizer.tokenizer_type=huggingface", f"tokenizer.tokenizer_path={data}/tokenizer.json",
                        "model.hidden_size=192")
    assert proc.returncode != 0
    assert "does not fit this run; nothing was loaded" in log
    assert ("tokenizer: the byte tokenizer (vocabulary 257) in the checkpoint, the Hugging Face tokenizer "
            f"{data}/tokenizer.json (vocabulary 2000") in log
    assert "model.hidden_size: 64 in the checkpoint, 192 now" in log
    assert "resumed from" not in log and "CheckpointingException" not in log
    _assert_one_clean_failure(log)
    assert _tree_digest(run / "ckpt") == before


@pytest.mark.slow
def test_resume_with_allowed_changes_goes_on_and_foreign_checkpoints_are_left_alone(tmp_path, base, data, torchrun):
    run = _copy_base(base, tmp_path)
    ours = _run_id(run / "ckpt")
    # Genuine checkpoints of another run beside ours (their manifests name that run): one far ahead,
    # one at the step where this launch ends, so that its final save meets it.
    foreign = {}
    for step in (500, 12):
        foreign[step] = run / "ckpt" / f"iter_{step:07d}"
        shutil.copytree(run / "ckpt" / "iter_0000010", foreign[step])
        man = json.loads((foreign[step] / "manifest.json").read_text())
        man.update(step=step, run_id="f0reign00000")
        (foreign[step] / "manifest.json").write_text(json.dumps(man))
    before = {step: _tree_digest(p) for step, p in foreign.items()}
    proc, log = _launch(torchrun, tmp_path, *_common(run, data), "train.train_iters=12", "checkpoint.save_interval=11",
                        "checkpoint.most_recent_k=1")
    assert proc.returncode == 0, log[-6000:]
    assert "resumed from local checkpoint of step 10" in log
    changed = [line for line in log.splitlines() if "changed since the checkpoint" in line]
    assert len(changed) == 1 and "train.train_iters 10 -> 12" in changed[0]
    assert "checkpoint.most_recent_k 2 -> 1" in changed[0] and "checkpoint.save_interval 10 -> 11" in changed[0]
    for p in foreign.values():
        assert f"GLOBAL checkpoint {p} belongs to run f0reign00000, not this run ({ours})" in log
    # Our step 11 was published and retention (k=1) removed our step 10; the final save of step 12
    # met the other run's iter_0000012 and failed rather than move it.
    names = sorted(p.name for p in (run / "ckpt").iterdir())
    assert "iter_0000011" in names and "iter_0000010" not in names
    assert f"{foreign[12]} holds a checkpoint of run f0reign00000, not of this run ({ours}); not replaced" in log
    assert {step: _tree_digest(p) for step, p in foreign.items()} == before
    assert _run_id(run / "ckpt") == ours


@pytest.mark.slow
def test_save_dir_with_another_runs_checkpoint_and_no_record_is_not_adopted(tmp_path, base, data, torchrun):
    # Case 6: a genuine iter_0000500 copied from another run into a save directory with no run file.
    save = tmp_path / "new" / "ckpt"
    foreign = save / "iter_0000500"
    shutil.copytree(base / "ckpt" / "iter_0000010", foreign)
    man = json.loads((foreign / "manifest.json").read_text())
    man["step"] = 500
    (foreign / "manifest.json").write_text(json.dumps(man))
    before = _tree_digest(save)
    proc, log = _launch(torchrun, tmp_path, f"dataset.data_path=[{data}/byte]", "train.train_iters=12",
                        f"logger.run_dir={tmp_path}/new", f"checkpoint.save={save}", "checkpoint.save_interval=6",
                        "checkpoint.local_dir=null", "checkpoint.local_save_interval=null")
    assert proc.returncode != 0
    assert f"{foreign} (run id {_run_id(base / 'ckpt')})" in log
    assert "checkpoint.pretrained_checkpoint=" in log and "resumed from" not in log
    _assert_one_clean_failure(log)
    assert _tree_digest(save) == before and not (save / "run.json").exists()


@pytest.mark.slow
def test_fresh_global_dir_next_to_an_old_local_dir_is_a_new_run(tmp_path, base, data, torchrun):
    # Issue 17 item 3: a new experiment's fresh checkpoint.save beside the old experiment's local_dir.
    run = _copy_base(base, tmp_path)
    old_id = _run_id(run / "ckpt")
    proc, log = _launch(torchrun, tmp_path, f"dataset.data_path=[{data}/byte]", "train.train_iters=4",
                        f"logger.run_dir={tmp_path}/exp2", f"checkpoint.save={tmp_path}/exp2/ckpt",
                        "checkpoint.save_interval=4", f"checkpoint.local_dir={run}/local",
                        "checkpoint.local_save_interval=2", "checkpoint.most_recent_k=1")
    assert proc.returncode == 0, log[-6000:]
    assert "resumed from" not in log and "no checkpoint to resume from: fresh start" in log
    assert f"belong to run(s) {old_id} and are left alone" in log
    new_id = _run_id(tmp_path / "exp2" / "ckpt")
    assert new_id != old_id
    # The old experiment's LOCAL checkpoints are all still there, byte for byte.
    for rank in ("0", "1"):
        for step in (5, 10):
            f = run / "local" / rank / f"iter_{step:07d}_{rank}_local.pt"
            assert f.exists()
            assert json.loads(f.with_name(f"iter_{step:07d}_{rank}_local.manifest.json").read_text())["run_id"] == old_id
        assert (run / "local" / rank / f"iter_0000004_{rank}_local.pt").exists()  # the new run's own
        assert not (run / "local" / rank / f"iter_0000002_{rank}_local.pt").exists()  # its retention (k=1)


@pytest.mark.slow
@pytest.mark.parametrize("override", [False, True])
def test_a_longer_run_keeps_the_checkpoints_lr_schedule_and_says_so_unless_told_to_follow_the_config(
        tmp_path, base, data, torchrun, override):
    """The base run (10 iterations) decayed its LR over 21 steps (warmup 20 + 1). Going on to 30:
    by default the checkpoint's schedule goes on (min LR from step 21) and the log says which value
    differs and how to follow the config; ``scheduler.override_opt_param_scheduler=true`` follows the
    config's cosine over 30 steps, halfway down at step 25."""
    run = _copy_base(base, tmp_path)
    proc, log = _launch(torchrun, tmp_path, *_common(run, data), "train.train_iters=30", "logger.log_interval=1",
                        "optimizer.lr=1e-3", "optimizer.min_lr=1e-4",  # the base run had 3e-3 and 3e-4
                        f"scheduler.override_opt_param_scheduler={str(override).lower()}")
    assert proc.returncode == 0, log[-6000:]
    warned = [line for line in log.splitlines() if "the LR schedule continues the checkpoint's" in line]
    lr = {m["step"]: m["lr"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
          if "lr" in m}
    if override:  # this config's peak and floor, cosine over 30 steps after 20 of warmup
        assert not warned
        assert lr[25] == pytest.approx(1e-4 + (1e-3 - 1e-4) * 0.5, rel=1e-6)
        assert lr[11] == pytest.approx(1e-3 * 11 / 20, rel=1e-6)  # the first iteration after the resume
    else:  # the checkpoint's: decayed over 21 steps to its floor
        assert len(warned) == 1, log[-6000:]
        assert "scheduler.lr_decay_iters (default train.train_iters): 21 (this config: 30)" in warned[0]
        assert "optimizer.lr: 0.003 (this config: 0.001)" in warned[0]
        assert "scheduler.override_opt_param_scheduler=true" in warned[0]
        assert lr[25] == pytest.approx(3e-4, rel=1e-6)
