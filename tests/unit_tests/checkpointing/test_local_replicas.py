"""LOCAL replicas and missing steps, single process: config rules, which step every rank can obtain,
replica files checked end to end, missing steps skipped (not quarantined), the quarantine budget."""

import dataclasses
import os
import time

import pytest
import torch

from tierstack.checkpointing import local_file, local_replicas, manifest, paths, retention, selection
from tierstack.checkpointing.local_tier import LocalTier
from tierstack.checkpointing.types import CheckpointTier
from tierstack.checkpointing.replication import FileReplica, clique_groups, replica_id
from tierstack.config import CheckpointConfig, ConfigContainer, ConfigError
from tierstack.runtime import ParallelLayout
from tierstack.runtime import collectives

LAYOUT = ParallelLayout(rank=0, world_size=1, local_rank=0, tensor_model_parallel_size=1,
                        pipeline_model_parallel_size=1, data_parallel_size=1, tensor_model_parallel_rank=0,
                        pipeline_model_parallel_rank=0, data_parallel_rank=0)


def _config(**checkpoint) -> ConfigContainer:
    cfg = ConfigContainer()
    cfg.checkpoint = CheckpointConfig(local_dir="/tmp/x", **checkpoint)
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 8
    cfg.distributed.tensor_model_parallel_size = 1
    return cfg


def test_replication_is_checked_against_nodes_and_world_size_naming_the_field():
    _config(replication_factor=2).validate(world_size=4, ranks_per_node=2)  # 2 nodes: fine
    with pytest.raises(ConfigError) as err:
        _config(replication_factor=3).validate(world_size=4, ranks_per_node=2)
    assert "checkpoint.replication_factor=3 is larger than the number of nodes (2" in str(err.value)
    assert err.value.problems == [p for p in err.value.problems if "replication_factor=3" in p]  # one problem, the set field
    with pytest.raises(ConfigError) as err:
        _config(replication_factor=2, replication_jump=3).validate(world_size=4, ranks_per_node=2)
    assert "checkpoint.replication_jump=3 does not fit: world size 4" in str(err.value)
    with pytest.raises(ConfigError) as err:
        _config(replication_factor=2).validate(world_size=2, ranks_per_node=2)  # one node
    assert "checkpoint.replication_factor=2 is larger than the number of nodes (1" in str(err.value)
    with pytest.raises(ConfigError) as err:
        ConfigContainer(checkpoint=CheckpointConfig(replication_factor=2)).validate(world_size=2, ranks_per_node=1)
    assert "set checkpoint.local_dir" in str(err.value)


def test_cliques_are_nvrx_groups_across_nodes():
    # 4 ranks, 2 per node: rank n keeps the files of rank n + 2 (the same local rank on the other node)
    assert clique_groups(4, 2, 2) == [[0, 2], [1, 3]]


def test_the_steps_every_rank_can_obtain_newest_first():
    cliques = [[0, 1]]
    held = [[replica_id(s, o) for s in (5, 10) for o in (0, 1)], []]  # node 1 replaced: holds nothing
    assert local_replicas._obtainable(held, cliques) == [10, 5]
    held = [[replica_id(10, 0), replica_id(5, 0), replica_id(5, 1)], []]  # rank 1's step 10 never replicated
    assert local_replicas._obtainable(held, cliques) == [5]
    assert local_replicas._obtainable([[replica_id(10, 0)], []], cliques) == []


