"""Which run family a launch continues, decided from the persistent record first.

A checkpoint names its run (``run_id`` in every manifest and TrainState); a tier root names the run
whose checkpoints it holds (``run.json``, see :mod:`layout`). The rule:

1. With a persistent tier's directory (GLOBAL: ``checkpoint.load``, else ``checkpoint.save``), the
   ``run.json`` there decides: it is the record that survives losing a node. A node-local tier
   (LOCAL) never decides then: a new experiment pointed at a fresh GLOBAL directory next to an old
   ``local_dir`` is a new run, and the old experiment's LOCAL checkpoints are reported (path, run
   id) and left alone.
2. Without a persistent tier's directory, the node-local ``run.json`` decides (the newest any rank sees).
3. A deciding directory that holds sealed checkpoints (with a manifest) but no ``run.json`` is
   nobody's on record: it is not adopted. The launch stops and says how to continue from them on
   purpose.
4. Evidence of an earlier run in a deciding directory (its ``run.json``, trackers, checkpoints in
   any state: published, staging, ``.dirty``, quarantined) with no valid checkpoint to resume from
   stops the launch (:func:`evidence`, checked by the manager before a fresh start) unless
   ``checkpoint.allow_fresh_start_on_invalid=true``: however often it is relaunched, a run never
   silently starts over where its history is. Directories that do not decide (an old node-local
   ``local_dir`` beside a fresh GLOBAL directory, rule 1) are not evidence: they are left alone.
   A run that failed before its first checkpoint left no history: its ``run.json``, leftovers of
   interrupted saves and the files of an interrupted first save (never sealed on every rank) do
   not stop the launch; the restart starts fresh under the same run id (:func:`check_fresh_start`).

The tiers are read through their contract
(:class:`~tierstack.checkpointing.types.CheckpointTierHandler`: ``persistent``, ``run_root``,
``candidates``), so a new tier needs no change here.

Checkpoints of another family are never resumed, counted by retention or deleted.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

from tierstack.checkpointing import paths, selection
from tierstack.checkpointing.replication import REPLICAS_DIR
from tierstack.checkpointing.errors import CheckpointLoadError
from tierstack.checkpointing.types import CheckpointTier, CheckpointTierHandler
from tierstack.errors import BadInputError
from tierstack.runtime import collectives as _dist

log = logging.getLogger(__name__)


class CheckpointFamilyError(BadInputError, CheckpointLoadError):
    """A checkpoint directory holds checkpoints with no record of whose they are."""


def _sealed(handler: CheckpointTierHandler) -> list[tuple[str, Optional[str]]]:
    """This rank's sealed checkpoints of ``handler`` (any run): (path, run id of the manifest).

    Only a checkpoint with a manifest counts: a stray ``iter_*`` directory without one is never a
    candidate and makes no directory 'unowned'."""
    found = [(str(c.path), (c.manifest or {}).get("run_id")) for c in handler.candidates(None) if c.manifest]
    return sorted(found)


def _unowned_error(handler: CheckpointTierHandler, found: list[tuple[str, Optional[str]]]) -> str:
    root, name = handler.run_root, handler.tier.value.upper()
    shown = "; ".join(f"{p} (run id {rid or 'unknown'})" for p, rid in found[:4])
    more = f" and {len(found) - 4} more" if len(found) > 4 else ""
    pretrained = found[-1][0] if handler.persistent else "<a GLOBAL step directory>"
    ids = sorted({rid for _, rid in found if rid})
    return (
        f"{name} checkpoint directory {root} holds checkpoints but no {paths.RUN_FILE} saying whose they are: "
        f"{shown}{more}. They are not this run's on record, so they are not resumed. To continue from them on "
        f"purpose: start a new run from their weights with checkpoint.pretrained_checkpoint={pretrained} and "
        "a new, empty checkpoint.save directory; or, if they are this run's own checkpoints and the record was "
        f"lost, restore it: write {root / paths.RUN_FILE} as {{\"run_id\": \"{ids[0] if ids else '<run id>'}\"}}"
        " and launch again."
    )


def _deciders(handlers: Sequence[CheckpointTierHandler]) -> list[CheckpointTierHandler]:
    """The tiers whose record decides: the persistent ones with a directory, else every one with a directory."""
    rooted = [h for h in handlers if h.run_root is not None]
    return [h for h in rooted if h.persistent] or rooted


def _my_view(handlers: Sequence[CheckpointTierHandler]) -> dict:
    deciders = _deciders(handlers)
    view: dict = {"records": {}, "error": None, "left_alone": []}
    for h in handlers:
        if h.run_root is None:
            continue
        record = paths.read_run_file(h.run_root)
        found = _sealed(h)
        if h in deciders:
            view["records"][h.tier.value] = record
            if record is None and found and view["error"] is None:
                view["error"] = _unowned_error(h, found)
        else:
            view["left_alone"] += [(h.tier.value.upper(), str(h.run_root), p, rid) for p, rid in found]
    return view


def decide(handlers: Sequence[CheckpointTierHandler]) -> Optional[str]:
    """Collective: the run family this launch continues, or None for a new run.

    Args:
        handlers: the tiers of the run (their ``persistent``, ``run_root`` and ``candidates``).

    Raises:
        CheckpointFamilyError: on every rank, when a deciding directory holds checkpoints without a record.
    """
    views = _dist.all_gather_object(_my_view(handlers))
    error = next((v["error"] for v in views if v["error"]), None)
    if error:
        raise CheckpointFamilyError(error)
    deciders = _deciders(handlers)
    if any(h.persistent for h in deciders):
        # rank 0 sees the shared persistent directory; the first persistent tier decides
        record = views[0]["records"].get(deciders[0].tier.value)
    else:
        seen = [r for v in views for r in v["records"].values() if r]
        record = max(seen, key=lambda info: float(info.get("written_unix", 0.0))) if seen else None
    family = record["run_id"] if record else None
    if family is None and _dist.rank() == 0:
        _report_left_alone(deciders, sorted({x for v in views for x in v["left_alone"]}))
    return family


def _report_left_alone(deciders: Sequence[CheckpointTierHandler], others: list) -> None:
    """One warning per tier naming the checkpoints of an earlier run that this new run leaves alone."""
    where = ", ".join(str(h.run_root) for h in deciders)
    for tier in sorted({t for t, *_ in others}):
        mine = [(root, p, rid) for t, root, p, rid in others if t == tier]
        ids = sorted({rid or "unknown" for _, _, rid in mine})
        log.warning(
            "resume: %s has no record of a run, so this is a new run; the %d %s checkpoint(s) in %s "
            "belong to run(s) %s and are left alone (never resumed, retained or deleted), e.g. %s",
            where, len(mine), tier, mine[0][0], ", ".join(ids), mine[0][1],
        )


_EVIDENCE_PREFIXES = ("iter_", paths.RUN_FILE, "latest_")


def _evidence_in(root) -> list[str]:
    """This rank's view of what an earlier run left in ``root`` (and in its LOCAL rank folders)."""
    if root is None or not root.is_dir():
        return []
    found = []
    for p in sorted(root.iterdir()):
        entries = sorted(p.iterdir()) if p.is_dir() and p.name.isdigit() else [p]  # LOCAL rank folders
        found += [str(e) for e in entries if e.name.startswith(_EVIDENCE_PREFIXES)]
    return found


