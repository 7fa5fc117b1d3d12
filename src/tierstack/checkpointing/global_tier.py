"""GLOBAL tier: megatron-core ``dist_checkpointing`` (torch_dist) on persistent shared storage.

A save follows the protocol of DESIGN.md: write into ``iter_N.staging-<run>-<attempt>``, agree,
seal (manifest with per-file CRC-32C), publish (rank 0 renames the directory, then rewrites the
trackers atomically), retain.

Both sync and async saves copy the tensors into the tier's reused staging buffers and run
megatron-core's torch_dist write plan on the tier's writer thread (:mod:`global_writer`, which
says why not megatron's forked writers); each rank checksums the files it wrote there. A sync save
waits for the writer; an async one returns, and the loop's finalize (once the writer ended on
every rank) runs megatron's finalize, seals and publishes with the step and TrainState captured
when the save was scheduled. At most one save is in flight.
"""

from __future__ import annotations

import io
import logging
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from tierstack.checkpointing import global_writer, manifest, paths, retention, retry
from tierstack.runtime import collectives as _dist
from tierstack.checkpointing import state as ckpt_state
from tierstack.checkpointing.staging import Stager
from tierstack.checkpointing.types import Candidate, CheckpointTier, SaveEvent, TrainingObjects
from tierstack.config import ConfigContainer
from tierstack.runtime import ParallelLayout

log = logging.getLogger(__name__)


class CheckpointLoadError(RuntimeError):
    """A checkpoint cannot be loaded as asked; the message says which setting to change."""


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
    blocked_s: float = 0.0