def _torch_saved(obj) -> bytes:
    """A LOCAL file's bytes in NVRx's own format (``torch.save``), which verify and resume can read."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _write_own(root, step, rank=0, run_id="runA", payload=None):
    payload = payload if payload is not None else _torch_saved({"step": step, "pad": "local-bytes" * 100})
    store = local_replicas.ReplicaStore(root, rank)
    ckpt, man_path = store.paths(step, rank)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    local_file.write_raw(ckpt, data)
    man = manifest.build_manifest(tier="local", step=step, run_id=run_id, topology=LAYOUT.topology(),
                                  train_state={"step": step}, files=manifest.describe_files(ckpt.parent, [ckpt.name]))
    manifest.write_manifest(man_path, man)
    return store, man, data


def test_a_replica_is_stored_only_when_its_owners_checksum_matches(tmp_path, caplog):
    _, man, data = _write_own(tmp_path / "node1", 10, rank=1)
    store = local_replicas.ReplicaStore(tmp_path / "node0", 0)
    damaged = data.clone()
    damaged[7] ^= 1
    with pytest.raises(local_file.LocalFileError, match="checksum-mismatch"):
        store.store(FileReplica(1, 10, man, damaged))
    assert not store.folder(1).exists() or not any(store.folder(1).iterdir())
    store.store(FileReplica(1, 10, man, data))
    assert store.holdings("runA") == [replica_id(10, 1)]
    ckpt = store.paths(10, 1)[0]
    whole = ckpt.read_bytes()
    ckpt.write_bytes(whole[:-10])  # truncated: not offered, and the log says why
    with caplog.at_level("WARNING"):
        assert store.holdings("runA") == []
    assert f"LOCAL replica of rank 1, step 10, {ckpt} has {len(whole) - 10} bytes" in caplog.text
    ckpt.write_bytes(whole)
    assert store.paths(10, 1)[0].read_bytes() == bytes(data.numpy())
    assert store.holdings("runB") == []  # another run's files are not offered
    sent = store.load(replica_id(10, 1))
    assert sent.manifest == man and torch.equal(sent.data, data)
    hollow = sent.pop_tensors()
    assert sent.is_hollow and sent.nbytes == data.numel()
    sent.init_tensors()
    assert sent.tensors[0].shape == data.shape and sent.tensors[0].dtype == torch.uint8


def test_replica_retention_removes_what_an_interrupted_store_left_up_to_the_step(tmp_path, caplog):
    """A kill during a replica store leaves a full-size ``.dirty`` file (and maybe a manifest temp
    file) in ``replicas/<owner>``; the next retention removes those of steps up to the one it
    retains, and leaves a newer step's (a store the writer thread may be running) and the checkpoints."""
    store = local_replicas.ReplicaStore(tmp_path / "node0", 0)
    for step in (5, 10):
        _, man, data = _write_own(tmp_path / "node1", step, rank=1)
        store.store(FileReplica(1, step, man, data))
    folder = store.folder(1)
    stale = [folder / "iter_0000007_1_local.dirty.pt", folder / ".iter_0000007_1_local.manifest.json.tmp-4242"]
    newer = folder / "iter_0000015_1_local.dirty.pt"
    for p in stale + [newer]:
        p.write_bytes(b"partial" * 1000)
    with caplog.at_level("INFO"):
        store.prune([0, 1], "runA", step=10, k=2)
    assert not any(p.exists() for p in stale)
    assert newer.exists()
    assert sorted(store.holdings("runA")) == sorted([replica_id(5, 1), replica_id(10, 1)])
    assert "left by an interrupted replica store" in caplog.text
    store.prune([0, 1], "runA", step=15, k=2)
    assert not newer.exists()


def test_verify_checks_the_replicas_a_node_keeps(tmp_path):
    """``tierstack checkpoints verify <local_dir>`` lists the replicas kept for other nodes and
    fails on a damaged one (resume would refuse it), as on a damaged own file."""
    from tierstack.checkpointing import listing

    _write_own(tmp_path / "node0", 10, rank=0)
    store = local_replicas.ReplicaStore(tmp_path / "node0", 0)
    _, man, data = _write_own(tmp_path / "node1", 10, rank=1)
    store.store(FileReplica(1, 10, man, data))
    text, status = listing.verify(str(tmp_path / "node0"))
    assert status == 0 and "1 checkpoint(s), 0 invalid; 1 step(s) of valid replicas kept for other nodes" in text
    assert [line.split()[-3:] for line in text.splitlines() if line.startswith("local ")] == [
        ["1", "rank", "file"], ["of", "rank(s)", "[1]"]]
    assert "replica(s) of rank(s) [1]" in text
    ckpt = store.paths(10, 1)[0]
    raw = bytearray(ckpt.read_bytes())
    raw[5] ^= 0xFF
    ckpt.write_bytes(bytes(raw))
    text, status = listing.verify(str(tmp_path / "node0"))
    assert status == 1 and "replica of rank 1: checksum-mismatch" in text, text


