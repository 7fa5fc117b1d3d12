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
from typing import Callable, Iterable, Optional

from tierstack.checkpointing import paths

log = logging.getLogger(__name__)
_global_need: dict[str, int] = {}  # GLOBAL root -> bytes of its newest checkpoint, once read by make_room_global
_made_room: set[str] = set()  # directories where make_room removed something (its first removal is a WARNING)


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


def own_global_steps(root: Path, run_id: str) -> dict[int, Path]:
    """Published GLOBAL step directories of ``run_id`` under ``root`` (their manifest names the run)."""
    own = {}
    for p in Path(root).iterdir():
        step = paths.parse_step_dir(p.name)
        if step is None or not p.is_dir():
            continue
        man = paths.read_json(p / paths.MANIFEST)
        if man is not None and man.get("run_id") == run_id:
            own[step] = p
    return own


def remove_global_step(path: Path, step: int, run_id: str) -> None:
    """Renamed first (one atomic step: no longer a resume candidate, never seen half deleted), then
    deleted; what a crash leaves is a leftover the next save removes."""
    doomed = path.with_name(paths.deleting_dir_name(step, run_id))
    path.rename(doomed)
    shutil.rmtree(doomed)


def prune_global(root: Path, run_id: str, published: int, k: int,
                 protected: Optional[Iterable[int]] = None) -> list[int]:
    """Delete old GLOBAL step directories of ``run_id`` under ``root`` (call on one rank), keeping
    the ``protected`` steps (the published TrainState's top-K best records)."""
    own = own_global_steps(root, run_id)
    removed = []
    for step in steps_to_delete(own, published, k, protected or ()):
        log.info("retention: removing GLOBAL checkpoint %s (most_recent_k=%d)", own[step], k)
        if _try(lambda p: remove_global_step(p, step, run_id), own[step]):
            removed.append(step)
    return removed


def make_room_global(root: Path, run_id: str, step: int, k: int, protected: Iterable[int]) -> list[str]:
    """Rank 0, before the GLOBAL save of ``step`` is staged: :func:`make_room` for about as many bytes
    as the newest published checkpoint of ``run_id`` took (its manifest's ``bytes``), removing the
    quarantined entries of ``root``, then the run's published steps older than the newest one,
    oldest first, never one of ``protected`` (the top-K best records); with ``k == -1`` (keep all)
    only quarantined entries. Nothing is done before the run has a published checkpoint here. The
    directory is listed once per process, and again only when fewer bytes are free than that size."""
    free = free_bytes(root)
    if free is None or free >= _global_need.get(str(root), free + 1):  # the usual case: one statvfs
        return []
    own = own_global_steps(root, run_id)
    if not own:
        return []
    newest = max(own)
    need = int((paths.read_json(own[newest] / paths.MANIFEST) or {}).get("bytes", 0))
    _global_need[str(root)] = need
    if free >= need:
        return []
    removals = [(f"quarantined {p}", lambda p=p: remove_quarantined(p)) for p in quarantined(root, run_id)]
    if k != -1:
        keep = {int(s) for s in protected} | {newest}
        removals += [(f"GLOBAL checkpoint {own[s]}", lambda s=s: remove_global_step(own[s], s, run_id))
                     for s in paths.sorted_steps(own) if s not in keep]
    return make_room(root, need, removals, f"GLOBAL checkpoint of step {step}")


def _try(remove, path: Path) -> bool:
    """One removal; a failure is logged and the next one is still tried (the next publish retries)."""
    try:
        remove(path)
        return True
    except OSError as e:
        log.warning("retention: could not remove %s (%s); kept for now", path, e)
        return False


def own_local_steps(rank_dir: Path, rank: int, run_id: str) -> list[int]:
    """Steps of ``run_id`` whose LOCAL file of ``rank`` is in ``rank_dir`` (its manifest names the
    run), oldest first."""
    own = []
    for p in Path(rank_dir).iterdir():
        parsed = paths.parse_local_file(p.name)
        if parsed is None or parsed[1] != rank:
            continue
        man = paths.read_json(p.with_name(paths.local_manifest_name(parsed[0], rank)))
        if man is not None and man.get("run_id") == run_id:
            own.append(parsed[0])
    return paths.sorted_steps(set(own))


def remove_local_step(rank_dir: Path, rank: int, step: int) -> bool:
    """Remove ``rank``'s LOCAL file of ``step`` and then its manifest (if the file stays, its manifest
    stays with it and it is still a valid checkpoint); a failure is logged. True when removed."""
    if _try(lambda p: p.unlink(missing_ok=True), Path(rank_dir) / paths.local_file_name(step, rank)):
        _try(lambda p: p.unlink(missing_ok=True), Path(rank_dir) / paths.local_manifest_name(step, rank))
        return True
    return False


def prune_local(rank_dir: Path, rank: int, run_id: str, published: int, k: int) -> list[int]:
    """Delete this rank's old LOCAL files (checkpoint and manifest) of ``run_id``."""
    removed = []
    for step in steps_to_delete(own_local_steps(rank_dir, rank, run_id), published, k):
        log.info("retention: removing LOCAL checkpoint step %d of rank %d (most_recent_k=%d)", step, rank, k)
        if remove_local_step(rank_dir, rank, step):
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