class GlobalTier:
    tier = CheckpointTier.GLOBAL

    def __init__(self, cfg: ConfigContainer, parallel_layout: ParallelLayout, on_publish: Callable[[SaveEvent], None]):
        c = cfg.checkpoint
        self.cfg = cfg
        self.layout = parallel_layout
        self.save_root = Path(c.save) if c.save else None
        load = c.load or c.save
        self.load_root = Path(load) if load else None
        self._on_publish = on_publish
        self._warmup = None
        self._stager = Stager("GLOBAL")
        self._in_flight: Optional[_InFlight] = None
        self.failures: list[int] = []  # steps whose save failed (the manager decides what to do)
        self.last_durable_s: Optional[float] = None  # start of the last published save to its publish
        if self.save_root is not None:
            self._prewarm_writer()

    @property
    def enabled(self) -> bool:
        return self.load_root is not None or self.save_root is not None

    # ------------------------------------------------------------------ strategies
    def _prewarm_writer(self) -> None:
        """Start the torch_dist writer's result channel in the background, at setup.

        Both sync and async torch_dist saves report write results through a spawned multiprocessing
        Manager; its server process imports torch when it first unpickles a result (~5 s on 2 CPU
        cores). A thread pays that now; the first save joins it instead of paying it inline.
        """
        import threading

        def warm():
            from megatron.core.dist_checkpointing.strategies.filesystem_async import _get_write_results_queue
            from torch.distributed.checkpoint.metadata import MetadataIndex

            q = _get_write_results_queue()
            q.put(MetadataIndex("tierstack-warmup"))  # makes the server import torch.distributed.checkpoint
            q.get()

        self._warmup = threading.Thread(target=warm, name="tierstack-ckpt-warmup", daemon=True)
        self._warmup.start()

    def _wait_warm(self) -> None:
        if self._warmup is not None:
            self._warmup.join()
            self._warmup = None

    def _save_strategy(self):
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        strategy = get_default_save_sharded_strategy("torch_dist")
        if self.cfg.checkpoint.fully_parallel_save:
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True)
            )
        return strategy

    def _load_strategy(self, path: Path):
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

        strategy = get_default_load_sharded_strategy(str(path))
        if self.cfg.checkpoint.fully_parallel_load:
            strategy = FullyParallelLoadStrategyWrapper(
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
        c = self.cfg.checkpoint
        self._wait_warm()
        t0 = time.perf_counter()
        self.finalize(blocking=True)  # one save in flight per tier; reports the previous one's end
        step = objs.train_state.step
        extra = {
            "distributed_optimizer": ckpt_state.uses_distributed_optimizer(objs.optimizer),
            "has_optimizer": c.save_optim,
            "has_rng": c.save_rng,
        }
        captured = dict(objs.train_state.state_dict())

        def attempt(n: int):
            staging = self.save_root / paths.staging_dir_name(step, run_id, n)
            retry.run_agreed(lambda: self._make_staging(staging, objs.config))
            # Rebuilt per attempt: dist_checkpointing preprocesses the dict in place.
            sd = ckpt_state.build(objs, is_loading=False, optim=c.save_optim, rng=c.save_rng)
            return staging, self._plan(sd, staging)

        def cleanup(n: int, failed: retry.SaveAttemptFailed) -> None:
            log.warning("GLOBAL save of step %d, attempt %d failed: %s", step, n, failed)
            if _dist.rank() == 0:
                shutil.rmtree(self.save_root / paths.staging_dir_name(step, run_id, n), ignore_errors=True)

        try:
            staging, request = retry.run_attempts(
                attempt, attempts=c.save_retries, backoff_s=c.retry_backoff_s, on_failure=cleanup
            )
        except retry.SaveAttemptFailed as e:
            log.error("GLOBAL checkpoint of step %d NOT saved (%s); the previous one stays the newest", step, e)
            self.failures.append(step)
            return None
        job = self._stager.submit(global_writer.write_request, request, staging,
                                  attempts=c.save_retries, backoff_s=c.retry_backoff_s)
        self._in_flight = _InFlight(step, staging, captured, run_id, extra, request, job, t0)
        self._in_flight.blocked_s = time.perf_counter() - t0
        if not c.async_save:
            self.finalize(blocking=True)
            return time.perf_counter() - t0
        log.info("GLOBAL checkpoint of step %d scheduled (blocked %.2fs)", step, self._in_flight.blocked_s)
        return self._in_flight.blocked_s

    def _plan(self, sd: dict, staging: Path):
        """Stage the tensors into the reused buffers, then let megatron plan the write (collective)."""
        from megatron.core import dist_checkpointing

        box = {}

        def plan():
            global_writer.stage_sharded_tensors(sd, self._stager)
            box["request"] = dist_checkpointing.save(
                sd, str(staging), sharded_strategy=self._save_strategy(), async_sharded_save=True
            )

        retry.run_agreed(plan)
        return box["request"]

    def _make_staging(self, staging: Path, cfg: ConfigContainer) -> None:
        if _dist.rank() == 0:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)

    def _seal_and_publish(self, step: int, staging: Path, train_state: dict, run_id: str, extra: dict,
                          described: dict) -> None:
        """Collective: manifest, then rank 0 renames and updates trackers.

        ``described``: this rank's entries of the files its writer wrote (checksummed there); the
        files no rank's writer wrote (megatron's metadata, common.pt, run_config.yaml) are
        checksummed here, split over ranks.
        """

        def run_config_and_names():
            if _dist.rank() == 0:
                from omegaconf import OmegaConf

                text = OmegaConf.to_yaml(OmegaConf.create(self.cfg.to_dict()))
                (staging / paths.RUN_CONFIG).write_text(text)
                box.append(manifest.list_files(staging))

        box: list = []
        retry.run_agreed(run_config_and_names)
        names = _dist.broadcast_object(box[0] if box else None)
        written: dict = {}
        for part in _dist.all_gather_object(described):
            written.update(part)
        rest = [n for n in names if n not in written]
        mine = rest[_dist.rank():: _dist.world_size()]
        parts: list = []
        retry.run_agreed(lambda: parts.append(manifest.describe_files(staging, mine)))
        files: dict = dict(written)
        for part in _dist.all_gather_object(parts[0]):
            files.update(part)
        if set(files) != set(names):
            raise retry.SaveAttemptFailed(retry.PERMANENT, RuntimeError(
                f"files written {sorted(set(files) - set(names))} are not in the staging directory"))

        def publish():
            if _dist.rank() != 0:
                return
            man = manifest.build_manifest(
                tier=self.tier.value, step=step, run_id=run_id, topology=self.layout.topology(),
                train_state=train_state, files=files, **extra,
            )
            manifest.write_manifest(staging / paths.MANIFEST, man)
            final = self.save_root / paths.step_dir_name(step)
            if final.exists():  # an older run of this step (resumed with ckpt_step): keep it aside
                paths.quarantine(final, "superseded")
            staging.rename(final)
            paths.fsync_dir(self.save_root)
            paths.atomic_write_text(self.save_root / paths.TRACKER_ITERATION, f"{step}\n")
            buf = io.BytesIO()
            torch.save(train_state, buf)
            paths.atomic_write_bytes(self.save_root / paths.TRACKER_TRAIN_STATE, buf.getvalue())
            paths.write_run_file(self.save_root, run_id)

        retry.run_agreed(publish)

    def _after_publish(self, step: int, run_id: str, blocked_s: float) -> None:
        path = self.save_root / paths.step_dir_name(step)
        man = paths.read_json(path / paths.MANIFEST) if _dist.rank() == 0 else None
        size = _dist.broadcast_object(int(man["bytes"]) if man else 0)
        log.info("GLOBAL checkpoint of step %d published at %s (%d bytes, blocked %.2fs)", step, path, size, blocked_s)
        if _dist.rank() == 0:
            try:
                retention.prune_global(self.save_root, run_id, step, self.cfg.checkpoint.most_recent_k)
            except OSError as e:  # retention never fails a save
                log.warning("GLOBAL retention after step %d failed: %s", step, e)
        self._on_publish(SaveEvent(self.tier, step, str(path), size, blocked_s))

    # ------------------------------------------------------------------ finalize
    def finalize(self, blocking: bool) -> None:
        """Collective: publish the save in flight once its writer ended on every rank (or wait for
        it when ``blocking``). A failure on any rank fails it on every rank: the staging directory
        is removed and the step recorded in ``failures``."""
        job = self._in_flight
        if job is None:
            return
        if not blocking and not _dist.all_true(job.job.done()):
            return  # a sync point per step while a save is in flight: one small all-reduce
        self._in_flight = None
        t0 = time.perf_counter()
        error = job.job.exception()
        if error is not None:
            log.error("GLOBAL write of step %d failed on rank %d: %r", job.step, _dist.rank(), error)
        try:
            if not _dist.all_true(error is None):
                raise retry.SaveAttemptFailed(retry.PERMANENT, error)
            # megatron's own finalize: write results gathered, .metadata written (collective)
            retry.run_agreed(lambda: [fn() for fn in job.request.finalize_fns])
            self._seal_and_publish(job.step, job.staging, job.train_state, job.run_id, job.extra, job.job.result())
        except retry.SaveAttemptFailed as e:
            if error is None:
                global_writer.discard_results(job.request)
            log.error("GLOBAL checkpoint of step %d NOT published (%s); the previous one stays the newest",
                      job.step, e)
            if _dist.rank() == 0:
                shutil.rmtree(job.staging, ignore_errors=True)
            self.failures.append(job.step)
            return
        self.last_durable_s = time.perf_counter() - job.started
        self._after_publish(job.step, job.run_id, job.blocked_s + time.perf_counter() - t0)

    @property
    def in_flight(self) -> int:
        return 0 if self._in_flight is None else 1

    @property
    def staging_bytes(self) -> int:
        return self._stager.nbytes

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
        return out

    def verify(self, cand: Candidate) -> Optional[str]:
        """This rank's share of the file checks (sizes and checksums, split over ranks)."""
        names = sorted(cand.manifest["files"])
        return manifest.check_files(cand.path, cand.manifest["files"], names[_dist.rank():: _dist.world_size()])

    def quarantine(self, cand: Candidate, reason: str) -> None:
        if _dist.rank() == 0 and cand.path.exists():
            target = paths.quarantine(cand.path, reason)
            log.warning("GLOBAL checkpoint %s is invalid (%s): moved to %s", cand.path, reason, target.name)

    def load(self, step: int, objs: TrainingObjects, *, model_only: bool = False) -> str:
        from megatron.core import dist_checkpointing

        c = self.cfg.checkpoint
        path = self.load_root / paths.step_dir_name(step)
        man = paths.read_json(path / paths.MANIFEST) or {}
        saved, now = man.get("topology", {}), self.layout.topology()
        optim = self._load_optim_decision(man, objs, model_only)
        rng = c.load_rng and not model_only and man.get("has_rng", True) and saved == now
        if c.load_rng and not model_only and saved != now:
            log.warning("GLOBAL load: topology changed %s -> %s; per-rank RNG state not restored", saved, now)
        sd = ckpt_state.build(objs, is_loading=True, optim=optim, rng=rng)
        loaded = dist_checkpointing.load(sd, str(path), sharded_strategy=self._load_strategy(path))
        if model_only:
            with torch.no_grad():
                ckpt_state.unwrap(objs.model[0]).load_state_dict(loaded[ckpt_state.MODEL], strict=True)
                for opt in ckpt_state.inner_optimizers(objs.optimizer):
                    if hasattr(opt, "reload_model_params"):
                        opt.reload_model_params()
        else:
            ckpt_state.apply(objs, loaded, optim=optim, rng=rng)
        return str(path)

    def _load_optim_decision(self, man: dict, objs: TrainingObjects, model_only: bool) -> bool:
        """Whether to load optimizer state; a load that cannot be exact is an error, never a silent reset."""
        if model_only or not self.cfg.checkpoint.load_optim:
            return False
        if not man.get("has_optimizer", True):
            raise CheckpointLoadError(
                "checkpoint has no optimizer state (saved with checkpoint.save_optim=false); "
                "set checkpoint.load_optim=false to load the model only"
            )
        saved, now = man.get("topology", {}), self.layout.topology()
        dist_now = ckpt_state.uses_distributed_optimizer(objs.optimizer)
        dist_saved = bool(man.get("distributed_optimizer", False))
        same_mp = all(
            saved.get(k) == now[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
        )
        if dist_now != dist_saved:
            raise CheckpointLoadError(
                f"checkpoint optimizer state was saved with use_distributed_optimizer={dist_saved}, this run "
                f"uses {dist_now}; set optimizer.use_distributed_optimizer={dist_saved} or "
                "checkpoint.load_optim=false (model weights only, fresh optimizer)"
            )
        if dist_now and not same_mp:
            raise CheckpointLoadError(
                "DistributedOptimizer state can change data-parallel size only (dp_reshardable), but TP/PP "
                f"changed from {saved.get('tensor_model_parallel_size')}/{saved.get('pipeline_model_parallel_size')}"
                f" to {now['tensor_model_parallel_size']}/{now['pipeline_model_parallel_size']}; "
                "set checkpoint.load_optim=false to load the model weights only"
            )
        return True

    def close(self) -> None:
        """Collective: publish (or fail) the save in flight, stop the writer, free the buffers."""
        # A warm-up still talking to the Manager when the process exits dies with EOFError.
        self._wait_warm()
        try:
            self.finalize(blocking=True)
        finally:
            self._stager.close()
