"""Issue 26, item 2: a published GLOBAL step is crash-durable. Every file of the step directory (data
files, megatron's .metadata and metadata.json, run_config.yaml, the manifest) and the directory
itself are fsync'd before the rename that makes the step visible (real megatron-core save, real
files; os.fsync and the rename recorded by wrappers)."""

import os
from pathlib import Path

import torch

from tierstack.checkpointing import global_writer, manifest, paths, publish


def _staged_step(root: Path, step: int) -> Path:
    """A staging directory as the GLOBAL tier leaves it before publish: megatron's files, ours, sealed."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    staging = root / paths.staging_dir_name(step, "r1", 1)
    staging.mkdir(parents=True)
    global_writer.start_results_channel()
    try:
        request = dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(64.0)),
                                           "common": {"step": step}}, str(staging), async_sharded_save=True,
                                          async_strategy="mcore")
        global_writer.write_request(request, staging, attempts=1, backoff_s=0.0)
        for fn in request.finalize_fns:
            fn()
    finally:
        global_writer.shutdown_results_channel()
    (staging / paths.RUN_CONFIG).write_text("model: {}\n")
    files = manifest.describe_files(staging, manifest.list_files(staging))
    man = manifest.build_manifest(tier="global", step=step, run_id="r1", topology={"world_size": 1},
                                  train_state={"step": step}, files=files)
    manifest.write_manifest(staging / paths.MANIFEST, man)
    return staging


def test_every_file_and_the_directory_are_fsynced_before_the_rename(gloo_group, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    staging = _staged_step(root, 20)
    names = set(manifest.list_files(staging, exclude=()))
    assert {".metadata", "metadata.json", paths.RUN_CONFIG, paths.MANIFEST} <= names  # megatron-core 0.19: no common.pt
    events: list = []
    real_fsync, real_rename = os.fsync, Path.rename

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(self, target):
        events.append(("rename", str(self), str(target)))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(Path, "rename", rename)
    publish.publish_step(root, 20, staging, {"step": 20}, "r1")
    at = next(i for i, e in enumerate(events) if e[0] == "rename" and e[1] == str(staging))
    synced_before = {e[1] for e in events[:at] if e[0] == "fsync"}
    missing = {n for n in names if os.path.realpath(staging / n) not in synced_before}
    assert not missing, missing
    assert os.path.realpath(staging) in synced_before  # the directory's entries too
    final = root / paths.step_dir_name(20)
    assert final.is_dir() and (root / paths.TRACKER_ITERATION).read_text().strip() == "20"


def test_a_late_writer_of_an_abandoned_save_never_feeds_the_next_save(gloo_group, tmp_path):
    """Issue 26, item 13: each GLOBAL save plans with a results queue of its own (as the tier does,
    ``start_results_channel(fresh=True)`` before megatron plans), so the writer of an abandoned save
    that finishes late reports into that save's queue; the next save's finalize reads its own
    results and the checkpoint loads with the next save's values."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def plan(path: Path, value: float):
        path.mkdir(parents=True)
        global_writer.start_results_channel(fresh=True)
        sd = {"w": ShardedTensor.from_rank_offsets("w", torch.full((64,), value))}
        return dist_checkpointing.save(sd, str(path), async_sharded_save=True, async_strategy="mcore")

    try:
        abandoned = plan(tmp_path / "a", 1.0)  # its writer "hangs": it runs only after the next save planned
        current = plan(tmp_path / "b", 2.0)
        assert abandoned.async_fn_args[2] is not current.async_fn_args[2]
        global_writer.write_request(abandoned, tmp_path / "a", attempts=1, backoff_s=0.0)  # unblocks late
        global_writer.write_request(current, tmp_path / "b", attempts=1, backoff_s=0.0)
        for fn in current.finalize_fns:
            fn()
        assert current.async_fn_args[2].empty()
    finally:
        global_writer.shutdown_results_channel()
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64))}, str(tmp_path / "b"))
    assert torch.equal(loaded["w"], torch.full((64,), 2.0))


def test_a_file_missing_from_rank0s_listing_is_taken_from_the_writers_report(gloo_group, tmp_path, monkeypatch):
    """Issue 26, item 14: on NFS rank 0's listing of the shared staging directory can miss a file
    another node's writer just wrote (attribute caching). The writers' reports are the truth: the
    step is sealed with that file in its manifest and published, not failed permanently."""
    from tierstack.checkpointing.global_tier import GlobalTier
    from tierstack.config import CheckpointConfig
    from tierstack.runtime import ParallelLayout

    layout = ParallelLayout(rank=0, world_size=1, local_rank=0, tensor_model_parallel_size=1,
                            pipeline_model_parallel_size=1, data_parallel_size=1, tensor_model_parallel_rank=0,
                            pipeline_model_parallel_rank=0, data_parallel_rank=0)
    root = tmp_path / "ckpt"
    tier = GlobalTier(CheckpointConfig(save=str(root)), layout, run_config={})
    staging = root / paths.staging_dir_name(30, "r1", 1)
    staging.mkdir(parents=True)
    (staging / "__1_0.distcp").write_bytes(b"written by rank 1's writer on another node")
    (staging / ".metadata").write_bytes(b"rank 0's metadata")
    described = manifest.describe_files(staging, ["__1_0.distcp"])  # what that writer reported
    real_list = manifest.list_files
    monkeypatch.setattr(manifest, "list_files", lambda d, *a, **k: [n for n in real_list(d, *a, **k)
                                                                     if n != "__1_0.distcp"])
    try:
        tier._seal_and_publish(30, staging, {"step": 30}, "r1", {}, described)
    finally:
        tier.close()
    final = root / paths.step_dir_name(30)
    man = paths.read_json(final / paths.MANIFEST)
    assert {"__1_0.distcp", ".metadata", paths.RUN_CONFIG} <= set(man["files"])
    assert manifest.check_files(final, man["files"]) is None
