"""Two CPU ranks under torchrun: exact resume from each tier, tier choice, resharding, async, retention.

Each scenario launches ``ckpt_worker.py`` (tierstack.pretrain on a tiny GPT) one or more times.
"""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from launcher import run_torchrun

from tierstack.checkpointing import listing

WORKER = Path(__file__).with_name("ckpt_worker.py")

TOPOLOGIES = {
    "tp2": ["distributed.tensor_model_parallel_size=2"],
    "pp2": ["distributed.pipeline_model_parallel_size=2"],
    "dp2_distopt": ["optimizer.use_distributed_optimizer=true"],
}


def launch(out: Path, *overrides: str, hold_writers: bool = False, kill_during_local_write: int = 0,
           expect_failure: bool = False):
    """Run the worker on 2 ranks; returns each rank's record (params under key "params"), or the
    completed process when ``expect_failure`` (then it must have failed)."""
    extra = ["--hold-writers"] if hold_writers else []
    extra += ["--kill-during-local-write", str(kill_during_local_write)] if kill_during_local_write else []
    proc = run_torchrun([WORKER, out, *extra, f"logger.run_dir={out}/run", *overrides], timeout=240)
    if expect_failure:
        assert proc.returncode != 0, (proc.stdout + proc.stderr)[-6000:]
        return proc
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    records = []
    for r in range(2):
        rec = json.loads((out / f"rank{r}.json").read_text())
        assert rec["grad_finalization_wired"], "setup did not wire megatron's finalize_model_grads"
        rec["params"] = torch.load(out / f"params{r}.pt")
        rec["log"] = proc.stdout + proc.stderr
        records.append(rec)
    return records


def assert_same_run(straight: list[dict], resumed: list[dict], from_step: int) -> None:
    """Bit-identical losses, validation losses (the worker validates every 3 steps, dropout on),
    parameters and counters after ``from_step``."""
    for a, b in zip(straight, resumed):
        expected = {k: v for k, v in a["losses"].items() if int(k) > from_step}
        assert b["losses"] == expected  # float hex: bit-identical
        expected_val = {k: v for k, v in a["val_losses"].items() if int(k) > from_step}
        assert expected_val and b["val_losses"] == expected_val
        assert a["params"].keys() == b["params"].keys()
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
        assert b["train_state"]["step"] == a["train_state"]["step"]
        assert b["train_state"]["consumed_train_samples"] == a["train_state"]["consumed_train_samples"]


