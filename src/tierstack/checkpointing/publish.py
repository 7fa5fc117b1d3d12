"""Publishing a sealed GLOBAL step as one decision (rank 0).

Publishing is the directory rename plus the tracker files (``latest_checkpointed_iteration.txt``,
``latest_train_state.pt`` and, when the TrainState holds top-K best records,
``best_checkpointed_iteration.txt``). If the rename succeeded and a tracker write then failed, the step
would be complete on disk and resumable while the trackers and the log said it was not, and a
retry would find its own published copy in the way. So everything that can run out of space (the
tracker contents, fsync'd in temp files; the run file) happens before the rename, and if any later
step fails the rename is undone and the old trackers put back: either the step is published
(directory and trackers agree) or nothing of it is visible to resume, and a retry starts clean.

Durability: before the rename, every file of the step (megatron's ``.metadata`` and ``metadata.json``,
``run_config.yaml``, the manifest, the data files) and every directory of it is fsync'd
(:func:`paths.fsync_tree`), then the rename and the root directory: after a power loss the trackers
never name a step with an empty or missing file, and retention (which runs after this) never removes
the previous checkpoint while the new one is only in the page cache. Data files are fsync'd by their
writers too; on NFS rank 0's fsync of them only flushes what its own client holds.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import torch

from tierstack.checkpointing import best, paths

log = logging.getLogger(__name__)


def publish_step(root: Path, step: int, staging: Path, train_state: dict, run_id: str) -> None:
    """Rank 0: rename ``staging`` to ``root/iter_<step>`` and point the trackers at it, or nothing.

    A directory of ``step`` already there is this run's older copy (resumed with ``ckpt_step``) and
    is quarantined as ``*.invalid-superseded``; another run's checkpoint is never moved.

    Raises:
        FileExistsError: ``root/iter_<step>`` holds another run's checkpoint.
        OSError: a write or rename failed; the step is then not published (undone).
    """
    final = root / paths.step_dir_name(step)
    if final.exists():
        theirs = (paths.read_json(final / paths.MANIFEST) or {}).get("run_id")
        if theirs != run_id:  # another run's checkpoint is never moved, replaced or deleted
            raise FileExistsError(f"{final} holds a checkpoint of run {theirs}, not of this run ({run_id}); "
                                  "not replaced: use another checkpoint.save directory")
    buf = io.BytesIO()
    torch.save(train_state, buf)
    trackers = {root / paths.TRACKER_ITERATION: f"{step}\n".encode(), root / paths.TRACKER_TRAIN_STATE: buf.getvalue()}
    best_step = best.best_step(train_state)
    if best_step is not None:  # the top-K records published with this checkpoint name the best
        trackers[root / best.TRACKER_BEST] = f"{best_step}\n".encode()
    old = {p: (p.read_bytes() if p.exists() else None) for p in trackers}
    tmps: dict[Path, Path] = {}
    try:
        for p, data in trackers.items():
            tmps[p] = paths.prepare_atomic(p, data)
        paths.write_run_file(root, run_id)
        paths.fsync_tree(staging)  # every file and directory of the step durable before it becomes visible
        if final.exists():
            paths.quarantine(final, "superseded")  # ours, older (resumed with ckpt_step): kept aside
        staging.rename(final)
        paths.fsync_dir(root)
        for p, tmp in tmps.items():
            paths.commit_atomic(tmp, p)
    except BaseException:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
        if final.exists() and not staging.exists():
            final.rename(staging)  # undo: the step was never published
            _restore(old)
        raise


def _restore(old: dict) -> None:
    """Put the trackers back as they were before a publish that was undone."""
    for p, data in old.items():
        try:
            paths.atomic_write_bytes(p, data) if data is not None else p.unlink(missing_ok=True)
        except OSError as e:
            log.error("could not restore tracker %s after a failed publish: %s", p, e)
