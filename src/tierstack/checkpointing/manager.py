"""``CheckpointManager``: the one object the training loop talks to about checkpoints."""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, Sequence

from tierstack.checkpointing import paths, preflight, selection
from tierstack.runtime import collectives as _dist
from tierstack.checkpointing.global_tier import CheckpointLoadError, GlobalTier
from tierstack.checkpointing.local_tier import LocalTier
from tierstack.checkpointing.types import CheckpointTier, ResumeInfo, SaveEvent, TrainingObjects
from tierstack.config import ConfigContainer
from tierstack.runtime import ParallelLayout

log = logging.getLogger(__name__)


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank and ``checkpoint.exit_on_save_failure`` is set."""


class CheckpointManager:
    """Both tiers behind one interface. Every public method is collective (call it on all ranks).

    Args:
        cfg: the run config (``checkpoint`` section decides what is saved where and when).
        layout: this rank's parallel layout (LOCAL checkpoints record and require it).
        listeners: called on every rank after each *published* GLOBAL save (never for LOCAL).
    """

    def __init__(self, cfg: ConfigContainer, layout: ParallelLayout,
                 listeners: Sequence[Callable[[SaveEvent], None]] = ()):
        self.cfg = cfg
        self.layout = layout
        self._listeners = list(listeners)
        self._tiers = {
            CheckpointTier.LOCAL: LocalTier(cfg, layout),
            CheckpointTier.GLOBAL: GlobalTier(cfg, layout, self._notify),
        }
        self._intervals = {
            CheckpointTier.LOCAL: cfg.checkpoint.local_save_interval,
            CheckpointTier.GLOBAL: cfg.checkpoint.save_interval,
        }
        self._last_saved: dict[CheckpointTier, Optional[int]] = {t: None for t in CheckpointTier}
        self._preflight: tuple[Optional[int], bool] = (None, False)
        self._closed = False
        self.events: list[SaveEvent] = []  # published GLOBAL saves of this process (for tests/benchmarks)

    def _notify(self, event: SaveEvent) -> None:
        self.events.append(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a tracker hiccup must not fail a published save
                log.exception("checkpoint listener %r failed", listener)

    # ------------------------------------------------------------------ resume
    def resume(self, objs: TrainingObjects) -> Optional[ResumeInfo]:
        """Collective: restore ``objs`` from the newest valid checkpoint of either tier.

        Returns:
            What was loaded, or None for a fresh start (``objs.train_state.run_id`` is then a new
            id agreed by all ranks).

        Raises:
            CheckpointLoadError: checkpoints exist but none is valid (unless
                ``checkpoint.allow_fresh_start_on_invalid``), ``ckpt_step`` names no valid
                checkpoint, ``exit_on_missing_checkpoint`` finds nothing, or the chosen checkpoint
                cannot be loaded exactly at this topology.
        """
        c = self.cfg.checkpoint
        t0 = time.perf_counter()
        g, loc = self._tiers[CheckpointTier.GLOBAL], self._tiers[CheckpointTier.LOCAL]
        family = selection.agree_family([g.load_root, loc.root])
        chosen = selection.select(list(self._tiers.values()), family=family, ckpt_step=c.ckpt_step)
        if chosen.handler is None:
            return self._fresh_start(objs, chosen)
        path = chosen.handler.load(chosen.step, objs)
        objs.train_state.resumed_from = list(objs.train_state.resumed_from) + [chosen.step]
        info = ResumeInfo(chosen.handler.tier, chosen.step, path, time.perf_counter() - t0)
        self._last_saved[chosen.handler.tier] = chosen.step
        if _dist.rank() == 0:
            log.info("resumed from %s checkpoint of step %d at %s in %.2fs (run %s)",
                     info.tier.value, info.step, path, info.seconds, objs.train_state.run_id)
        return info

    def _fresh_start(self, objs: TrainingObjects, chosen: selection.Selection) -> None:
        c = self.cfg.checkpoint
        if chosen.quarantined and not c.allow_fresh_start_on_invalid:
            raise CheckpointLoadError(
                "checkpoints exist but none is valid (" + "; ".join(chosen.quarantined) + "; quarantined as "
                "*.invalid-<reason>); fix them or set checkpoint.allow_fresh_start_on_invalid=true"
            )
        if c.ckpt_step is not None:
            raise CheckpointLoadError(f"checkpoint.ckpt_step={c.ckpt_step}: no valid checkpoint of that step in either tier")
        if c.exit_on_missing_checkpoint:
            raise CheckpointLoadError("checkpoint.exit_on_missing_checkpoint=true but no checkpoint was found")
        run_id = _dist.broadcast_object(uuid.uuid4().hex[:12])
        objs.train_state.run_id = run_id
        # Claim the tier roots for this run now, so a crash before the first GLOBAL save still
        # leaves LOCAL checkpoints of a recognisable family.
        g, loc = self._tiers[CheckpointTier.GLOBAL], self._tiers[CheckpointTier.LOCAL]
        if g.save_root is not None and _dist.rank() == 0:
            paths.write_run_file(g.save_root, run_id)
        if loc.root is not None and self.layout.local_rank == 0:
            paths.write_run_file(loc.root, run_id)
        _dist.barrier()
        if c.pretrained_checkpoint:
            self._load_pretrained(objs, Path(c.pretrained_checkpoint))
        if _dist.rank() == 0:
            log.info("no checkpoint to resume from: fresh start, run %s", run_id)
        return None

    def _load_pretrained(self, objs: TrainingObjects, path: Path) -> None:
        """Model weights only (fine-tuning): a step directory, or a GLOBAL root with a tracker."""
        root, step = path.parent, paths.parse_step_dir(path.name)
        if step is None:
            root = path
            step = int((path / paths.TRACKER_ITERATION).read_text().strip())
        tier = GlobalTier(self.cfg, self.layout, lambda e: None)
        tier.load_root = root
        tier.load(step, objs, model_only=True)
        if _dist.rank() == 0:
            log.info("loaded pretrained weights of step %d from %s", step, root)

    # ------------------------------------------------------------------ save
    def maybe_save(self, objs: TrainingObjects) -> None:
        """Collective, after every optimizer step: seal/publish the background saves that ended on
        every rank, then save each tier whose interval divides the step."""
        for handler in self._tiers.values():
            handler.finalize(blocking=False)
        self._raise_if_failed()
        step = objs.train_state.step
        for tier in (CheckpointTier.LOCAL, CheckpointTier.GLOBAL):  # LOCAL first: it is the fast one
            interval = self._intervals[tier]
            if interval and step > 0 and step % interval == 0:
                self.save(tier, objs)

    def save(self, tier: CheckpointTier, objs: TrainingObjects) -> None:
        """Collective: save ``tier`` now (end of training, planned exits). Once per step and tier."""
        handler = self._tiers[tier]
        step = objs.train_state.step
        if self._closed or not handler.enabled or self._last_saved[tier] == step:
            return
        if tier is CheckpointTier.GLOBAL and handler.save_root is None:
            return
        if tier is CheckpointTier.LOCAL and handler.root is None:
            return
        if self._preflight[0] != step:
            self._preflight = (step, preflight.all_finite(objs.model))
        if not self._preflight[1]:
            handler.failures.append(step)
            log.error("%s checkpoint of step %d skipped: non-finite values", tier.value, step)
            self._raise_if_failed()
            return
        handler.save(objs, run_id=objs.train_state.run_id)
        self._last_saved[tier] = step
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        failed = {t.value: list(h.failures) for t, h in self._tiers.items() if h.failures}
        if failed and self.cfg.checkpoint.exit_on_save_failure:
            raise CheckpointSaveError(f"checkpoint save failed {failed}; checkpoint.exit_on_save_failure=true")

    def last_saved_step(self, tier: CheckpointTier) -> Optional[int]:
        """Step of the last save of ``tier`` started (or loaded) by this process, None if none."""
        return self._last_saved[tier]

    def saved_steps(self, tier: CheckpointTier) -> list[int]:
        """Steps this process saved in ``tier`` that are published (GLOBAL) or sealed on every rank (LOCAL)."""
        if tier is CheckpointTier.LOCAL:
            return list(self._tiers[CheckpointTier.LOCAL].sealed)
        return [e.step for e in self.events]

    def staging_bytes(self, tier: CheckpointTier) -> int:
        """Bytes of host staging memory ``tier`` holds on this rank (kept between saves)."""
        return int(getattr(self._tiers[tier], "staging_bytes", 0))

    def in_flight(self, tier: CheckpointTier) -> int:
        """Saves of ``tier`` handed to the background writer and not yet sealed/published (0 or 1)."""
        return int(self._tiers[tier].in_flight)

    def wait(self) -> None:
        """Collective: block until every in-flight save of both tiers is sealed/published (or failed)."""
        for handler in self._tiers.values():
            handler.finalize(blocking=True)
        self._raise_if_failed()

    def close(self) -> None:
        """Collective: publish every in-flight async save, then stop the async writer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._tiers[CheckpointTier.LOCAL].close()
        finally:
            self._tiers[CheckpointTier.GLOBAL].close()
        self._raise_if_failed()