def _rank1_holds_nothing(monkeypatch, dirty_steps=()):
    """Simulate a rank 1 in the gathers of selection: no candidates, ``.dirty`` files of ``dirty_steps``
    (and no evidence of an earlier run in the gather of ``family.evidence``)."""
    real = collectives.all_gather_object
    rank1 = ({}, {CheckpointTier.LOCAL: list(dirty_steps)}, set())  # (problems, .dirty steps, memory steps)
    monkeypatch.setattr(collectives, "all_gather_object",
                        lambda obj: real(obj) + [rank1 if isinstance(obj, tuple) else [] if isinstance(obj, list) else None])


def test_a_step_missing_on_a_rank_is_skipped_and_the_files_of_the_others_stay(tmp_path, monkeypatch):
    """Rank 1 (simulated: its view of the gather) holds nothing; rank 0's good step 10 is not renamed."""
    _write_own(tmp_path / "local", 10)
    _rank1_holds_nothing(monkeypatch)
    tier = LocalTier(CheckpointConfig(local_dir=str(tmp_path / "local")), LAYOUT)
    chosen = selection.select([tier], family="runA")
    assert chosen.handler is None and not chosen.quarantined
    assert chosen.missing == ["local step 10: missing on rank(s) [1]"]
    names = sorted(p.name for p in (tmp_path / "local" / "0").iterdir())
    assert names == [paths.local_manifest_name(10, 0), paths.local_file_name(10, 0)]
    assert tier._abandoned == set()  # files lost with a node: rank 0 keeps its part for a restore


def test_a_step_another_rank_left_dirty_is_an_interrupted_save_left_for_the_next_save(tmp_path, monkeypatch):
    """Rank 1 left a ``.dirty`` file of step 10 (killed while writing): the step is skipped, not
    quarantined, and rank 0's sealed part of it is a leftover for the next save (the rule of
    ``checkpoints verify``, issue 10), not a file to keep."""
    _write_own(tmp_path / "local", 10)
    _rank1_holds_nothing(monkeypatch, dirty_steps=[10])
    tier = LocalTier(CheckpointConfig(local_dir=str(tmp_path / "local")), LAYOUT)
    chosen = selection.select([tier], family="runA")
    assert chosen.handler is None and not chosen.quarantined
    assert chosen.missing == ["local step 10: interrupted save (rank(s) [1] left it unfinished)"]
    assert len(list((tmp_path / "local" / "0").iterdir())) == 2  # nothing renamed or removed at resume
    assert tier._abandoned == {10}


def test_an_interrupted_first_save_is_no_history_but_a_step_lost_with_a_node_is(tmp_path, monkeypatch):
    """A restart after a kill during the run's first LOCAL save (rank 1 left ``.dirty``, rank 0 sealed
    its part) finds only the run record and that save's files: a fresh start, as the same run. The
    same files with rank 1's simply gone (a replaced node) are history: refused, naming the ranks."""
    from tierstack.checkpointing import family

    _write_own(tmp_path / "local", 5)
    paths.write_run_file(tmp_path / "local", "runA")
    cfg = CheckpointConfig(local_dir=str(tmp_path / "local"))
    _rank1_holds_nothing(monkeypatch, dirty_steps=[5])
    tier = LocalTier(cfg, LAYOUT)
    chosen = selection.select([tier], family="runA")
    assert chosen.interrupted == [(CheckpointTier.LOCAL, 5)]
    assert family.check_fresh_start(cfg, chosen, [tier]) is True
    monkeypatch.undo()
    _rank1_holds_nothing(monkeypatch)
    tier = LocalTier(cfg, LAYOUT)
    chosen = selection.select([tier], family="runA")
    with pytest.raises(family.CheckpointUnavailableError, match=r"local step 5: missing on rank\(s\) \[1\]"):
        family.check_fresh_start(cfg, chosen, [tier])