def assert_layout_invariants(topology: str, records: list[dict]) -> None:
    """What each parallel layout must keep, checked on the uninterrupted run of the exact-resume test
    (the training layout tests' checks, folded in by issue 17): both ranks report the same losses,
    grad norms and validation losses every step (all finite); DP replicas hold identical parameters
    after sharded optimizer steps; at PP=2 the last stage's tied output layer equals the first
    stage's embedding (megatron's embedding all-reduce in finalize_model_grads)."""
    a, b = records
    assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"]
    assert a["val_losses"] == b["val_losses"] and sorted(a["val_losses"], key=int) == ["3", "6"]
    assert all(math.isfinite(float.fromhex(v)) for v in [*a["losses"].values(), *a["grad_norms"].values()])
    assert a["train_state"]["consumed_valid_samples"] == 2 * 4  # 2 validations x eval_iters 1 x batch 4
    if topology == "dp2_distopt":
        assert a["params"].keys() == b["params"].keys()
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
    if topology == "pp2":
        assert "output_layer.weight" not in a["params"] and "embedding.word_embeddings.weight" not in b["params"]
        torch.testing.assert_close(b["params"]["output_layer.weight"], a["params"]["embedding.word_embeddings.weight"],
                                   rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def tp2_pristine(tmp_path_factory):
    """TP=2, 8 steps straight, both tiers saved at 4 and 8, run once per module (never modified)."""
    root = tmp_path_factory.mktemp("tp2")
    return root, _straight(root, TOPOLOGIES["tp2"])


@pytest.fixture
def tp2_run(tp2_pristine, tmp_path):
    """This test's own copy of :func:`tp2_pristine`'s checkpoints (both tiers): what a test's
    launches save or quarantine there never reaches another test, whatever the test order."""
    root, records = tp2_pristine
    for tier in ("global", "local"):
        shutil.copytree(root / tier, tmp_path / tier, symlinks=True)
    return tmp_path, records


def _straight(root: Path, topo: list[str]) -> list[dict]:
    return launch(
        root / "straight", *topo, "train.train_iters=8",
        f"checkpoint.save={root}/global", "checkpoint.save_interval=4",
        f"checkpoint.local_dir={root}/local", "checkpoint.local_save_interval=4",
    )


@pytest.mark.slow
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_exact_resume_from_each_tier(topology, request, tmp_path):
    """N steps straight vs resume at N/2 and N/2 more: identical losses and parameters, both tiers.

    The straight run saved step 4 in both tiers; ``ckpt_step=4`` in a new process is the stop and
    resume at N/2 (the schedule length is fixed by scheduler.lr_decay_iters=8).
    """
    if topology == "tp2":  # the module's TP=2 run (a copy in tmp_path), shared with the reshard test
        root, straight = request.getfixturevalue("tp2_run")
    else:
        root, straight = tmp_path, _straight(tmp_path, TOPOLOGIES[topology])
    topo = TOPOLOGIES[topology]
    assert [e["step"] for e in straight[0]["events"]] == [4, 8]
    assert_layout_invariants(topology, straight)
    # GLOBAL only (no LOCAL tier configured)
    from_global = launch(root / "rg", *topo, "train.train_iters=8", f"checkpoint.load={root}/global",
                         "checkpoint.ckpt_step=4")
    assert from_global[0]["resume"]["tier"] == "global" and from_global[0]["resume"]["step"] == 4
    assert_same_run(straight, from_global, 4)
    # both tiers hold step 4: the tie goes to LOCAL
    from_local = launch(root / "rl", *topo, "train.train_iters=8", f"checkpoint.load={root}/global",
                        f"checkpoint.local_dir={root}/local", "checkpoint.ckpt_step=4")
    assert from_local[0]["resume"] == {**from_local[0]["resume"], "tier": "local", "step": 4}
    assert_same_run(straight, from_local, 4)


@pytest.mark.slow
def test_tp_change_skips_local_and_reshards_global(tp2_run):
    """Checkpoints written at TP=2 (non-distributed optimizer) resume at PP=2: LOCAL is skipped, and
    the resharded run computes what a continuation at TP=2 from the same checkpoint computes:
    losses of steps 9 and 10 and the validation loss of step 9 within relative 1e-5 (dropout off in
    both continuations, so only the layout differs).

    The padded vocabulary is kept at the checkpoint's 512 rows (make_vocab_size_divisible_by=256 pads
    257 ids to 512 at TP=1 and TP=2 alike): by default megatron pads to a multiple of 128 x TP, so
    TP=1 would load 384 of the 512 rows, and the padded rows' logits enter the softmax (about 0.3%
    on these losses): a real difference of the layout, not of the reshard."""
    root, _ = tp2_run
    common = ["train.train_iters=10", f"checkpoint.load={root}/global", "model.hidden_dropout=0.0",
              "model.attention_dropout=0.0", "model.make_vocab_size_divisible_by=256"]
    out = launch(root / "pp2", "distributed.pipeline_model_parallel_size=2", *common,
                 f"checkpoint.local_dir={root}/local")
    assert out[0]["resume"]["tier"] == "global" and out[0]["resume"]["step"] == 8
    assert "skipping local checkpoint of step 8 (topology-changed)" in out[0]["log"]
    assert out[0]["train_state"]["step"] == 10 and out[0]["train_state"]["consumed_train_samples"] == 40
    same_layout = launch(root / "tp2", *TOPOLOGIES["tp2"], *common)
    assert same_layout[0]["resume"]["tier"] == "global" and same_layout[0]["resume"]["step"] == 8
    for key, steps in (("losses", ["9", "10"]), ("val_losses", ["9"])):
        ref = {k: float.fromhex(v) for k, v in same_layout[0][key].items()}
        got = {k: float.fromhex(v) for k, v in out[0][key].items()}
        assert sorted(ref, key=int) == sorted(got, key=int) == steps, (key, ref, got)
        for k in steps:
            assert got[k] == pytest.approx(ref[k], rel=1e-5), (key, k)


def _files(root: Path, pattern: str) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob(pattern))}