def quarantined(directory: Path, run_id: Optional[str] = None) -> list[Path]:
    """The quarantined entries (``*.invalid-*`` files or directories) of ``directory``, oldest first
    by modification time (a rename keeps it: the age of the checkpoint, not of the quarantine);
    with ``run_id``, only those whose manifest names that run (:func:`_quarantined_run`): another
    run's, or one whose run cannot be told, is left out."""
    try:
        entries = [p for p in Path(directory).iterdir() if ".invalid-" in p.name]
    except OSError:
        return []
    dated = []
    for p in entries:
        try:
            if run_id is None or _quarantined_run(p) == run_id:
                dated.append((p.stat().st_mtime, p))
        except OSError:  # removed meanwhile
            pass
    return [p for _, p in sorted(dated, key=lambda e: e[0])]


def _quarantined_run(p: Path) -> Optional[str]:
    """The run id of a quarantined entry: a GLOBAL step directory's manifest, a LOCAL manifest itself,
    or a LOCAL file's manifest quarantined with it (same reason); None when there is none."""
    if p.is_dir():
        return (paths.read_json(p / paths.MANIFEST) or {}).get("run_id")
    base, _, reason = p.name.partition(".invalid-")
    parsed = paths.parse_local_file(base)
    if parsed is not None:
        p = p.with_name(f"{paths.local_manifest_name(*parsed)}.invalid-{reason}")
    return (paths.read_json(p) or {}).get("run_id")


def remove_quarantined(p: Path) -> None:
    """Remove one quarantined entry (a directory with its contents)."""
    shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)


def prune_quarantined(directory: Path, budget_bytes: int) -> list[Path]:
    """Remove the oldest quarantined entries (:func:`quarantined`) of ``directory`` until the rest take
    at most ``budget_bytes``; returns what was removed (each one logged). A LOCAL file and its
    manifest are two entries, removed in that order.
    """
    sized = [(p, _size(p)) for p in quarantined(directory)]
    total = sum(n for _, n in sized)
    removed = []
    for p, n in sized:
        if total <= budget_bytes:
            break
        log.warning("retention: removing quarantined %s (%d bytes; quarantined checkpoints in %s take %d bytes, "
                    "checkpoint.quarantine_budget_bytes=%d)", p, n, directory, total, budget_bytes)
        if _try(remove_quarantined, p):
            total -= n
            removed.append(p)
    return removed


def free_bytes(directory: Path) -> Optional[int]:
    """Bytes free to this process on the file system of ``directory`` (``shutil.disk_usage``), or
    None when that cannot be read (the directory is gone, EIO): then nothing is removed for room."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def make_room(directory: Path, need_bytes: int, removals: Iterable[tuple[str, Callable[[], object]]],
              what: str, forced: Iterable[tuple[str, Callable[[], object]]] = (),
              own_need: Optional[int] = None) -> list[str]:
    """Before a save writes on the file system of ``directory``: run every one of ``forced`` (removals
    the ranks agreed on, :meth:`~tierstack.checkpointing.local_files.LocalFiles._room_plan`), then,
    while fewer than ``need_bytes`` bytes are free, the next of ``removals`` (``(label, remove)``
    pairs, the least needed first); returns the labels of those run.

    Retention removes old checkpoints only after a save has sealed, so a file system that holds
    ``most_recent_k`` checkpoints but not one more failed every later save (ENOSPC) while the old
    ones stayed. The caller passes only what a resume does not need: never the newest sealed step.
    Each removal is logged with what was given up and the free and needed bytes (the first one in
    a directory as a WARNING, later ones at INFO); when fewer than ``own_need`` bytes (what this
    process writes; default ``need_bytes``) are still free at the end, one WARNING says the write
    will likely fail, and the save then fails and is reported as any failed save.
    """
    forced = list(forced)
    free = free_bytes(directory)
    if free is None or (free >= need_bytes and not forced):
        return []
    done = []

    def run(label: str, remove: Callable[[], object], agreed: bool = False) -> None:
        first = str(directory) not in _made_room
        _made_room.add(str(directory))
        log.log(logging.WARNING if first else logging.INFO,
                "%s: removing %s to make room (%s has %d bytes free, about %d needed%s)%s", what, label, directory,
                free, need_bytes, "; every rank removes the same steps when any is short" if agreed else "",
                " (retention removes old checkpoints after a save seals, too late on a full file system; later "
                "removals for room in this directory are logged at INFO)" if first else "")
        try:
            remove()
        except OSError as e:
            log.warning("retention: could not remove %s (%s)", label, e)
            return
        done.append(label)

    for label, remove in forced:
        run(label, remove, agreed=True)
        free = free_bytes(directory)
    for label, remove in removals:
        if free is None or free >= need_bytes:
            return done
        run(label, remove)
        free = free_bytes(directory)
    if free is not None and free < (need_bytes if own_need is None else own_need):
        log.warning("%s: %s has %d bytes free, about %d needed, and nothing this save may remove is left: the write "
                    "will likely fail (ENOSPC); free space there or move the directory", what, directory, free,
                    need_bytes if own_need is None else own_need)
    return done