@pytest.mark.parametrize("local_run,topology,refused", [
    ("runA", {"world_size": 1}, False),   # nothing of runA's history: a fresh start as runA
    ("runA", {"world_size": 4}, True),    # runA's LOCAL step 5 of another topology: history
    ("runB", {"world_size": 4}, False),   # another run's files beside the GLOBAL directory: left alone
])
def test_a_fresh_start_looks_for_history_beyond_the_deciding_directory(tmp_path, local_run, topology, refused):
    """The GLOBAL directory (which decides the run) holds only runA's ``run.json``; whether a fresh
    start is allowed depends on the LOCAL checkpoints beside it, which selection could not use."""
    from tierstack.checkpointing import family
    from tierstack.checkpointing.global_tier import GlobalTier

    cfg = CheckpointConfig(local_dir=str(tmp_path / "local"), save=str(tmp_path / "global"))
    paths.write_run_file(tmp_path / "global", "runA")
    if topology != {"world_size": 1}:
        store = local_replicas.ReplicaStore(tmp_path / "local", 0)
        ckpt, man_path = store.paths(5, 0)
        local_file.write_raw(ckpt, torch.frombuffer(bytearray(b"x" * 64), dtype=torch.uint8))
        man = manifest.build_manifest(tier="local", step=5, run_id=local_run, topology=topology,
                                      train_state={"step": 5}, files=manifest.describe_files(ckpt.parent, [ckpt.name]))
        manifest.write_manifest(man_path, man)
    tiers = [LocalTier(cfg, LAYOUT), GlobalTier(cfg, LAYOUT, run_config={})]
    chosen = selection.select(tiers, family="runA")
    assert chosen.handler is None
    if refused:
        with pytest.raises(family.CheckpointUnavailableError, match="local step 5: topology-changed"):
            family.check_fresh_start(cfg, chosen, tiers, "runA")
    else:
        assert family.check_fresh_start(cfg, chosen, tiers, "runA") is True


def test_own_dirty_files_name_the_interrupted_steps(tmp_path):
    (tmp_path / "local" / "0").mkdir(parents=True)
    (tmp_path / "local" / "0" / "iter_0000012_0_local.dirty.pt").write_bytes(b"x")
    (tmp_path / "local" / "0" / "iter_0000013_1_local.dirty.pt").write_bytes(b"x")  # not this rank's
    tier = LocalTier(CheckpointConfig(local_dir=str(tmp_path / "local")), LAYOUT)
    assert tier.interrupted_steps() == [12]


def test_quarantined_files_beyond_the_budget_are_removed_oldest_first(tmp_path, caplog):
    for i, name in enumerate(["a.pt.invalid-x", "b.pt.invalid-x", "c.pt.invalid-x", "keep.pt"]):
        p = tmp_path / name
        p.write_bytes(b"\0" * 100)
        os.utime(p, (time.time() - 100 + i, time.time() - 100 + i))
    with caplog.at_level("WARNING"):
        removed = retention.prune_quarantined(tmp_path, 250)
    assert [p.name for p in removed] == ["a.pt.invalid-x"]
    assert "removing quarantined" in caplog.text and "a.pt.invalid-x" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.pt.invalid-x", "c.pt.invalid-x", "keep.pt"]
    retention.prune_quarantined(tmp_path, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.pt"]  # never a file that is not quarantined


# --- Issue 9: nodes whose disks changed places (the rendezvous gives node indices anew) -----------

TWO_NODES = dataclasses.replace(LAYOUT, world_size=2, data_parallel_size=2, local_world_size=1)


def _put(folder, step, owner, run_id="runA"):
    """``owner``'s LOCAL file and manifest of ``step`` in ``folder`` (its bytes name run, owner and step)."""
    folder.mkdir(parents=True, exist_ok=True)
    ckpt = folder / paths.local_file_name(step, owner)
    data = bytearray(f"{run_id}:{owner}:{step};".encode() * 64)
    local_file.write_raw(ckpt, torch.frombuffer(data, dtype=torch.uint8))
    man = manifest.build_manifest(tier="local", step=step, run_id=run_id, topology=TWO_NODES.topology(),
                                  train_state={"step": step}, files=manifest.describe_files(folder, [ckpt.name]))
    manifest.write_manifest(folder / paths.local_manifest_name(step, owner), man)


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name.startswith("iter_"))


