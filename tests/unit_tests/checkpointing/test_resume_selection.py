"""Resume selection over real files, single process (collectives reduce to the local view)."""


import pytest
import torch

from tierstack.checkpointing import family, manifest, paths, selection
from tierstack.checkpointing.global_tier import GlobalTier
from tierstack.checkpointing.local_tier import LocalTier
from tierstack.checkpointing.types import CheckpointTier
from tierstack.config import CheckpointConfig
from tierstack.errors import BadInputError
from tierstack.runtime import ParallelLayout

LAYOUT = ParallelLayout(rank=0, world_size=1, local_rank=0, tensor_model_parallel_size=1,
                        pipeline_model_parallel_size=1, data_parallel_size=1, tensor_model_parallel_rank=0,
                        pipeline_model_parallel_rank=0, data_parallel_rank=0)


def _cfg(tmp_path):
    # load only: no GLOBAL writer is started
    return CheckpointConfig(load=str(tmp_path / "global"), local_dir=str(tmp_path / "local"))


def _global(root, step, run_id="runA"):
    d = root / paths.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    man = manifest.build_manifest(tier="global", step=step, run_id=run_id, topology=LAYOUT.topology(),
                                  train_state={"step": step}, files=manifest.describe_files(d, ["__0_0.distcp"]))
    manifest.write_manifest(d / paths.MANIFEST, man)
    return d


def _local(root, step, run_id="runA", topology=None):
    d = root / "0"
    d.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step}, d / paths.local_file_name(step, 0))  # NVRx's own format: verify decodes it
    man = manifest.build_manifest(tier="local", step=step, run_id=run_id, topology=topology or LAYOUT.topology(),
                                  train_state={"step": step},
                                  files=manifest.describe_files(d, [paths.local_file_name(step, 0)]))
    manifest.write_manifest(d / paths.local_manifest_name(step, 0), man)


def _tiers(tmp_path):
    cfg = _cfg(tmp_path)
    return [LocalTier(cfg, LAYOUT), GlobalTier(cfg, LAYOUT, run_config={})]


def test_newest_valid_wins_and_invalid_is_quarantined(tmp_path):
    g = tmp_path / "global"
    for s in (999, 1000):
        _global(g, s)
    bad = _global(g, 1001)
    (bad / "__0_0.distcp").write_bytes(b"\0" * 1024)  # same size, other bytes
    (g / paths.staging_dir_name(2000, "runA", 1)).mkdir()  # never a candidate
    _global(g, 3000, run_id="runB")  # another run's: ignored, left alone
    chosen = selection.select(_tiers(tmp_path), family="runA")
    assert chosen.handler.tier is CheckpointTier.GLOBAL and chosen.step == 1000
    assert chosen.quarantined == ["global step 1001: checksum-mismatch __0_0.distcp (rank 0)"]
    names = sorted(p.name for p in g.iterdir())
    assert "iter_0001001.invalid-checksum-mismatch-rank0" in names
    assert "iter_0003000" in names and paths.staging_dir_name(2000, "runA", 1) in names


def test_tie_goes_to_local_and_newer_global_beats_local(tmp_path):
    _global(tmp_path / "global", 20)
    _local(tmp_path / "local", 20)
    chosen = selection.select(_tiers(tmp_path), family="runA")
    assert (chosen.handler.tier, chosen.step) == (CheckpointTier.LOCAL, 20)
    _global(tmp_path / "global", 30)
    chosen = selection.select(_tiers(tmp_path), family="runA")
    assert (chosen.handler.tier, chosen.step) == (CheckpointTier.GLOBAL, 30)


def test_local_at_other_topology_is_skipped_not_quarantined(tmp_path):
    _global(tmp_path / "global", 10)
    _local(tmp_path / "local", 20, topology={**LAYOUT.topology(), "tensor_model_parallel_size": 2})
    chosen = selection.select(_tiers(tmp_path), family="runA")
    assert (chosen.handler.tier, chosen.step) == (CheckpointTier.GLOBAL, 10)
    assert chosen.skipped == ["local step 20: topology-changed"] and not chosen.quarantined
    assert (tmp_path / "local" / "0" / paths.local_file_name(20, 0)).exists()


def test_ckpt_step_and_nothing_valid(tmp_path):
    _global(tmp_path / "global", 10)
    _global(tmp_path / "global", 20)
    chosen = selection.select(_tiers(tmp_path), family="runA", ckpt_step=10)
    assert chosen.step == 10
    (tmp_path / "global" / "iter_0000020" / "__0_0.distcp").write_bytes(b"short")
    (tmp_path / "global" / "iter_0000010" / "__0_0.distcp").unlink()
    chosen = selection.select(_tiers(tmp_path), family="runA")
    assert chosen.handler is None and len(chosen.quarantined) == 2


def _decide(global_dir, local_dir):
    """The run family as the manager decides it, from the tiers of these directories (None: not configured)."""
    cfg = CheckpointConfig(load=str(global_dir) if global_dir else None, local_dir=str(local_dir) if local_dir else None)
    return family.decide([LocalTier(cfg, LAYOUT), GlobalTier(cfg, LAYOUT, run_config={})])


