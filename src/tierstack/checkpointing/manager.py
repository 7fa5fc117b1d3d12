"""``CheckpointManager``: the one object the training loop talks to about checkpoints.

The manager holds the policy (when each tier saves, once per step and tier, fast tiers first, the
non-finite guard shared by the tiers of a step, the top-K best records a persistent tier's save
commits, what a failure does, where the last state goes) and no tier-specific code: every tier is a
:class:`~tierstack.checkpointing.types.CheckpointTierHandler`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from tierstack.checkpointing import closing, intervals, resuming
from tierstack.checkpointing.best import BestRecords
from tierstack.checkpointing.nonfinite_guard import NonFiniteGuard
from tierstack.checkpointing.global_tier import GlobalTier
from tierstack.checkpointing.local_tier import LocalTier
from tierstack.checkpointing.types import (
    CheckpointTier,
    CheckpointTierHandler,
    ResumeInfo,
    SaveEvent,
    TrainingObjects,
)
from tierstack.config import CheckpointConfig
from tierstack.errors import raised_on_every_rank
from tierstack.runtime import ParallelLayout
from tierstack.runtime import collectives as _dist

log = logging.getLogger(__name__)


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank and ``checkpoint.exit_on_save_failure`` is set."""

    raised_on_every_rank = True  # from the failure lists every rank holds alike


def build_tiers(
    cfg: CheckpointConfig,
    parallel_layout: ParallelLayout,
    *,
    run_config: Mapping[str, Any],
    on_publish: Callable[[SaveEvent], None],
) -> list[CheckpointTierHandler]:
    """The tiers of a run, fastest first (the order in which a step's saves start)."""
    return [
        LocalTier(cfg, parallel_layout, run_config=run_config),
        GlobalTier(cfg, parallel_layout, run_config=run_config, on_publish=on_publish),
    ]