def evidence(handlers: Sequence[CheckpointTierHandler]) -> list[str]:
    """Collective: every path any rank finds of an earlier run in the directories that decide the
    run family (rule 4): run file, trackers, checkpoints in any state. Empty when there is none.

    Returns:
        Sorted paths (at most 20 per rank), the same list on every rank.
    """
    mine = [f for h in _deciders(handlers) for f in _evidence_in(h.run_root)]
    return sorted({f for view in _dist.all_gather_object(mine[:20]) for f in view})


class CheckpointUnavailableError(BadInputError, CheckpointLoadError):
    """No checkpoint can be resumed the way the run is configured (every candidate invalid or
    missing on some rank, ``ckpt_step`` naming no valid checkpoint, ``exit_on_missing_checkpoint``
    with nothing found). Decided from the collective resume selection, so every rank raises it
    alike: the run stops with one message naming what to restore or which setting to change, and
    exit status 2, before any work."""


def check_fresh_start(cfg, chosen, handlers: Sequence[CheckpointTierHandler], family: Optional[str] = None) -> bool:
    """Before a fresh start, on every rank alike (``chosen``, the collective resume selection, is
    the same everywhere): refuse it when it would drop a run's history or ignore a setting.

    Args:
        cfg: the run's ``CheckpointConfig``.
        chosen: the :class:`~tierstack.checkpointing.selection.Selection` that found nothing to
            resume (its ``quarantined`` and ``missing`` say why).
        handlers: the run's tiers.
        family: the run id the launch continues (:func:`decide`), None for a new run.

    Returns:
        True when an earlier run is recorded here but left nothing of its history (only its
        ``run.json``, leftovers, files of an interrupted first save: it failed before its first
        checkpoint): the fresh start continues that run's id, so a restart of the same job is one
        run. False otherwise (a new run id).

    Raises:
        CheckpointUnavailableError: candidates were quarantined or missing on some rank (unless
            ``checkpoint.allow_fresh_start_on_invalid``), ``checkpoint.ckpt_step`` names no valid
            checkpoint, ``checkpoint.exit_on_missing_checkpoint`` with nothing found, or an earlier
            run left history (trackers, checkpoints in any state) in a deciding directory (rule 4).
    """
    lost = [m for m in chosen.missing if ": interrupted save" not in m]
    if (chosen.quarantined or lost) and not cfg.allow_fresh_start_on_invalid:
        # files quarantined by an earlier launch are part of the story (a step now "missing" on a
        # rank may be one of them)
        kept = [f for f in evidence(handlers) if ".invalid-" in f]
        found = "; ".join(chosen.quarantined + chosen.missing
                          + ([f"found quarantined {', '.join(kept[:8])}"] if kept else []))
        raise CheckpointUnavailableError(
            f"checkpoints exist but none can be resumed on every rank ({found}; invalid ones quarantined as "
            "*.invalid-<reason>, missing ones left alone); restore them (or a GLOBAL checkpoint), "
            + ("" if cfg.replication_factor > 1 else "enable checkpoint.replication_factor for next time, ")
            + "or set checkpoint.allow_fresh_start_on_invalid=true"
        )
    if cfg.ckpt_step is not None:
        raise CheckpointUnavailableError(
            f"checkpoint.ckpt_step={cfg.ckpt_step}: no valid checkpoint of that step in any tier")
    found = [] if cfg.allow_fresh_start_on_invalid else evidence(handlers)
    history = [f for f in found if not _not_history(f, chosen)]
    if found and not history:
        # Nothing of it in the deciding directories: nor anywhere else? (a LOCAL tier beside the
        # GLOBAL directory, replicas, checkpoints selection skipped for a changed topology)
        history = [f for f in _files_of(family, handlers) if not _not_history(f, chosen)]
        history += [s for s in chosen.skipped  # (a memory step had no files: never history on disk)
                    if not s.endswith(": other-run") and selection.MEMORY_STEP not in s]
    if found and not history and _dist.rank() == 0:
        log.warning("resume: the earlier run recorded here never completed a checkpoint (found only %s): a fresh "
                    "start loses nothing of it; starting fresh", "; ".join(found[:8]))
    if history:  # an earlier run of the deciding directories, and nothing of it to resume from
        shown = "; ".join(history[:8]) + (f"; and {len(history) - 8} more" if len(history) > 8 else "")
        raise CheckpointUnavailableError(
            f"an earlier run left files here but no valid checkpoint to resume from (found {shown}); "
            "starting fresh would silently drop its history. Fix or restore its checkpoints, point "
            "checkpoint.save/load/local_dir elsewhere, or set checkpoint.allow_fresh_start_on_invalid=true"
        )
    if cfg.exit_on_missing_checkpoint:
        raise CheckpointUnavailableError("checkpoint.exit_on_missing_checkpoint=true but no checkpoint was found")
    return bool(found)