def test_global_record_decides_the_family_and_a_newer_local_record_does_not(tmp_path):
    # Issue 17 item 3: the family used to be the run.json written last among the tier roots.
    paths.write_run_file(tmp_path / "global", "old")
    paths.write_run_file(tmp_path / "local", "new")
    assert _decide(tmp_path / "global", tmp_path / "local") == "old"
    assert _decide(tmp_path / "nothing", None) is None
    assert _decide(None, tmp_path / "local") == "new"  # LOCAL decides only without GLOBAL


def test_fresh_global_next_to_an_old_local_dir_is_a_new_run(tmp_path, caplog):
    # Issue 17 item 3: another experiment's LOCAL checkpoints beside a fresh GLOBAL directory.
    paths.write_run_file(tmp_path / "local", "oldexp")
    _local(tmp_path / "local", 20, run_id="oldexp")
    with caplog.at_level("WARNING"):
        assert _decide(tmp_path / "fresh", tmp_path / "local") is None
    assert "belong to run(s) oldexp and are left alone" in caplog.text
    assert str(tmp_path / "local" / "0" / paths.local_file_name(20, 0)) in caplog.text
    assert (tmp_path / "local" / "0" / paths.local_file_name(20, 0)).exists()


@pytest.mark.parametrize("tier", ["GLOBAL", "LOCAL"])
def test_checkpoints_without_a_record_are_not_adopted(tmp_path, tier):
    # Issue 15 case 6: a genuine checkpoint of another run copied into a directory with no run.json.
    if tier == "GLOBAL":
        _global(tmp_path / "global", 500, run_id="theirs")
        roots = (tmp_path / "global", tmp_path / "local")
    else:
        _local(tmp_path / "local", 500, run_id="theirs")
        roots = (None, tmp_path / "local")
    with pytest.raises(family.CheckpointFamilyError) as err:
        _decide(*roots)
    text = str(err.value)
    assert "iter_0000500" in text and "run id theirs" in text and "checkpoint.pretrained_checkpoint" in text
    assert isinstance(err.value, BadInputError)


def test_damaged_local_file_is_quarantined_by_the_read_that_would_load_it(tmp_path):
    """LOCAL verification reads the file once (size + CRC-32C of the bytes read); those bytes are
    what the load decodes, so a flipped byte is caught before any state changes."""
    _local(tmp_path / "local", 10)
    _local(tmp_path / "local", 20)
    rank_dir = tmp_path / "local" / "0"
    f = rank_dir / paths.local_file_name(20, 0)
    f.write_bytes(b"LOCAL" + f.read_bytes()[5:])  # same size, other bytes
    tiers = _tiers(tmp_path)
    chosen = selection.select(tiers, family="runA")
    assert (chosen.handler.tier, chosen.step) == (CheckpointTier.LOCAL, 10)
    assert chosen.quarantined == [f"local step 20: checksum-mismatch {f.name} (rank 0)"]  # names the rank (issue 10)
    assert sorted(p.name for p in rank_dir.iterdir() if "invalid" in p.name) == sorted([
        f"{f.name}.invalid-checksum-mismatch-rank0", f"{paths.local_manifest_name(20, 0)}.invalid-checksum-mismatch-rank0"])
    kept = tiers[0]._verified[10]  # the verified bytes wait for load(): no second read
    assert bytes(kept.numpy()) == (rank_dir / paths.local_file_name(10, 0)).read_bytes()


def test_a_local_save_never_replaces_or_removes_another_runs_checkpoint_of_the_same_step(tmp_path):
    # Issue 17 item 3: run B writing its step 20 next to run A's LOCAL step 20 leaves A's files alone.
    _local(tmp_path / "local", 20, run_id="runA")
    rank_dir = tmp_path / "local" / "0"
    before = {p.name: p.read_bytes() for p in rank_dir.iterdir()}
    tier = LocalTier(_cfg(tmp_path), LAYOUT)
    try:
        with pytest.raises(FileExistsError, match="holds a LOCAL checkpoint of run runA"):
            tier._write_and_seal(20, "runB", {"step": 20}, b"", [], {})
        tier._remove_step(20, "runB")  # what a failed save of run B does on every rank
        assert {p.name: p.read_bytes() for p in rank_dir.iterdir()} == before
    finally:
        tier.close()


def test_a_tracker_naming_a_missing_step_is_said(tmp_path, caplog):
    """Found by the break-it pass: a tracker naming step 12 beside steps 6 and 8 was ignored silently."""
    g = tmp_path / "global"
    for s in (6, 8):
        _global(g, s)
    (g / paths.TRACKER_ITERATION).write_text("12\n")
    with caplog.at_level("WARNING"):
        chosen = selection.select(_tiers(tmp_path), family="runA")
    assert chosen.step == 8
    assert any("names step 12" in r.getMessage() and "no checkpoint of that step" in r.getMessage()
               for r in caplog.records), caplog.text