class CheckpointManager:
    """Every tier behind one interface. Every public method is collective (call it on all ranks).

    Args:
        cfg: the ``checkpoint`` section.
        parallel_layout: this rank's parallel layout.
        run_config: the whole run config as plain dicts: recorded beside GLOBAL checkpoints, its
            tokenizer and config in every manifest, and compared with a checkpoint's record before
            any load (:mod:`~tierstack.checkpointing.compat`).
        listeners: called on every rank after each *published* GLOBAL save (never for LOCAL).
        tiers: the tier handlers, fastest first; default :func:`build_tiers` (tests pass their own).
        pretrained_source: collective, on a fresh start with ``pretrained_checkpoint`` set: maps
            that path to the GLOBAL checkpoint to read the weights from (``training.setup`` passes
            :func:`tierstack.hf.pretrained.pretrained_root`, which imports a Hugging Face
            directory); default: the path itself.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        parallel_layout: ParallelLayout,
        *,
        run_config: Optional[Mapping[str, Any]] = None,
        listeners: Sequence[Callable[[SaveEvent], None]] = (),
        tiers: Optional[Sequence[CheckpointTierHandler]] = None,
        pretrained_source: Optional[Callable[[Path], Path]] = None,
    ):
        self.cfg = cfg
        self._pretrained_source = pretrained_source
        self.layout = parallel_layout
        self.run_config = run_config or {}
        self._listeners = list(listeners)
        if tiers is None:
            tiers = build_tiers(cfg, parallel_layout, run_config=run_config or {}, on_publish=self._notify)
        self._tiers = {t.tier: t for t in tiers}  # insertion order: fastest first
        self._last_saved: dict[CheckpointTier, Optional[int]] = {t: None for t in self._tiers}
        self.guard = NonFiniteGuard(cfg.on_nonfinite)
        self.best = BestRecords(cfg.keep_best_k, cfg.best_metric, cfg.save_on_best)
        self._train_state = None  # the live TrainState: takes the best records of each published save
        self.blocked_steps: list[int] = []  # boundaries the non-finite guard blocked (every tier)
        self._commit_step: Optional[int] = None  # a step whose saves in every tier carry its best candidate
        self._closed = False
        # Tiers whose interval is "auto" (Young/Daly from measured save cost and step time, checkpoint.mtbf_s)
        self._planners = {t: intervals.IntervalPlanner(t.value.upper(), cfg.mtbf_s)
                          for t, h in self._tiers.items() if h.interval == intervals.AUTO}
        self._last_step_end: Optional[float] = None  # perf_counter at the end of the previous maybe_save
        self.events: list[SaveEvent] = []  # published GLOBAL saves of this process (for tests/benchmarks)

    def _notify(self, event: SaveEvent) -> None:
        if event.train_state is not None and self._train_state is not None:
            # Published on every rank: the records it carries are now the committed ones.
            self._train_state.best_checkpoints = [list(r) for r in event.train_state.get("best_checkpoints", [])]
        self.events.append(event)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # noqa: BLE001 - a tracker hiccup must not fail a published save
                log.exception("checkpoint listener %r failed", listener)

    # ------------------------------------------------------------------ resume
    def resume(self, objs: TrainingObjects) -> Optional[ResumeInfo]:
        """Collective: restore ``objs`` from the newest valid checkpoint of any tier.

        Returns:
            What was loaded, or None for a fresh start (``objs.train_state.run_id`` is then a new
            id agreed by all ranks).

        Raises:
            CheckpointFamilyError: a directory that decides the run family holds checkpoints
                without a ``run.json`` (:mod:`~tierstack.checkpointing.family`).
            CheckpointMismatchError: the chosen checkpoint's tokenizer or tensor-shaping model
                fields differ from this run's (:mod:`~tierstack.checkpointing.compat`).
            family.CheckpointUnavailableError: checkpoints exist but none is valid on every rank (unless
                ``checkpoint.allow_fresh_start_on_invalid``), ``ckpt_step`` names no valid
                checkpoint, or ``exit_on_missing_checkpoint`` finds nothing (a
                :class:`~tierstack.errors.BadInputError`: one message, exit status 2).
            CheckpointLoadError: an earlier run left files but no valid checkpoint, or the chosen
                checkpoint cannot be loaded exactly at this topology.
        """
        with self._bounded():
            return self._resume(objs)

    def _bounded(self):
        """Every checkpoint collective waits at most ``checkpoint.collective_timeout_s`` for a peer
        (:func:`tierstack.runtime.collectives.bounded`)."""
        return _dist.bounded(self.cfg.collective_timeout_s)

    def _resume(self, objs: TrainingObjects) -> Optional[ResumeInfo]:
        info = resuming.resume(self.cfg, self.layout, list(self._tiers.values()), objs, run_config=self.run_config,
                               pretrained_source=self._pretrained_source)
        if info is not None:
            self._last_saved[info.tier] = info.step
            for planner in self._planners.values():  # "auto" intervals count from the resumed step
                planner.last_save_step = info.step
        return info

    # ------------------------------------------------------------------ save
    def observe_step(self, objs: TrainingObjects, result) -> None:
        """After every optimizer step, on every rank (not collective): record whether non-finite
        values reached the training state on this rank (:class:`NonFiniteGuard`)."""
        self.guard.observe(objs.train_state.step, result, objs.optimizer)

    def propose_best(self, objs: TrainingObjects, metrics: Mapping[str, float]) -> bool:
        """After a validation run, on every rank (not collective, same values everywhere): propose
        the step as a top-K best candidate; nothing changes until a GLOBAL save of it. True when it
        enters the top-K (with ``save_on_best`` the next :meth:`maybe_save` saves GLOBAL)."""
        return self.best.propose(objs.train_state.step, metrics, objs.train_state.best_checkpoints)

    def maybe_save(self, objs: TrainingObjects) -> None:
        """Collective, after every optimizer step: seal/publish the background saves that ended on
        every rank, then save each tier whose interval divides the step (fastest tier first), and
        the persistent tier at a best candidate's step with ``save_on_best``."""
        with self._bounded():
            self._maybe_save(objs)

    def _maybe_save(self, objs: TrainingObjects) -> None:
        for handler in self._tiers.values():
            handler.finalize(blocking=False)
        self._raise_if_failed()
        step = objs.train_state.step
        now = time.perf_counter()
        if self._last_step_end is not None:
            for planner in self._planners.values():
                planner.record_step(now - self._last_step_end)
        due = [tier for tier, h in self._tiers.items()
               if self._due(tier, h, step) or (h.persistent and self.best.save_requested(step))]
        persistent = [self._tiers[t] for t in due if self._tiers[t].persistent and self._tiers[t].saves]
        if self.best.candidate_at(step) and persistent:
            # Every tier saving at this step carries the same records, the candidate committed (a
            # resume from LOCAL at this step must not lose it), over the last published records.
            for handler in persistent:
                handler.finalize(blocking=True)
            self._commit_step = step
        for tier in due:
            blocked = self._save(tier, objs)
            if tier in self._planners:  # every rank measures its own times: rank 0's estimate is used
                planner = self._planners[tier]
                planner.adopt(_dist.broadcast_object(planner.record_save(step, blocked)), _dist.rank() == 0)
        memory = self.cfg.memory_save_interval
        if memory and step > 0 and step % memory == 0 and CheckpointTier.LOCAL not in due:
            self._save_in_memory(objs)
        self._last_step_end = time.perf_counter()

    def _due(self, tier: CheckpointTier, handler: CheckpointTierHandler, step: int) -> bool:
        if step <= 0 or not handler.interval:
            return False
        if tier in self._planners:
            return self._planners[tier].due(step)
        return step % handler.interval == 0

    def save(self, tier: CheckpointTier, objs: TrainingObjects) -> Optional[float]:
        """Collective: save ``tier`` now (end of training, planned exits). Once per step and tier.

        First the tier's previous save is finalized and what it reported is applied; then the
        non-finite guard (once per step, whatever the number of tiers; one all-reduce, before any
        staging): a blocked boundary saves nothing in any tier and either raises
        :class:`~tierstack.checkpointing.nonfinite_guard.NonFiniteError` (``on_nonfinite=stop``)
        or is skipped. The state itself is checked on each tier's writer thread before it is
        written; a non-finite one blocks that save, and the other tiers' saves of the step, when
        it ends (:meth:`_raise_if_failed`). A persistent tier's save carries the top-K best
        records with this step's candidate committed (:meth:`_save_with_records`).

        Returns the seconds the loop was blocked (the guard included), or None when nothing was
        handed to a writer (a blocked boundary, a failed staging)."""
        with self._bounded():
            return self._save(tier, objs)

    def _save(self, tier: CheckpointTier, objs: TrainingObjects) -> Optional[float]:
        handler = self._tiers[tier]
        step = objs.train_state.step
        if self._closed or not handler.saves or self._last_saved[tier] == step:
            return None
        t0 = time.perf_counter()
        self._train_state = objs.train_state
        # The save before publishes first (its records are a best-records base), and a block or
        # failure it reports is applied before anything of this one is staged.
        handler.finalize(blocking=True)
        self._raise_if_failed()
        if self._blocked(step):
            if handler.persistent:
                self.best.settle(step)  # no GLOBAL checkpoint of this step: its candidate is spent
            return None
        if (handler.persistent and self.best.enabled) or self._commit_step == step:
            blocked = self._save_with_records(handler, objs)
        else:
            blocked = handler.save(objs, run_id=objs.train_state.run_id)
        self._last_saved[tier] = step
        self._raise_if_failed()
        return None if blocked is None else time.perf_counter() - t0

    def _save_in_memory(self, objs: TrainingObjects) -> None:
        """A LOCAL memory step (``checkpoint.memory_save_interval``, :mod:`~tierstack.checkpointing.local_memory`):
        a checkpoint boundary for the non-finite guard like any save; staged and checked like a LOCAL
        save, then held in host memory only (it does not wait for a LOCAL file still being written)."""
        handler, step = self._tiers.get(CheckpointTier.LOCAL), objs.train_state.step
        if self._closed or handler is None or not handler.saves or self._blocked(step):
            return
        handler.save(objs, run_id=objs.train_state.run_id, in_memory=True)
        self._raise_if_failed()

    def _blocked(self, step: int) -> bool:
        """Collective, at a checkpoint boundary: the non-finite guard's verdict for ``step`` (once
        per step); a blocked step is recorded in ``blocked_steps``."""
        if self.guard.check(step).ok:
            return False
        if not self.blocked_steps or self.blocked_steps[-1] != step:
            self.blocked_steps.append(step)
        return True

    def _save_with_records(self, handler: CheckpointTierHandler, objs: TrainingObjects) -> Optional[float]:
        """Save with the best records committed into the TrainState this save captures. The live
        TrainState keeps the previous records until a persistent save of them is published
        (:meth:`_notify`), so a save that fails or is still in flight leaves them unchanged."""
        ts = objs.train_state  # (_save finalized this tier's previous save: its records are the base)
        previous = [list(r) for r in ts.best_checkpoints]
        ts.best_checkpoints = self.best.records_for(ts.step, previous)
        try:
            return handler.save(objs, run_id=ts.run_id)
        finally:
            if handler.persistent:
                self.best.settle(ts.step)
            if not (handler.persistent and ts.step in handler.saved_steps()):
                ts.best_checkpoints = previous  # published: _notify set the same records already

    def final_tier(self) -> Optional[CheckpointTier]:
        """Where the last state of a run goes: the first persistent tier that saves, else the first
        that saves at all (GLOBAL survives the loss of a node; LOCAL is better than nothing)."""
        saving = [h for h in self._tiers.values() if h.saves]
        persistent = [h for h in saving if h.persistent]
        chosen = (persistent or saving or [None])[0]
        return None if chosen is None else chosen.tier

    def save_final(self, objs: TrainingObjects) -> bool:
        """Collective: keep the last state in :meth:`final_tier` unless that tier holds this step already.
        Returns False when its save of this step failed on some rank (as far as known now: an async
        GLOBAL save reports at close); True otherwise, also when no tier saves."""
        tier, step = self.final_tier(), objs.train_state.step
        if tier is not None and self._last_saved[tier] != step:
            self.save(tier, objs)
        return tier is None or (self._last_saved[tier] == step and step not in self._tiers[tier].failures)

    def _take_blocked(self) -> list:
        """Every rank alike: the saves whose staged state held NaN/inf, taken from the tiers; their
        steps recorded as blocked and vetoed in every other tier; then the retention no tier can
        veto any more is started (:meth:`_release_retention`)."""
        blocked = []
        for handler in self._tiers.values():
            blocked += [(handler, step, ranks) for step, ranks in handler.nonfinite]
            handler.nonfinite = []
        for handler, step, _ in blocked:  # every tier of a blocked step is blocked alike
            if step not in self.blocked_steps:
                self.blocked_steps.append(step)
            for other in self._tiers.values():
                if other is not handler:
                    other.veto(step)
        self._release_retention()
        return blocked

    def _release_retention(self) -> None:
        """A step is settled once no tier has a save of it (or of an earlier step) in flight."""
        pending = [h.in_flight_step for h in self._tiers.values() if h.in_flight_step is not None]
        settled = min(pending) - 1 if pending else None
        for handler in self._tiers.values():
            handler.release_retention(settled)

    def _raise_if_failed(self, blocked: Optional[list] = None) -> None:
        """After saves ended (every rank, same lists): apply ``on_nonfinite`` to the saves whose staged
        state held NaN/inf (``NonFiniteError`` with ``stop``), then ``exit_on_save_failure``."""
        blocked = self._take_blocked() if blocked is None else blocked
        if blocked:
            self.guard.state_blocked([(h.tier.value.upper(), step, ranks) for h, step, ranks in blocked])
        failed = {t.value: list(h.failures) for t, h in self._tiers.items() if h.failures}
        if failed and self.cfg.exit_on_save_failure:
            raise CheckpointSaveError(f"checkpoint save failed {failed}; checkpoint.exit_on_save_failure=true")

    # ------------------------------------------------------------------ queries
    def last_saved_step(self, tier: CheckpointTier) -> Optional[int]:
        """Step of the last save of ``tier`` started (or loaded) by this process, None if none."""
        return self._last_saved[tier]

    def saved_steps(self, tier: CheckpointTier) -> list[int]:
        """Steps this process saved in ``tier`` that are published / sealed on every rank."""
        return self._tiers[tier].saved_steps()

    def staging_bytes(self, tier: CheckpointTier) -> int:
        """Bytes of host staging memory ``tier`` holds on this rank (kept between saves)."""
        return int(self._tiers[tier].staging_bytes)

    def in_flight(self, tier: CheckpointTier) -> int:
        """Saves of ``tier`` handed to the background writer and not yet sealed/published (0 or 1)."""
        return int(self._tiers[tier].in_flight)

    # ------------------------------------------------------------------ end
    def last_durable_s(self, tier: CheckpointTier) -> Optional[float]:
        """Seconds from the start of ``tier``'s last finalized save to the agreement that it is
        sealed (LOCAL) or published (GLOBAL) on every rank; None before the first."""
        return self._tiers[tier].last_durable_s

    def last_blocked_s(self, tier: CheckpointTier) -> Optional[float]:
        """Seconds ``tier``'s last finalized save kept the training loop waiting; None before the first."""
        return self._tiers[tier].last_blocked_s

    def retention_pending(self, tier: CheckpointTier) -> bool:
        """Whether ``tier``'s retention (deleting old checkpoints, in the background) still runs on this rank."""
        return bool(self._tiers[tier].retention_pending)

    def wait(self) -> None:
        """Collective: block until every in-flight save of every tier is sealed/published (or failed)
        and the retention those saves started has ended (at most ``checkpoint.async_write_timeout_s``
        more; it goes on in the background after that)."""
        with self._bounded():
            for handler in self._tiers.values():
                handler.finalize(blocking=True)
        blocked = self._take_blocked()  # vetoes first: no retention of a step another tier blocked
        for handler in self._tiers.values():  # after the collectives: a rank deleting longer stalls no other
            handler.wait_retention()
        self._raise_if_failed(blocked)

    def close(self, error: Optional[BaseException] = None) -> None:
        """Collective: finalize every in-flight save and stop every writer, each tier even when
        another one's close raised (the first such error is raised after all are closed); then
        :class:`CheckpointSaveError` if a save failed and ``exit_on_save_failure`` is set. Idempotent.
        With ``error``, the error the run unwinds from, when it is not raised on every rank alike
        (:func:`~tierstack.errors.raised_on_every_rank`): not collective, nothing raised
        (:func:`~tierstack.checkpointing.closing.close_alone`)."""
        if self._closed:
            return
        self._closed = True
        if error is not None and not raised_on_every_rank(error):
            return closing.close_alone(self._tiers.values(), error)
        with self._bounded():
            errors = closing.close_each(self._tiers.values())
        blocked = self._take_blocked()  # vetoes first: no retention of a step another tier blocked
        for handler in self._tiers.values():  # after the collectives: a rank deleting longer stalls no other
            handler.close_retention()
        if errors:
            raise errors[0]
        self._raise_if_failed(blocked)
