"""Rewinds: ``checkpoint.ckpt_step=N`` resumes from step N and starts a new timeline from there.

Selection sorts by step, so the checkpoints of the abandoned timeline (newer than N) would win the
next launch without ``ckpt_step`` and undo the rewind. So once the ranks resumed at N, every tier
moves its checkpoints of this run newer than N aside (renamed ``<name>.rewound-to-N``:
never a candidate again, never deleted by tierstack; ``tierstack checkpoints ls`` lists them as
"rewound"), and rank 0 names them in the log.

The rewind is recorded (``rewind.json`` in each tier root rank 0 can write), so a relaunch that
keeps ``ckpt_step=N`` in its command line (a requeued job) continues the new timeline instead of
rewinding it again; a different ``ckpt_step`` is a new rewind. To rewind to the same step twice,
remove that file.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional, Sequence

from tierstack.checkpointing import paths
from tierstack.checkpointing.types import Candidate, CheckpointTierHandler
from tierstack.runtime import collectives

log = logging.getLogger(__name__)

RECORD = "rewind.json"


def _roots(handlers: Sequence[CheckpointTierHandler]) -> list[Path]:
    return [Path(h.run_root) for h in handlers if h.enabled and h.run_root is not None]


def effective_step(handlers: Sequence[CheckpointTierHandler], ckpt_step: Optional[int],
                   run_id: Optional[str] = None) -> Optional[int]:
    """Collective: the step resume selection must pick: ``ckpt_step``, or None (the newest) when an
    earlier launch already rewound run ``run_id`` to ``ckpt_step`` (its record says so)."""
    if ckpt_step is None:
        return None
    applied = None
    if collectives.rank() == 0:
        for root in _roots(handlers):
            record = paths.read_json(root / RECORD) or {}
            if record.get("ckpt_step") == ckpt_step and record.get("run_id") in (None, run_id):
                applied = str(root / RECORD)
                break
    applied = collectives.broadcast_object(applied)
    if applied is None:
        return ckpt_step
    if collectives.rank() == 0:
        log.warning("checkpoint.ckpt_step=%d: this run was rewound to step %d by an earlier launch (%s); resuming "
                    "the newest checkpoint of its new timeline. To rewind to step %d again, remove that file",
                    ckpt_step, ckpt_step, applied, ckpt_step)
    return None


def move_aside_newer(handlers: Sequence[CheckpointTierHandler], run_id: str, step: int) -> list[str]:
    """Collective, after every rank resumed at ``step`` by ``ckpt_step``: each tier moves its
    checkpoints of ``run_id`` newer than ``step`` aside (:meth:`CheckpointTierHandler.rewind`), rank 0
    logs which and records the rewind (see the module docstring).

    Returns:
        ``"<TIER> step <n>"`` for every step moved aside on some rank (the same list on every rank).
    """
    owned = [h for h in handlers if h.enabled]
    mine = {h.tier.value.upper(): h.rewind(step, run_id) for h in owned}
    owned = [h for h in owned if mine[h.tier.value.upper()] is not None]  # the others read another run's root
    moved: dict[str, set] = {}
    for theirs in collectives.all_gather_object(mine):
        for tier, steps in theirs.items():
            moved.setdefault(tier, set()).update(steps or [])
    named = [f"{tier} step {s}" for tier, steps in moved.items() for s in sorted(steps)]
    if collectives.rank() == 0:
        if named:
            log.warning("checkpoint.ckpt_step=%d: rewound; the checkpoints of the abandoned timeline are moved aside "
                        "(renamed *.rewound-to-%d, never resumed): %s", step, step, ", ".join(named))
        for root in _roots(owned):
            if root.is_dir():
                paths.atomic_write_json(root / RECORD, {"ckpt_step": step, "run_id": run_id, "moved_aside": named,
                                                        "written_unix": time.time()})
    collectives.barrier()
    return named


def _newer(candidates: Sequence[Candidate], step: int) -> list[int]:
    return sorted(c.step for c in candidates if c.step > step and not c.foreign)


def move_aside_global(root: Path, candidates: Sequence[Candidate], step: int) -> list[int]:
    """Rank 0 renames the published step directories of ``candidates`` newer than ``step`` (one
    shared directory); every rank returns those steps."""
    newer = _newer(candidates, step)
    if collectives.rank() == 0:
        for s in newer:
            paths.quarantine(Path(root) / paths.step_dir_name(s), f"to-{step}", kind="rewound")
    return newer


def move_aside_local(rank_dir: Path, candidates: Sequence[Candidate], step: int, run_id: str,
                     replication=None) -> list[int]:
    """This rank's LOCAL files (and manifests) of ``candidates`` newer than ``step`` are renamed,
    and so are the replicas of ``run_id``'s newer steps it keeps for other ranks (``replication``:
    the tier's ``LocalReplication`` or None): a later launch would otherwise retrieve them for a
    rank that misses its file, and resume the abandoned timeline. Returns this rank's own steps."""
    newer = _newer(candidates, step)
    own = [(s, Path(rank_dir) / paths.local_file_name(s, r), Path(rank_dir) / paths.local_manifest_name(s, r))
           for s, r in ((s, _rank_of(rank_dir)) for s in newer)]
    for folder, owner in _replica_folders(replication):
        for p in sorted(folder.glob("iter_*_local.manifest.json")):
            parsed = paths.parse_local_name(p.name)
            if parsed and parsed[0] > step and (paths.read_json(p) or {}).get("run_id") == run_id:
                own.append((parsed[0], folder / paths.local_file_name(parsed[0], owner), p))
    for _, *files in own:
        for f in files:
            if f.exists():
                paths.quarantine(f, f"to-{step}", kind="rewound")
    return newer


def _rank_of(rank_dir: Path) -> int:
    return int(Path(rank_dir).name)


def _replica_folders(replication) -> list[tuple[Path, int]]:
    if replication is None:
        return []
    store = replication.store
    return [(store.folder(o), o) for o in replication.replicator.clique if o != store.rank and store.folder(o).is_dir()]
