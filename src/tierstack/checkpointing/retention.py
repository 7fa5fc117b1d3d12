"""Retention: after a publish, keep the ``most_recent_k`` checkpoints of this run in a tier.

Two protections, and a checkpoint is removed only when neither holds: the ``most_recent_k``
newest (the published one counts; resume needs the newest), and the top-K best records of the
TrainState just published (GLOBAL, ``checkpoint.keep_best_k``; :func:`~tierstack.checkpointing.best.protected_steps`).
A best checkpoint never takes the place of a recent one, nor the other way round. A removal
that fails is logged and skipped (the next publish tries again). Never deletes
the checkpoint just published, anything newer than it (a run resumed from an older step with
``ckpt_step`` leaves newer ones alone), or a checkpoint of another run.

Quarantined checkpoints (``*.invalid-<reason>``, renamed by resume selection) are kept for
inspection, but not forever: they count against ``checkpoint.quarantine_budget_bytes`` per
directory, and the oldest beyond it are removed, each removal logged (:func:`prune_quarantined`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Iterable, Optional

from tierstack.checkpointing import paths

log = logging.getLogger(__name__)


def steps_to_delete(own_steps: Iterable[int], published: int, k: int,
                    protected: Iterable[int] = ()) -> list[int]:
    """Steps of this run to delete after publishing ``published``: all older ones except the
    ``k - 1`` newest of them (the published one counts towards ``k``; -1 keeps all) and except
    ``protected`` (the top-K best steps)."""
    if k < 0:
        return []
    older = [s for s in paths.sorted_steps(set(own_steps)) if s < published]
    keep = max(k - 1, 0)
    doomed = older[: len(older) - keep] if keep else older
    keep_best = {int(s) for s in protected}
    return [s for s in doomed if s not in keep_best]


def prune_global(root: Path, run_id: str, published: int, k: int,
                 protected: Optional[Iterable[int]] = None) -> list[int]:
    """Delete old GLOBAL step directories of ``run_id`` under ``root`` (call on one rank), keeping
    the ``protected`` steps (the published TrainState's top-K best records)."""
    own = {}
    for p in Path(root).iterdir():
        step = paths.parse_step_dir(p.name)
        if step is None or not p.is_dir():
            continue
        man = paths.read_json(p / paths.MANIFEST)
        if man is not None and man.get("run_id") == run_id:
            own[step] = p
    removed = []
    for step in steps_to_delete(own, published, k, protected or ()):
        log.info("retention: removing GLOBAL checkpoint %s (most_recent_k=%d)", own[step], k)
        # renamed first (one atomic step: no longer a resume candidate, never seen half deleted),
        # then deleted; what a crash leaves is a leftover the next save removes
        doomed = own[step].with_name(paths.deleting_dir_name(step, run_id))
        if _try(lambda p: (p.rename(doomed), shutil.rmtree(doomed)), own[step]):
            removed.append(step)
    return removed


def _try(remove, path: Path) -> bool:
    """One removal; a failure is logged and the next one is still tried (the next publish retries)."""
    try:
        remove(path)
        return True
    except OSError as e:
        log.warning("retention: could not remove %s (%s); kept for now", path, e)
        return False


def prune_local(rank_dir: Path, rank: int, run_id: str, published: int, k: int) -> list[int]:
    """Delete this rank's old LOCAL files (checkpoint and manifest) of ``run_id``."""
    own = []
    for p in Path(rank_dir).iterdir():
        parsed = paths.parse_local_file(p.name)
        if parsed is None or parsed[1] != rank:
            continue
        man = paths.read_json(p.with_name(paths.local_manifest_name(parsed[0], rank)))
        if man is not None and man.get("run_id") == run_id:
            own.append(parsed[0])
    removed = []
    for step in steps_to_delete(own, published, k):
        log.info("retention: removing LOCAL checkpoint step %d of rank %d (most_recent_k=%d)", step, rank, k)
        # the file first: if it stays, its manifest stays with it and it is still a valid checkpoint
        if _try(lambda p: p.unlink(missing_ok=True), Path(rank_dir) / paths.local_file_name(step, rank)):
            _try(lambda p: p.unlink(missing_ok=True), Path(rank_dir) / paths.local_manifest_name(step, rank))
            removed.append(step)
    return removed


def prune_leftovers_upto(folder: Path, step: int) -> list[Path]:
    """Remove the ``.dirty`` and temp files of LOCAL steps ``<= step`` in ``folder`` (a replicas
    folder): left by a store a kill interrupted, never a checkpoint, each as large as one. Files of
    newer steps may belong to a store in progress and are kept. Each removal is logged; a failed
    one is logged and skipped."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for p in entries:
        name = p.name.lstrip(".")
        if not (name.endswith(".dirty.pt") or ".tmp-" in name):
            continue
        parsed = paths.parse_local_name(name)
        if parsed is None or parsed[0] > step:
            continue
        log.info("retention: removing %s, left by an interrupted replica store", p)
        if _try(lambda q: q.unlink(missing_ok=True), p):
            removed.append(p)
    return removed


def _size(path: Path) -> int:
    """Bytes of a file, or of every file under a directory (0 when it vanished meanwhile)."""
    try:
        if not path.is_dir():
            return path.stat().st_size
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError:
        return 0


def prune_quarantined(directory: Path, budget_bytes: int) -> list[Path]:
    """Remove the oldest quarantined entries (``*.invalid-*`` files or directories) of ``directory``
    until the rest take at most ``budget_bytes``; returns what was removed (each one logged).

    Oldest by modification time (a rename keeps it: the age of the checkpoint, not of the
    quarantine); a LOCAL file and its manifest are two entries, removed in that order.
    """
    try:
        entries = [p for p in Path(directory).iterdir() if ".invalid-" in p.name]
    except OSError:
        return []
    sized = sorted(((p.stat().st_mtime, p, _size(p)) for p in entries if p.exists()), key=lambda e: e[0])
    total = sum(n for _, _, n in sized)
    removed = []
    for _, p, n in sized:
        if total <= budget_bytes:
            break
        log.warning("retention: removing quarantined %s (%d bytes; quarantined checkpoints in %s take %d bytes, "
                    "checkpoint.quarantine_budget_bytes=%d)", p, n, directory, total, budget_bytes)
        if _try(shutil.rmtree if p.is_dir() else (lambda q: q.unlink(missing_ok=True)), p):
            total -= n
            removed.append(p)
    return removed