def _steps(folder, owner):
    return sorted(paths.parse_local_file(p.name)[0] for p in folder.glob(f"iter_*_{owner}_local.pt"))


def test_swapped_disks_own_files_under_replicas_are_adopted_and_the_other_ranks_folder_is_held_as_replicas(
        tmp_path, caplog, monkeypatch):
    """2 nodes x 1 rank, factor 2. Rank 0 runs on the disk node 1 had: its own files are under
    ``replicas/0`` and rank 1's own folder ``1/`` is here. The resume moves them (file, then
    manifest) where this layout looks, the LOCAL tier finds its steps, and another run's files stay."""
    root = tmp_path / "local"
    for step in (5, 10):
        _put(root / "replicas" / "0", step, 0)
        _put(root / "1", step, 1)
    _put(root / "replicas" / "0", 3, 0, run_id="runB")
    _put(root / "1", 3, 1, run_id="runB")
    before = {(o, s): (root / d / paths.local_file_name(s, o)).read_bytes()
              for o, d in ((0, "replicas/0"), (1, "1")) for s in (5, 10)}
    tier = LocalTier(CheckpointConfig(local_dir=str(root), replication_factor=2), TWO_NODES)
    rank1 = [replica_id(s, 1) for s in (5, 10)]  # (one process: rank 1's view, its own files on its node)
    # (rank 1's holdings in that gather; in the one on damaged own files, rank 1's are fine)
    monkeypatch.setattr(collectives, "all_gather_object", lambda obj: [obj, rank1 if isinstance(obj, list) else False])
    with caplog.at_level("WARNING"):
        tier.prepare_resume("runA")
    assert sorted(c.step for c in tier.candidates("runA")) == [5, 10]
    assert _steps(root / "0", 0) == [5, 10] and _steps(root / "replicas" / "1", 1) == [5, 10]
    assert {(o, s): (root / d / paths.local_file_name(s, o)).read_bytes()
            for o, d in ((0, "0"), (1, "replicas/1")) for s in (5, 10)} == before
    assert _steps(root / "1", 1) == [3] and _steps(root / "replicas" / "0", 0) == [3]  # runB's: untouched
    store = tier._replication.store
    assert sorted(store.holdings("runA")) == sorted(replica_id(s, o) for s in (5, 10) for o in (0, 1))
    assert (f"LOCAL step(s) [5, 10] of rank 0 found under {root}/replicas/0 on the node of rank(s) [0]: moved to "
            f"{root}/0, adopted as that rank's own file") in caplog.text
    assert (f"LOCAL step(s) [5, 10] of rank 1 found under {root}/1 on the node of rank(s) [0]: moved to "
            f"{root}/replicas/1, held as a replica") in caplog.text


def test_with_two_ranks_per_node_the_node_ranks_folders_stay_and_only_local_rank_0_moves(tmp_path, monkeypatch):
    """4 ranks, 2 per node, factor 2 (cliques [0, 2], [1, 3]): ``0/`` and ``1/`` are both own folders on
    the node of ranks 0 and 1, ``replicas/2`` and ``replicas/3`` its replicas: nothing moves. On the
    node of ranks 2 and 3 the same disk is swapped in: local rank 0 (rank 2) moves, rank 3 does not."""
    root = tmp_path / "local"
    for d, owner in (("0", 0), ("1", 1), ("replicas/2", 2), ("replicas/3", 3)):
        _put(root / d, 10, owner)
    layout = _files(root)
    assert local_replicas.ReplicaStore(root, 0, (0, 1)).normalize("runA") == []
    assert _files(root) == layout
    kw = dict(on_writer=True, ranks_per_node=2)
    monkeypatch.setattr(collectives, "all_gather_object", lambda obj: [obj] * 4)  # (one process: 4 ranks' views)
    local_replicas.LocalReplication(root, 2, 2, 3, 4, local_rank=1, **kw).retrieve_for_resume("runA")
    assert _files(root) == layout  # rank 3 is local rank 1: it leaves the disk to rank 2
    local_replicas.LocalReplication(root, 2, 2, 2, 4, local_rank=0, **kw).retrieve_for_resume("runA")
    assert _files(root) == sorted(f"{d}/{paths.local_file_name(10, o)[:-2]}{x}" for d, o in
                                  (("2", 2), ("3", 3), ("replicas/0", 0), ("replicas/1", 1))
                                  for x in ("pt", "manifest.json"))


