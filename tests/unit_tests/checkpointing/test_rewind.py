"""Rewind (checkpoint.ckpt_step): what a rank moves aside of the abandoned timeline, on real files."""

import json
from types import SimpleNamespace

from tierstack.checkpointing import paths, rewind
from tierstack.checkpointing.local_replicas import ReplicaStore
from tierstack.checkpointing.types import Candidate, CheckpointTier


def _local(folder, step, owner, run_id="r1"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / paths.local_file_name(step, owner)).write_bytes(b"x")
    (folder / paths.local_manifest_name(step, owner)).write_text(json.dumps({"run_id": run_id}))


def test_own_files_and_the_replicas_kept_for_others_of_newer_steps_are_renamed(tmp_path):
    store = ReplicaStore(tmp_path, 0, [0], {1})
    for step in (10, 20, 30):
        _local(store.folder(0), step, 0)
        _local(store.folder(1), step, 1)  # replicas of rank 1 kept on this node
    _local(store.folder(1), 40, 1, run_id="other")  # another run's: never touched
    replication = SimpleNamespace(store=store, replicator=SimpleNamespace(clique=[0, 1]))
    cands = [Candidate(CheckpointTier.LOCAL, s, store.folder(0) / paths.local_file_name(s, 0), {}) for s in (10, 20, 30)]
    assert rewind.move_aside_local(store.folder(0), cands, 10, "r1", replication) == [20, 30]
    for folder, owner in ((store.folder(0), 0), (store.folder(1), 1)):
        names = sorted(p.name for p in folder.iterdir())
        assert paths.local_file_name(10, owner) in names  # the step resumed stays
        for step in (20, 30):
            assert paths.local_file_name(step, owner) not in names
            assert f"{paths.local_file_name(step, owner)}.rewound-to-10" in names
            assert f"{paths.local_manifest_name(step, owner)}.rewound-to-10" in names
    assert (store.folder(1) / paths.local_file_name(40, 1)).exists()
    assert paths.aside_kind(f"{paths.local_file_name(20, 0)}.rewound-to-10") == "rewound"
