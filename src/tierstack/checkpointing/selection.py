"""Resume selection: which checkpoint, of which tier, every rank loads.

All ranks list the candidates of every tier, the newest step that is valid on every rank wins, and
a tie goes to the tier listed first (the manager lists the fastest first: LOCAL wins a tie with
GLOBAL because it loads faster, node-local disk and no resharding). A candidate
that fails its checks is quarantined and the next is tried; a LOCAL checkpoint written at another
topology is skipped (it is not broken, just not loadable here); another run's checkpoints are
reported and left alone. Which run is "this run" is decided before, by
:mod:`tierstack.checkpointing.family`.

A step that some rank does not hold at all (its node was replaced, its write never finished) is
skipped, never quarantined: the ranks that hold it keep their good files, and the ranks that miss
it are named (``Selection.missing``). When such a rank left a ``.dirty`` file of the step, the
save was interrupted before it was sealed: the other ranks' files of it are leftovers that the next
save of the tier removes (the rule of ``checkpoints verify``). Quarantine is for what fails its own checks: a tier whose
files are per rank (LOCAL, ``per_rank_files``) renames only the files of the ranks whose own check
failed; a shared checkpoint (GLOBAL) is invalid as a whole.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

from tierstack.runtime import collectives as _dist
from tierstack.checkpointing.types import Candidate, CheckpointTier, CheckpointTierHandler

log = logging.getLogger(__name__)

_SKIP_NOT_INVALID = ("topology-changed", "other-run", "no-manifest")
MISSING = "missing-on-rank"
MEMORY_STEP = "a memory step, not held by"  # in ``Selection.skipped``: held in host memory by some ranks only


@dataclass
class Selection:
    handler: Optional[CheckpointTierHandler] = None
    step: Optional[int] = None
    quarantined: list[str] = field(default_factory=list)  # "<tier> step <n>: <reason>"
    skipped: list[str] = field(default_factory=list)
    # "<tier> step <n>: missing on rank(s) [..]" for steps skipped because some rank holds nothing
    missing: list[str] = field(default_factory=list)
    # (tier, step) of the missing steps that were interrupted saves (a rank left a ``.dirty`` file):
    # never sealed on every rank, so never a checkpoint of the run's history
    interrupted: list[tuple[CheckpointTier, int]] = field(default_factory=list)
    manifest: Optional[dict] = None  # the chosen checkpoint's manifest on this rank (compared before load)


def _log_skip(tier: CheckpointTier, step: int, skip: str, cand: Optional[Candidate], family: Optional[str]) -> None:
    if skip == "other-run" and cand is not None:
        theirs = (cand.manifest or {}).get("run_id")
        log.warning("resume: %s checkpoint %s belongs to run %s, not this run (%s): never resumed, retained or "
                    "deleted", tier.value.upper(), cand.path, theirs, family)
    else:
        log.info("resume: skipping %s checkpoint of step %d (%s)", tier.value, step, skip)


def _skip_absent(result: Selection, handler: CheckpointTierHandler, step: int, absent: list[int],
                 interrupted: list[int]) -> None:
    """A step some ranks do not hold is skipped, never quarantined. When one of them left a
    ``.dirty`` file of it, the save was interrupted before it was sealed: the files the other ranks
    hold are leftovers, which the next save of the tier removes (``checkpoints verify`` lists such a
    step as a leftover too). Otherwise the files were lost (a replaced node): the other ranks keep
    theirs, so that restoring the missing ones makes the step resumable again."""
    tier = handler.tier.value
    if interrupted:
        result.missing.append(f"{tier} step {step}: interrupted save (rank(s) {interrupted} left it unfinished)")
        result.interrupted.append((handler.tier, step))
        handler.abandon(step)
    else:
        result.missing.append(f"{tier} step {step}: missing on rank(s) {absent}")
    if _dist.rank() == 0:
        log.warning("resume: %s checkpoint of step %d is missing on rank(s) %s: skipped (%s)", tier.upper(), step,
                    absent, "an interrupted save: the next save removes its files" if interrupted
                    else "the files of the other ranks are left as they are")


def _skip_memory_step(result: Selection, tier: CheckpointTier, step: int, absent: list[int]) -> None:
    """A memory step (:mod:`~tierstack.checkpointing.local_memory`) that some ranks do not hold:
    their processes are new (a spare, a restart). Skipped, and not a lost checkpoint: it never had
    files, so it does not stand in the way of a fresh start either."""
    result.skipped.append(f"{tier.value} step {step}: {MEMORY_STEP} rank(s) {absent}")
    if _dist.rank() == 0:
        log.info("resume: %s memory step %d skipped: rank(s) %s do not hold it (new processes); it has no files",
                 tier.value.upper(), step, absent)


def _order(keys, tiers: Sequence[CheckpointTier]) -> list[tuple[CheckpointTier, int]]:
    """Newest step first; at equal steps in the order of ``tiers`` (fastest first)."""
    return sorted(keys, key=lambda k: (-k[1], tiers.index(k[0])))


def select(handlers: Sequence[CheckpointTierHandler], *, family: Optional[str],
           ckpt_step: Optional[int] = None, io_wait_s: Optional[float] = None) -> Selection:
    """Collective: the agreed (handler, step), or an empty :class:`Selection` when nothing is valid.

    ``io_wait_s``: how much longer than a collective's bound the ranks wait for each other while
    they read and checksum a candidate's files (``checkpoint.async_write_timeout_s``; see
    :func:`tierstack.runtime.collectives.io_phase`)."""
    by_tier = {h.tier: h for h in handlers if h.enabled}
    views: dict[tuple[CheckpointTier, int], Candidate] = {}
    for h in by_tier.values():
        for cand in h.candidates(family):
            views[(h.tier, cand.step)] = cand
    gathered = _dist.all_gather_object(({k: v.problem for k, v in views.items()},
                                        {h.tier: h.interrupted_steps() for h in by_tier.values()},
                                        {k for k, v in views.items() if v.extra.get("in_memory")}))
    summaries = [g[0] for g in gathered]
    dirty = [g[1] for g in gathered]  # per rank: tier -> steps it left a .dirty file of
    in_memory = [g[2] for g in gathered]  # per rank: the (tier, step) it holds in host memory only
    keys = set().union(*(s.keys() for s in summaries))
    if ckpt_step is not None:
        keys = {k for k in keys if k[1] == ckpt_step}
    result = Selection()
    for key in _order(keys, [h.tier for h in handlers]):
        tier, step = key
        problems = [s.get(key, MISSING) for s in summaries]
        skip = next((p for p in problems if p in _SKIP_NOT_INVALID), None)
        if skip is not None:
            result.skipped.append(f"{tier.value} step {step}: {skip}")
            if _dist.rank() == 0:
                _log_skip(tier, step, skip, views.get(key), family)
            continue
        absent = [r for r, p in enumerate(problems) if p == MISSING]
        if absent and all(key in in_memory[r] for r in range(len(problems)) if r not in absent):
            _skip_memory_step(result, tier, step, absent)  # no checkpoint was lost: it had no files
            continue
        if absent:  # not invalid: some rank holds nothing of it
            _skip_absent(result, by_tier[tier], step, absent, [r for r in absent if step in dirty[r].get(tier, [])])
            continue
        cand = views[key]
        with _dist.io_phase(io_wait_s):  # a whole-file read and checksum per rank, then the agreement
            local = cand.problem if cand.problem is not None else by_tier[tier].verify(cand)
            problems = _dist.all_gather_object(local)
        if all(p is None for p in problems):
            result.handler, result.step, result.manifest = by_tier[tier], step, cand.manifest
            return result
        bad_rank, reason = next((r, p) for r, p in enumerate(problems) if p is not None)
        result.quarantined.append(f"{tier.value} step {step}: {reason} (rank {bad_rank})")
        if _dist.rank() == 0:
            log.warning("resume: %s checkpoint of step %d failed its check on rank %d (%s); quarantined",
                        tier.value, step, bad_rank, reason)
        if not by_tier[tier].per_rank_files:  # shared: invalid as a whole
            by_tier[tier].quarantine(cand, f"{reason.split(' ')[0]}-rank{bad_rank}")
        elif local is not None:  # per rank: only the files that failed their own check
            by_tier[tier].quarantine(cand, f"{local.split(' ')[0]}-rank{_dist.rank()}")
        _dist.barrier()
    return result