@pytest.mark.slow
def test_local_only_then_newer_tier_wins(tmp_path):
    """Issue 17 item 3: a fresh GLOBAL directory next to an old local_dir is a new run; the old LOCAL
    checkpoints are reported (path, run id) and left untouched. Within one run family the newer
    checkpoint wins across tiers, and a tie goes to LOCAL with every counter restored."""
    g, loc = tmp_path / "global", tmp_path / "local"
    # 1) LOCAL only, step 3 (run A)
    a = launch(tmp_path / "a", "train.train_iters=3", f"checkpoint.local_dir={loc}", "checkpoint.local_save_interval=3")
    assert not g.exists()
    old_run = a[0]["train_state"]["run_id"]
    old_files = _files(loc, "*/iter_0000003_*")
    assert len(old_files) == 4  # a file and a manifest per rank
    # 2) a fresh GLOBAL directory beside it: a new run, run A's LOCAL checkpoints named and left alone
    b = launch(tmp_path / "b", "train.train_iters=5", f"checkpoint.local_dir={loc}",
               "checkpoint.local_save_interval=2", f"checkpoint.save={g}", "checkpoint.save_interval=4")
    assert b[0]["resume"] is None and sorted(b[0]["losses"], key=int) == ["1", "2", "3", "4", "5"]
    assert b[0]["train_state"]["run_id"] != old_run and b[0]["train_state"]["resumed_from"] == []
    assert "is a new run" in b[0]["log"] and f"belong to run(s) {old_run} and are left alone" in b[0]["log"]
    assert f"the 2 LOCAL checkpoint(s) in {loc}" in b[0]["log"] and str(loc / "0" / "iter_0000003_0_local.pt") in b[0]["log"]
    assert _files(loc, "*/iter_0000003_*") == old_files
    # 3) run B's family: LOCAL 2, 4 and GLOBAL 4, 5 (final save): the newer, GLOBAL 5, wins
    c = launch(tmp_path / "c", "train.train_iters=6", f"checkpoint.local_dir={loc}", f"checkpoint.save={g}")
    assert c[0]["resume"]["tier"] == "global" and c[0]["resume"]["step"] == 5
    assert c[0]["train_state"]["run_id"] == b[0]["train_state"]["run_id"] == c[1]["train_state"]["run_id"]
    text, status = listing.verify(str(g))
    assert status == 0 and "global  6" in text
    # 4) both tiers hold step 4 of run B: the tie goes to LOCAL, every counter restored
    d = launch(tmp_path / "d", "train.train_iters=5", f"checkpoint.local_dir={loc}", f"checkpoint.save={g}",
               "checkpoint.ckpt_step=4")
    assert d[0]["resume"]["tier"] == "local" and d[0]["resume"]["step"] == 4
    assert sorted(d[0]["losses"], key=int) == ["5"] and d[0]["losses"]["5"] == b[0]["losses"]["5"]
    ts = d[0]["train_state"]
    assert ts["step"] == 5 and ts["consumed_train_samples"] == 20 and ts["resumed_from"] == [4]
    assert ts["run_id"] == b[0]["train_state"]["run_id"]
    assert _files(loc, "*/iter_0000003_*") == old_files


