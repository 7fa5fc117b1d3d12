"""GLOBAL tier: megatron-core ``dist_checkpointing`` (torch_dist) on persistent shared storage.

A save follows the protocol of DESIGN.md: write into ``iter_N.staging-<run>-<attempt>``, agree,
seal (manifest with per-file CRC-32C), publish (rank 0 renames the directory, then rewrites the
trackers atomically), retain.

An async save copies the tensors into the tier's reused staging buffers (a sync one writes host
tensors in place: training waits for it anyway) and runs megatron-core's torch_dist write plan on
the tier's writer thread (:mod:`global_writer`, which says why not megatron's forked writers);
each rank checksums the files it wrote there. A sync save waits for the writer; an async one
returns, and the loop's finalize (once the writer ended on every rank) runs megatron's finalize,
seals and publishes with the step and TrainState captured when it was scheduled. One in flight.
"""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from tierstack.checkpointing import (best, compat, errors, global_writer, manifest, model_settings, paths, publish,
                                     rank0_phases, retention, retry, safe_load, sharding_check)
from tierstack.checkpointing import state as ckpt_state
from tierstack.checkpointing import rewind
from tierstack.checkpointing.global_reader import GlobalReader
from tierstack.checkpointing.staging import StagedTier
from tierstack.checkpointing.types import Candidate, CheckpointTier, SaveEvent, TrainingObjects
from tierstack.config import CheckpointConfig
from tierstack.runtime import ParallelLayout, collectives as _dist
from tierstack.runtime.failures import interrupts

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    step: int
    staging: Path
    train_state: dict
    run_id: str
    extra: dict
    request: object  # megatron AsyncRequest (its finalize_fns run at our finalize)
    job: Future  # the writer thread's job: this rank's file entries
    started: float  # perf_counter at the start of the save
    timed_out: Optional[BaseException] = None  # set by StagedTier._take_ended after the write timeout
    blocked_s: float = 0.0


