"""Resume: which checkpoint every rank loads (family, rewind, selection), the load itself, what
the load leaves out or finds stale (said once, on rank 0), or a fresh start.

The policy of each step lives in its own module (:mod:`~tierstack.checkpointing.family`,
:mod:`~tierstack.checkpointing.rewind`, :mod:`~tierstack.checkpointing.selection`,
:mod:`~tierstack.checkpointing.compat`); this is their order.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from tierstack.checkpointing import best, compat, local_memory, paths, rewind, selection
from tierstack.checkpointing import family as run_family
from tierstack.checkpointing.global_reader import GlobalReader
from tierstack.checkpointing.types import CheckpointTierHandler, ResumeInfo, TrainingObjects
from tierstack.config import CheckpointConfig
from tierstack.runtime import ParallelLayout
from tierstack.runtime import collectives as _dist

log = logging.getLogger(__name__)


def resume(cfg: CheckpointConfig, layout: ParallelLayout, handlers: Sequence[CheckpointTierHandler],
           objs: TrainingObjects, *, run_config: Mapping[str, Any],
           pretrained_source: Optional[Callable[[Path], Path]] = None) -> Optional[ResumeInfo]:
    """Collective: :meth:`CheckpointManager.resume <tierstack.checkpointing.manager.CheckpointManager.resume>`
    (its docstring lists what it raises)."""
    t0 = time.perf_counter()
    family = run_family.decide(handlers)
    if family is None:  # a new run: nothing in any tier is ours
        return _fresh_start(cfg, layout, handlers, objs, selection.Selection(), None, run_config, pretrained_source)
    for handler in handlers:  # a fresh selection on every start: nothing cached from a previous attempt
        handler.prepare_resume(family)
    ckpt_step = rewind.effective_step(handlers, cfg.ckpt_step, family)  # None once an earlier launch rewound
    chosen = selection.select(handlers, family=family, ckpt_step=ckpt_step, io_wait_s=cfg.async_write_timeout_s)
    if chosen.handler is None:
        return _fresh_start(cfg, layout, handlers, objs, chosen, family, run_config, pretrained_source)
    if ckpt_step is not None:  # a rewind: the abandoned timeline must not win the next launch
        rewind.move_aside_newer(handlers, family, chosen.step)
    local_memory.forget_newer(chosen.step)  # a step held in memory past it belongs to the timeline left
    tier = chosen.handler.tier.value.upper()
    compat.check(chosen.manifest, run_config, f"{tier} step {chosen.step} ({chosen.handler.run_root})")
    path = chosen.handler.load(chosen.step, objs)
    objs.train_state.resumed_from = list(objs.train_state.resumed_from) + [chosen.step]
    info = ResumeInfo(chosen.handler.tier, chosen.step, path, time.perf_counter() - t0)
    if not cfg.load_optim and _dist.rank() == 0:
        log.warning("checkpoint.load_optim=false: the optimizer state of %s step %d (its moments, step counts and "
                    "fp32 main parameters) was NOT loaded; the optimizer starts fresh from the loaded weights "
                    "(model, LR schedule, counters and RNG are the checkpoint's)", tier, chosen.step)
    repair_best_records(cfg, objs)
    if _dist.rank() == 0:
        log.info("resumed from %s checkpoint of step %d at %s in %.2fs (run %s)",
                 info.tier.value, info.step, path, info.seconds, objs.train_state.run_id)
    return info


def repair_best_records(cfg: CheckpointConfig, objs: TrainingObjects) -> list[list]:
    """Collective: drop the top-K best records (``TrainState.best_checkpoints``) whose GLOBAL
    checkpoint no longer exists in ``checkpoint.save`` (deleted by hand, lost with a volume), said
    once on rank 0 naming each step and record, and point the ``best`` tracker at the best record
    left (removed when none is left); a tracker naming a step that does not exist (moved aside by
    a rewind) is repaired the same way. Rank 0 decides; every rank takes the same records.

    Returns:
        The dropped records, ``[[step, value], ...]`` (the same on every rank).
    """
    ts = objs.train_state
    if not cfg.save or (cfg.load and Path(cfg.load) != Path(cfg.save)):
        return []  # the records name the save root's checkpoints (resumed from another root: not checked)
    root = Path(cfg.save)
    dropped = None
    if _dist.rank() == 0:
        dropped = [list(r) for r in ts.best_checkpoints if not (root / paths.step_dir_name(int(r[0]))).is_dir()]
    dropped = _dist.broadcast_object(dropped)
    ts.best_checkpoints = [list(r) for r in ts.best_checkpoints if list(r) not in dropped]
    if _dist.rank() == 0:
        for step, value in dropped:
            log.warning("resume: best record step %d (%s %g) names %s, which does not exist: record dropped",
                        step, cfg.best_metric, value, root / paths.step_dir_name(int(step)))
        _repair_best_tracker(root, ts.best_checkpoints, force=bool(dropped))
    return dropped


def _repair_best_tracker(root: Path, records: list, force: bool) -> None:
    """Rank 0: the ``best`` tracker names the best of ``records`` (none: removed), when ``force``
    or when the step it names has no directory."""
    tracker = root / best.TRACKER_BEST
    try:
        named = int(tracker.read_text().strip()) if tracker.exists() else None
    except (OSError, ValueError):
        named = -1  # unreadable: rewritten
    stale = named is not None and not (root / paths.step_dir_name(named)).is_dir()
    if not (force or stale):
        return
    if stale:
        log.warning("resume: %s names step %s, which does not exist", tracker, named)
    if records:
        paths.atomic_write_text(tracker, f"{int(records[0][0])}\n")
    elif tracker.exists():
        tracker.unlink()
    log.warning("resume: %s now names %s", tracker.name, f"step {int(records[0][0])}" if records else
                "nothing (removed)")


def _fresh_start(cfg: CheckpointConfig, layout: ParallelLayout, handlers: Sequence[CheckpointTierHandler],
                 objs: TrainingObjects, chosen: selection.Selection, family: Optional[str],
                 run_config: Mapping[str, Any], pretrained_source: Optional[Callable[[Path], Path]]) -> None:
    same_run = run_family.check_fresh_start(cfg, chosen, list(handlers), family)
    local_memory.forget()  # nothing held in this process is part of the new start
    run_id = family if same_run and family else _dist.broadcast_object(uuid.uuid4().hex[:12])
    objs.train_state.run_id = run_id
    if cfg.pretrained_checkpoint:  # before the claim: a refused start leaves no run.json behind
        path = best.resolve_pretrained(cfg.pretrained_checkpoint)  # `<root>:best`: the best tracker's step
        if pretrained_source is not None:
            path = pretrained_source(path)
        GlobalReader(cfg, layout).load_pretrained(path, objs, run_config=run_config)
    # Claim the tier roots for this run now, before any save, so a crash before the first GLOBAL
    # save still leaves LOCAL checkpoints of a recognisable family.
    for handler in handlers:
        handler.claim(run_id)
    _dist.barrier()
    if _dist.rank() == 0:
        log.info("no checkpoint to resume from: fresh start, run %s", run_id)
    return None