def _files_of(family: Optional[str], handlers: Sequence[CheckpointTierHandler]) -> list[str]:
    """Collective: the checkpoint files and directories of run ``family`` (or of no recorded run)
    that any rank sees in any tier's root, deciding or not, its replicas included. Another run's
    files (rule 1: left alone) are not listed.

    Returns:
        Sorted paths (at most 20 per rank), the same list on every rank.
    """
    mine = []
    for h in handlers:
        root = h.run_root
        if root is None or not root.is_dir():
            continue
        entries = _evidence_in(root)
        replicas = root / REPLICAS_DIR
        if replicas.is_dir():
            for folder in sorted(p for p in replicas.iterdir() if p.is_dir()):
                entries += [str(e) for e in sorted(folder.iterdir()) if e.name.startswith("iter_")]
        mine += [f for f in entries if _recorded_run(Path(f)) in (family, None)]
    return sorted({f for view in _dist.all_gather_object(mine[:20]) for f in view})


def _recorded_run(path: Path) -> Optional[str]:
    """The run id the manifest of a GLOBAL step directory or LOCAL file records; None without one."""
    parsed = paths.parse_local_name(path.name)
    man = (paths.read_json(path.with_name(paths.local_manifest_name(*parsed)))
           if parsed else paths.read_json(path / paths.MANIFEST) if path.is_dir() else None)
    return None if man is None else man.get("run_id")


def _not_history(path: str, chosen) -> bool:
    """Whether ``path`` (an entry of :func:`evidence`) is no part of a run's history: its run record
    (written at its start, before any checkpoint), a leftover of an interrupted save or deletion, or
    a LOCAL file of a step that selection found to be an interrupted save (never sealed on every
    rank). A run that left only these never completed a checkpoint: a restart after a failure
    before its first save starts fresh instead of stopping (trackers, sealed and quarantined
    checkpoints are history)."""
    name = Path(path).name
    if name == paths.RUN_FILE or paths.is_leftover(name):
        return True
    parsed = paths.parse_local_name(name)
    return parsed is not None and (CheckpointTier.LOCAL, parsed[0]) in chosen.interrupted