class GlobalTier(StagedTier):
    """The GLOBAL tier (see the module docstring); implements :class:`CheckpointTierHandler`.

    Args:
        cfg: the ``checkpoint`` section (``save``, ``load``, ``save_interval``, ``async_save``, ...).
        parallel_layout: this rank's layout (recorded in each manifest).
        run_config: the whole run config as plain dicts, written beside each checkpoint
            (``run_config.yaml``) so that a checkpoint says how it was made.
        on_publish: called on every rank with each published save.
    """

    tier = CheckpointTier.GLOBAL
    persistent = True  # survives the loss of a node: the final save of a run goes here
    per_rank_files = False  # one shared checkpoint: invalid as a whole when any part fails

    def __init__(self, cfg: CheckpointConfig, parallel_layout: ParallelLayout, *,
                 run_config: Mapping[str, Any], on_publish: Callable[[SaveEvent], None] = lambda e: None):
        super().__init__("GLOBAL", cfg.async_write_timeout_s)
        self._sharding = sharding_check.ShardingValidation()
        self.cfg = cfg
        self.layout = parallel_layout
        self.run_config = run_config
        self.save_root = Path(cfg.save) if cfg.save else None
        load = cfg.load or cfg.save
        self.load_root = Path(load) if load else None
        self._reader = GlobalReader(cfg, parallel_layout)
        self._on_publish = on_publish
        self.published: list[int] = []  # steps this process published
        if self.save_root is not None:
            global_writer.start_results_channel()  # an in-process queue, not megatron's Manager process

    @property
    def enabled(self) -> bool:
        return self.load_root is not None or self.save_root is not None

    @property
    def saves(self) -> bool:
        return self.save_root is not None

    @property
    def interval(self) -> Optional[int]:
        return self.cfg.save_interval

    @property
    def run_root(self) -> Optional[Path]:
        return self.load_root

    def claim(self, run_id: str) -> None:
        """Rank 0 writes the run file of a fresh run into the save root (one shared directory)."""
        if self.save_root is not None and _dist.rank() == 0:
            paths.write_run_file(self.save_root, run_id)

    def saved_steps(self) -> list[int]:
        return list(self.published)

    # ------------------------------------------------------------------ strategies
    def _save_strategy(self):
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        strategy = get_default_save_sharded_strategy("torch_dist")
        if self.cfg.fully_parallel_save:
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True)
            )
        return strategy

    # ------------------------------------------------------------------ save
    def save(self, objs: TrainingObjects, *, run_id: str) -> Optional[float]:
        """Collective: stage, plan and hand the write to the writer thread; a sync save (``async_save``
        false) also waits for it and publishes. Returns the seconds the caller was blocked, or None
        when the save failed on some rank."""
        if self.save_root is None:
            return None
        c = self.cfg
        t0 = time.perf_counter()
        self.finalize(blocking=True)  # one save in flight per tier; reports the previous one's end
        step = objs.train_state.step
        extra = {
            "distributed_optimizer": ckpt_state.uses_distributed_optimizer(objs.optimizer),
            "has_optimizer": c.save_optim,
            "has_rng": c.save_rng,
            **model_settings.model_settings(objs.model),
            **compat.manifest_fields(self.run_config),  # tokenizer and config, compared before a resume
        }
        captured = dict(objs.train_state.state_dict())
        # Nothing in flight now: what an interrupted save left is not ours to keep. Not while the
        # retention thread still deletes a directory here (its .deleting- name is a leftover too; a
        # slow file system must not block training): a later save removes them.
        if _dist.rank() == 0 and not self.retention_pending:
            paths.remove_leftovers(self.save_root, run_id)  # and, on a full file system, older checkpoints:
            retention.make_room_global(self.save_root, run_id, step, c.most_recent_k, best.protected_steps(captured))

        def attempt(n: int):
            staging = self.save_root / paths.staging_dir_name(step, run_id, n)
            retry.run_agreed(lambda: self._make_staging(staging))
            # Rebuilt per attempt: dist_checkpointing preprocesses the dict in place.
            sd = ckpt_state.build(objs, is_loading=False, optim=c.save_optim, rng=c.save_rng)
            return staging, self._plan(sd, staging)

        def cleanup(n: int, failed: retry.SaveAttemptFailed) -> None:
            log.warning("GLOBAL save of step %d, attempt %d failed: %s", step, n, failed)
            if _dist.rank() == 0:
                shutil.rmtree(self.save_root / paths.staging_dir_name(step, run_id, n), ignore_errors=True)

        try:
            staging, (request, written) = retry.run_attempts(
                attempt, attempts=c.save_retries, backoff_s=c.retry_backoff_s, on_failure=cleanup
            )
        except retry.SaveAttemptFailed as e:
            log.error("GLOBAL checkpoint of step %d NOT saved (%s); the previous one stays the newest", step, e)
            self.failures.append(step)
            return None
        job = self._submit_checked(f"GLOBAL checkpoint of step {step}", global_writer.write_request, request,
                                   staging, attempts=c.save_retries, backoff_s=c.retry_backoff_s,
                                   check_in_fn=True,  # the non-finite check beside the write
                                   checked=written)
        self._in_flight = _InFlight(step, staging, captured, run_id, extra, request, job, t0)
        self._in_flight.blocked_s = time.perf_counter() - t0
        if not c.async_save:
            self.finalize(blocking=True)
            return time.perf_counter() - t0
        log.info("GLOBAL checkpoint of step %d scheduled (blocked %.2fs)", step, self._in_flight.blocked_s)
        return self._in_flight.blocked_s

    def _plan(self, sd: dict, staging: Path):
        """Collective: stage and plan (:func:`global_writer.plan`); its request, the tensors it writes."""
        return retry.run_agreed(lambda: global_writer.plan(
            sd, staging, self._stager, self._save_strategy(), in_place=not self.cfg.async_save,
            sharding=self._sharding))

    def _make_staging(self, staging: Path) -> None:
        if _dist.rank() == 0:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)

    def _seal_and_publish(self, step: int, staging: Path, train_state: dict, run_id: str, extra: dict,
                          described: dict) -> None:
        """Collective: manifest, then rank 0 renames and updates trackers.

        ``described``: this rank's entries of the files its writer wrote (checksummed there), taken
        as they are even when rank 0's listing of the directory does not show them yet; the
        files no rank's writer wrote (megatron's ``.metadata`` and ``metadata.json``, run_config.yaml) are
        checksummed here, split over ranks.
        """

        def run_config_and_names() -> Optional[list[str]]:
            if _dist.rank() != 0:
                return None
            from omegaconf import OmegaConf

            (staging / paths.RUN_CONFIG).write_text(OmegaConf.to_yaml(OmegaConf.create(dict(self.run_config))))
            return manifest.list_files(staging)

        names = _dist.broadcast_object(retry.run_agreed(run_config_and_names))
        written: dict = {}
        for part in _dist.all_gather_object(described):
            written.update(part)
        rest = [n for n in names if n not in written]
        mine = rest[_dist.rank():: _dist.world_size()]
        described_here = retry.run_agreed(lambda: manifest.describe_files(staging, mine))
        files: dict = dict(written)  # the writers' reports are the truth: rank 0's listing of a shared
        for part in _dist.all_gather_object(described_here):  # directory may lag (NFS attribute caching)
            files.update(part)
        unseen = sorted(set(written) - set(names))
        if unseen and _dist.rank() == 0:
            log.info("GLOBAL step %d: %d file(s) written by other ranks are not in rank 0's listing yet (%s); "
                     "the writers' reports are used", step, len(unseen), ", ".join(unseen[:3]))

        def publish_on_rank0():
            if _dist.rank() != 0:
                return
            man = manifest.build_manifest(
                tier=self.tier.value, step=step, run_id=run_id, topology=self.layout.topology(),
                train_state=train_state, files=files, **extra,
            )
            manifest.write_manifest(staging / paths.MANIFEST, man)
            publish.publish_step(self.save_root, step, staging, train_state, run_id)

        retry.run_agreed(publish_on_rank0)

    def _after_publish(self, step: int, run_id: str, blocked_s: float, train_state: dict) -> None:
        path = self.save_root / paths.step_dir_name(step)
        man = paths.read_json(path / paths.MANIFEST) if _dist.rank() == 0 else None
        size = _dist.broadcast_object(int(man["bytes"]) if man else 0)
        log.info("GLOBAL checkpoint of step %d published at %s (%d bytes, blocked %.2fs)", step, path, size, blocked_s)
        if _dist.rank() == 0:  # the top-K records published with this checkpoint protect their steps
            root, k, keep = self.save_root, self.cfg.most_recent_k, best.protected_steps(train_state)
            budget = size if self.cfg.quarantine_budget_bytes is None else self.cfg.quarantine_budget_bytes
            self._retain(lambda: (retention.prune_global(root, run_id, step, k, keep),
                                  retention.prune_quarantined(root, budget)), f"after step {step}")
        self.published.append(step)
        self._on_publish(SaveEvent(self.tier, step, str(path), size, blocked_s, train_state))

    # ------------------------------------------------------------------ finalize
    def finalize(self, blocking: bool) -> None:
        """Collective: publish the save in flight once its writer ended on every rank (or wait for
        it when ``blocking``). A failure on any rank fails it on every rank: the staging directory
        is removed and the step recorded in ``failures`` (in ``nonfinite`` with the ranks, when a
        writer found NaN/inf in the staged state).

        The writer thread already retried its transient errors, so a writer failure is final. What
        runs here on the training thread (megatron's finalize with rank 0's ``.metadata`` and
        ``metadata.json`` writes, then seal and publish) is retried as a whole on a transient error;
        a retry re-runs only rank 0's failed metadata writes (the data files are complete).
        """
        job: Optional[_InFlight] = self._take_ended(blocking)
        if job is None:
            return
        t0 = time.perf_counter()
        error = self._job_error(job)
        self._log_writer_error(job.step, error)
        try:
            retry.agree(error)  # every rank learns every rank's cause (rank, path, errno)
            if job.step in self._vetoed:  # blocked in another tier: never published here either
                self._discard(job)
                log.error("GLOBAL checkpoint of step %d discarded on every rank: the non-finite guard blocked that "
                          "step", job.step)
                return
            self._finalize_attempts(job)
        except retry.SaveAttemptFailed as e:
            nonfinite = self._nonfinite_ranks(job)  # (a collective: before rank 0's deletion, as every rank)
            self._discard(job)
            if nonfinite:  # not a failed save: the guard's verdict (the manager applies on_nonfinite)
                self.nonfinite.append((job.step, nonfinite))
                return
            log.error("GLOBAL checkpoint of step %d NOT published (%s); the previous one stays the newest",
                      job.step, e)
            self.failures.append(job.step)
            return
        self.last_durable_s, self.last_blocked_s = time.perf_counter() - job.started, job.blocked_s
        self._after_publish(job.step, job.run_id, job.blocked_s + time.perf_counter() - t0, job.train_state)

    @staticmethod
    def _discard(job: _InFlight) -> None:
        """Drop a save that will not be published, on every rank: whatever this rank's writer put
        into megatron's results queue (also when it failed after putting them, e.g. in the
        read-back check: the next save's finalize would otherwise read these) and, on rank 0, the
        staging directory."""
        global_writer.discard_results(job.request)
        if _dist.rank() == 0:
            shutil.rmtree(job.staging, ignore_errors=True)

    def _finalize_attempts(self, job: _InFlight) -> None:
        """Collective: megatron's finalize, seal and publish, retried together on a transient error."""
        c = self.cfg
        pending = rank0_phases.Deferred()

        def megatron_finalize() -> None:
            try:  # collective: write results gathered; rank 0's metadata writes report after it
                with rank0_phases.deferring(pending):
                    for fn in job.request.finalize_fns:
                        fn()
            except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
                if pending.calls or interrupts(e):
                    raise
                # the writer thread already retried its transient errors: the files are not there
                raise errors.NotRetryable(f"background write failed: {errors.describe(e)}") from e

        def attempt(n: int) -> None:
            retry.run_agreed(megatron_finalize if n == 1 else pending.rerun)
            self._seal_and_publish(job.step, job.staging, job.train_state, job.run_id, job.extra, job.job.result())

        retry.run_attempts(attempt, attempts=c.save_retries, backoff_s=c.retry_backoff_s,
                           on_failure=lambda n, e: log.warning(
                               "GLOBAL finalize of step %d, attempt %d failed: %s", job.step, n, e))

    def _unseal(self, step: int) -> None:
        """A published GLOBAL checkpoint is never taken back (its trackers may be read already). It
        cannot be needed: this tier checks every tensor it stages, a superset of what LOCAL writes
        at the same step, so a step LOCAL blocks was blocked here first."""
        log.error("GLOBAL checkpoint of step %d is published although the non-finite guard blocked that step "
                  "in another tier", step)

    # ------------------------------------------------------------------ resume
    def candidates(self, run_id: Optional[str]) -> list[Candidate]:
        """Published step directories of the load root (header checks only; see :meth:`verify`)."""
        if self.load_root is None or not self.load_root.is_dir():
            return []
        out = []
        for p in self.load_root.iterdir():
            step = paths.parse_step_dir(p.name)
            if step is None or not p.is_dir():
                continue  # staging, quarantined and foreign names are never candidates
            man_path = p / paths.MANIFEST
            if not man_path.exists():
                out.append(Candidate(self.tier, step, p, foreign=True, problem="no-manifest"))
                continue
            man = paths.read_json(man_path)
            problem = manifest.check_manifest(man, step=step)
            foreign = man is not None and run_id is not None and man.get("run_id") != run_id
            out.append(Candidate(self.tier, step, p, man, problem or ("other-run" if foreign else None), foreign))
        self._warn_tracker_without_step({c.step for c in out})
        return out

    def _warn_tracker_without_step(self, steps: set) -> None:
        """Rank 0: a tracker naming a step with no directory (deleted by hand, lost with a volume)
        is said, not silently ignored; resume still takes the newest valid checkpoint there is."""
        tracker = self.load_root / paths.TRACKER_ITERATION
        if _dist.rank() != 0 or not tracker.exists():
            return
        named = tracker.read_text(errors="replace").strip()
        if not named.isdigit() or int(named) not in steps:
            log.warning("%s names step %s, but %s holds no checkpoint of that step (removed or lost?); "
                        "resume takes the newest valid checkpoint there is", tracker, named, self.load_root)

    def verify(self, cand: Candidate) -> Optional[str]:
        """This rank's share of the file checks (sizes, checksums; pickled files through :mod:`safe_load`)."""
        names = manifest.share(cand.manifest["files"], _dist.rank(), _dist.world_size())
        return manifest.check_files(cand.path, cand.manifest["files"], names) or safe_load.problem(cand.path, names)

    def prepare_resume(self, run_id: str) -> None:
        """Nothing to fetch: a GLOBAL checkpoint is on shared storage."""

    def interrupted_steps(self) -> list[int]:
        """None per rank: a GLOBAL save is published whole or not at all (its staging is a leftover)."""
        return []

    def abandon(self, step: int) -> None:
        """Nothing per rank to abandon (see :meth:`interrupted_steps`)."""

    def quarantine(self, cand: Candidate, reason: str) -> None:
        if _dist.rank() == 0 and cand.path.exists():
            target = paths.quarantine(cand.path, reason)
            log.warning("GLOBAL checkpoint %s is invalid (%s): moved to %s", cand.path, reason, target.name)

    def rewind(self, step: int, run_id: str) -> Optional[list[int]]:
        """Rank 0 renames the newer directories (:func:`rewind.move_aside_global`); None when the
        load root is not the save root (not this run's to change)."""
        if self.load_root is None or self.load_root != self.save_root:
            return None
        return rewind.move_aside_global(self.load_root, self.candidates(run_id), step)

    def load(self, step: int, objs: TrainingObjects) -> str:
        """Collective: restore ``objs`` from step ``step`` of the load root (see :class:`GlobalReader`)."""
        return self._reader.load(self.load_root, step, objs)

    def _on_close(self) -> None:
        """After the writer stopped (:meth:`close` and :meth:`close_alone`): drop its result queue."""
        global_writer.shutdown_results_channel()