def test_a_step_held_twice_is_never_overwritten_and_retention_removes_the_surplus(tmp_path):
    """A step the destination has already stays where it is (nothing is overwritten); a move a crash
    interrupted between file and manifest is completed. What stays in the wrong place (and an
    interrupted write there) is pruned by the node's local rank 0 once a newer step is sealed;
    another run's files stay."""
    root = tmp_path / "local"
    _put(root / "0", 10, 0)
    own10 = (root / "0" / paths.local_file_name(10, 0)).read_bytes()
    for step in (5, 10):
        _put(root / "replicas" / "0", step, 0, run_id="runA")
        _put(root / "1", step, 1)
    _put(root / "replicas" / "1", 10, 1)
    _put(root / "1", 3, 1, run_id="runB")
    (root / "1" / "iter_0000007_1_local.dirty.pt").write_bytes(b"partial" * 100)  # rank 1's interrupted write here
    # an interrupted move of rank 0's step 15: the file is in place, its manifest not yet
    _put(root / "replicas" / "0", 15, 0)
    (root / "replicas" / "0" / paths.local_file_name(15, 0)).rename(root / "0" / paths.local_file_name(15, 0))
    lines = local_replicas.ReplicaStore(root, 0).normalize("runA")
    assert any("[10] of rank 0 found under" in x and "left in place" in x for x in lines)
    assert _steps(root / "0", 0) == [5, 10, 15] and (root / "0" / paths.local_manifest_name(15, 0)).exists()
    assert (root / "0" / paths.local_file_name(10, 0)).read_bytes() == own10
    assert _steps(root / "replicas" / "0", 0) == [10] and _steps(root / "replicas" / "1", 1) == [5, 10]
    assert _steps(root / "1", 1) == [3, 10]
    replication = local_replicas.LocalReplication(root, 2, 1, 0, 2, on_writer=True)
    replication.prune("runA", 20, k=2)  # (the LOCAL tier prunes 0/ itself)
    assert not (root / "replicas" / "0").exists()  # a replica of the node's own rank: surplus
    assert sorted(p.name for p in (root / "1").iterdir()) == sorted(
        [paths.local_file_name(3, 1), paths.local_manifest_name(3, 1)])  # another run's stay
    assert _steps(root / "replicas" / "1", 1) == [10]  # the clique's replicas: most_recent_k as ever


def test_a_damaged_own_file_of_the_step_is_quarantined_and_counts_as_missing(tmp_path, caplog):
    """At resume each rank checks its own file of the step the ranks would take (checksum, same size:
    only the bytes tell). A good one is kept in memory for the load; a damaged one is quarantined so
    that the step is retrieved from a replica (local_replicas.retrieve_for_resume)."""
    root = tmp_path / "local"
    for step in (5, 10):
        _write_own(root, step)
    store = local_replicas.ReplicaStore(root, 0)
    held = [store.holdings("runA"), []]
    assert local_replicas._own_file_damaged(store, held, 10) is False
    assert bytes(store.verified[10].numpy()) == store.paths(10, 0)[0].read_bytes()  # the bytes the load reuses
    ckpt = store.paths(10, 0)[0]
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    store.verified.clear()
    with caplog.at_level("ERROR"):
        assert local_replicas._own_file_damaged(store, held, 10) is True
    assert "rank 0's own LOCAL file of step 10 is damaged (checksum-mismatch" in caplog.text
    assert not ckpt.exists() and list(ckpt.parent.glob(ckpt.name + ".invalid-checksum-mismatch*"))
    assert 10 not in store.verified and replica_id(10, 0) not in store.holdings("runA")
    assert local_replicas._own_file_damaged(store, held, 7) is False  # a step it does not hold: not its to check