@pytest.mark.slow
def test_async_save_publishes_the_scheduled_step(tmp_path):
    """The writers are held until the last step has run: training moves on, the tracker appears only
    at finalize, with the scheduled step; the run ends right after scheduling step 4 and exits only
    after publishing it."""
    g = tmp_path / "global"
    out = launch(tmp_path / "run", "train.train_iters=4", f"checkpoint.save={g}", "checkpoint.save_interval=2",
                 "checkpoint.async_save=true", hold_writers=True)
    assert out[0]["tracker_after_step"] == {"1": None, "2": None, "3": None, "4": None}
    assert [e["step"] for e in out[0]["events"]] == [2, 4] == [e["step"] for e in out[1]["events"]]
    assert (g / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert torch.load(g / "latest_train_state.pt")["step"] == 4
    for step in (2, 4):
        man = json.loads((g / f"iter_{step:07d}" / "manifest.json").read_text())
        assert man["step"] == step and man["train_state"]["step"] == step
        assert man["train_state"]["consumed_train_samples"] == 4 * step
    assert not [p for p in g.iterdir() if ".staging-" in p.name]
    assert listing.verify(str(g))[1] == 0


@pytest.mark.slow
def test_retention_keeps_two_newest_in_each_tier(tmp_path):
    g, loc = tmp_path / "global", tmp_path / "local"
    foreign = g / "iter_0000005"  # left by another tool/run: no manifest, never counted or deleted
    foreign.mkdir(parents=True)
    (foreign / "weights.bin").write_bytes(b"not ours")
    # A step directory in the save root is evidence of an earlier run (issue 10): starting fresh
    # beside it takes an explicit allow_fresh_start_on_invalid.
    launch(tmp_path / "run", "train.train_iters=6", f"checkpoint.save={g}", "checkpoint.save_interval=2",
           f"checkpoint.local_dir={loc}", "checkpoint.local_save_interval=2", "checkpoint.most_recent_k=2",
           "checkpoint.allow_fresh_start_on_invalid=true")
    assert sorted(p.name for p in g.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000004", "iter_0000005", "iter_0000006"]
    for r in (0, 1):
        assert sorted(p.name for p in (loc / str(r)).iterdir() if p.suffix == ".pt") == [
            f"iter_0000004_{r}_local.pt", f"iter_0000006_{r}_local.pt"]
    assert listing.verify(str(loc))[1] == 0


@pytest.mark.slow
def test_local_save_in_flight_at_the_end_is_sealed_and_holds_the_handed_off_state(tmp_path):
    """The writers are held until step 8 has run: steps 5-8 run (changing every parameter and Adam
    moment in place) before step 4 is written, and step 8 is still in flight when training ends. Exit waits for it; and resuming from step 4 repeats steps 5-8 bit for bit, so step 4's
    file holds the state handed off at step 4 (the staging copy), not what later steps wrote."""
    loc = tmp_path / "local"
    straight = launch(tmp_path / "a", "train.train_iters=8", f"checkpoint.local_dir={loc}",
                      "checkpoint.local_save_interval=4", hold_writers=True)
    for rec in straight:
        assert rec["in_flight_at_close"] == {"local": 1, "global": 0}
        assert rec["local_sealed"] == [4, 8]
    for r in (0, 1):
        assert sorted(p.name for p in (loc / str(r)).iterdir()) == [
            f"iter_0000004_{r}_local.manifest.json", f"iter_0000004_{r}_local.pt",
            f"iter_0000008_{r}_local.manifest.json", f"iter_0000008_{r}_local.pt"]
    assert listing.verify(str(loc))[1] == 0
    resumed = launch(tmp_path / "b", "train.train_iters=8", f"checkpoint.local_dir={loc}", "checkpoint.ckpt_step=4")
    assert resumed[0]["resume"]["tier"] == "local" and resumed[0]["resume"]["step"] == 4
    assert_same_run(straight, resumed, 4)


@pytest.mark.slow
def test_sigkill_while_a_local_save_is_written_resumes_from_the_previous_step(tmp_path):
    """Rank 1 dies (SIGKILL) half-way through writing its LOCAL file of step 4; step 2 was sealed.
    The next launch resumes from step 2: a step not sealed on every rank is never a candidate; the
    interrupted save's ``.dirty`` file, and rank 0's sealed file of that step, are leftovers
    (``verify`` exits 0) that the next LOCAL save, of another step, removes (issues 9, 10)."""
    loc = tmp_path / "local"
    launch(tmp_path / "a", "train.train_iters=6", f"checkpoint.local_dir={loc}", "checkpoint.local_save_interval=2",
           kill_during_local_write=4, expect_failure=True)
    assert (loc / "1" / "iter_0000004_1_local.dirty.pt").exists()
    assert not (loc / "1" / "iter_0000004_1_local.manifest.json").exists()
    text, status = listing.verify(str(loc))  # an interrupted save, not a damaged checkpoint
    assert status == 0 and "interrupted save, sealed on 1 of 2 ranks" in text, text
    b = launch(tmp_path / "b", "train.train_iters=6", f"checkpoint.local_dir={loc}", "checkpoint.local_save_interval=3")
    assert b[0]["resume"]["tier"] == "local" and b[0]["resume"]["step"] == 2
    assert sorted(b[0]["losses"], key=int) == ["3", "4", "5", "6"]
    assert b[0]["local_sealed"] == [3, 6] == b[1]["local_sealed"]
    assert not (loc / "1" / "iter_0000004_1_local.dirty.pt").exists()  # removed by the save of step 3
    # rank 0's part of the interrupted step 4: skipped at resume (issue 9: never quarantined), a leftover
    # that the save of step 3 removed too (issue 10)
    assert not list((loc / "0").glob("iter_0000004_0_local*")), sorted(p.name for p in (loc / "0").iterdir())
    text, status = listing.verify(str(loc))
    assert status == 0 and ".dirty.pt" not in text, text
