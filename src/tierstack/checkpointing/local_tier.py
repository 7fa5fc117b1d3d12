"""LOCAL tier: nvidia-resiliency-ext ``LocalCheckpointManager`` on node-local storage.

Each rank writes its own file (``<local_dir>/<rank>/iter_N_<rank>_local.pt``) holding a megatron-core
``MCoreTensorAwareStateDict`` built with ``algo="fully_parallel"`` (data-parallel replicas write their
shard once and exchange at load). TrainState, scheduler and per-rank RNG ride in the same file. The
library writes ``*.dirty`` and renames (its staging); a manifest written after it seals the step.

Retention: the library's own cleanup deletes every older step once a save succeeds (it keeps one);
:class:`_RetainingLocalManager` turns that off and :mod:`retention` keeps ``most_recent_k`` after the
manifest is written. A LOCAL checkpoint only loads at the topology it was written with.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager

from tierstack.checkpointing import layout, manifest, retention, retry
from tierstack.checkpointing import state as ckpt_state
from tierstack.checkpointing.types import Candidate, CheckpointTier, TrainingObjects
from tierstack.config import ConfigContainer
from tierstack.platform import ParallelLayout

log = logging.getLogger(__name__)


class _RetainingLocalManager(LocalCheckpointManager):
    """NVRx manager whose post-save cleanup keeps everything; tierstack applies most_recent_k itself,
    after its manifest is sealed, so a step is never deleted before a newer one is complete."""

    def _cleanup(self, iteration):  # noqa: D401 - library hook
        return None


class LocalTier:
    tier = CheckpointTier.LOCAL

    def __init__(self, cfg: ConfigContainer, layout_: ParallelLayout):
        self.cfg = cfg
        self.layout = layout_
        self.root = Path(cfg.checkpoint.local_dir) if cfg.checkpoint.local_dir else None
        self._mgr = _RetainingLocalManager(self.root, session_id="") if self.root is not None else None
        self.failures: list[int] = []

    @property
    def enabled(self) -> bool:
        return self.root is not None

    @property
    def rank_dir(self) -> Path:
        return self.root / str(self.layout.rank)

    def _paths(self, step: int) -> tuple[Path, Path]:
        r = self.layout.rank
        return self.rank_dir / layout.local_file_name(step, r), self.rank_dir / layout.local_manifest_name(step, r)

    # ------------------------------------------------------------------ save
    def save(self, objs: TrainingObjects, *, run_id: str) -> Optional[float]:
        if self.root is None:
            return None
        c = self.cfg.checkpoint
        t0 = time.perf_counter()
        step = objs.train_state.step
        captured = dict(objs.train_state.state_dict())

        def attempt(n: int) -> None:
            retry.run_agreed(lambda: self._remove_step(step, include_dirty=True))
            from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

            sd = ckpt_state.build(objs, is_loading=False, optim=c.save_optim, rng=c.save_rng)
            tasd, _ = MCoreTensorAwareStateDict.from_state_dict(sd, algo="fully_parallel")
            self._mgr.latest_iteration = -1  # a cache of the library; our resume selection owns "latest"
            request = self._mgr.save(tasd, step, is_async=True)  # returns the write as a request: we run it
            retry.run_agreed(lambda: request.async_fn(*request.async_fn_args, **request.async_fn_kwargs))
            # The library's finalize checks (collectively) that every rank holds the step.
            retry.run_agreed(lambda: [fn() for fn in request.finalize_fns])
            retry.run_agreed(lambda: self._seal(step, run_id, captured, objs))

        def cleanup(n: int, failed: retry.SaveAttemptFailed) -> None:
            log.warning("LOCAL save of step %d, attempt %d failed: %s", step, n, failed)
            self._remove_step(step, include_dirty=True)

        try:
            retry.run_attempts(attempt, attempts=c.save_retries, backoff_s=c.retry_backoff_s, on_failure=cleanup)
        except retry.SaveAttemptFailed as e:
            log.error("LOCAL checkpoint of step %d NOT saved (%s)", step, e)
            self.failures.append(step)
            return None
        if self.layout.local_rank == 0:
            layout.write_run_file(self.root, run_id)
        try:
            retention.prune_local(self.rank_dir, self.layout.rank, run_id, step, c.most_recent_k)
        except OSError as e:
            log.warning("LOCAL retention after step %d failed: %s", step, e)
        blocked = time.perf_counter() - t0
        if self.layout.rank == 0:
            log.info("LOCAL checkpoint of step %d saved under %s (blocked %.2fs)", step, self.root, blocked)
        return blocked

    def _seal(self, step: int, run_id: str, train_state: dict, objs: TrainingObjects) -> None:
        ckpt, man_path = self._paths(step)
        man = manifest.build_manifest(
            tier=self.tier.value, step=step, run_id=run_id, topology=self.layout.topology(),
            train_state=train_state, files=manifest.describe_files(self.rank_dir, [ckpt.name]),
            rank=self.layout.rank, has_optimizer=self.cfg.checkpoint.save_optim,
            has_rng=self.cfg.checkpoint.save_rng,
            distributed_optimizer=ckpt_state.uses_distributed_optimizer(objs.optimizer),
        )
        manifest.write_manifest(man_path, man)

    def _remove_step(self, step: int, include_dirty: bool) -> None:
        ckpt, man_path = self._paths(step)
        victims = [ckpt, man_path]
        if include_dirty:
            victims.append(ckpt.with_name(ckpt.name.replace("_local.pt", "_local.dirty.pt")))
        for p in victims:
            p.unlink(missing_ok=True)

    def finalize(self, blocking: bool) -> None:
        return None  # LOCAL saves are synchronous: node-local disk is fast

    def close(self) -> None:
        return None

    # ------------------------------------------------------------------ resume
    def candidates(self, run_id: Optional[str]) -> list[Candidate]:
        if self.root is None or not self.rank_dir.is_dir():
            return []
        out = []
        for p in self.rank_dir.iterdir():
            parsed = layout.parse_local_file(p.name)
            if parsed is None or parsed[1] != self.layout.rank:
                continue
            step = parsed[0]
            man_path = self._paths(step)[1]
            man = layout.read_json(man_path)
            problem = manifest.check_manifest(man, step=step)
            foreign = man is not None and run_id is not None and man.get("run_id") != run_id
            if problem is None and not foreign and man["topology"] != self.layout.topology():
                problem = "topology-changed"
            out.append(Candidate(self.tier, step, p, man, "other-run" if foreign else problem, foreign))
        return out

    def verify(self, cand: Candidate) -> Optional[str]:
        return manifest.check_files(self.rank_dir, cand.manifest["files"])

    def quarantine(self, cand: Candidate, reason: str) -> None:
        for p in self._paths(cand.step):
            if p.exists():
                layout.quarantine(p, reason)
        log.warning("LOCAL checkpoint step %d of rank %d is invalid (%s): quarantined", cand.step, self.layout.rank, reason)

    def load(self, step: int, objs: TrainingObjects) -> str:
        c = self.cfg.checkpoint
        man = layout.read_json(self._paths(step)[1]) or {}
        optim = c.load_optim and man.get("has_optimizer", True)
        rng = c.load_rng and man.get("has_rng", True)
        self._mgr.latest_iteration = step  # load exactly this step (agreed by resume selection)
        tasd, _ = self._mgr.load()
        sd = ckpt_state.build(objs, is_loading=True, optim=optim, rng=rng)
        loaded = tasd.to_state_dict(sd, algo="fully_parallel")
        ckpt_state.apply(objs, loaded, optim=optim, rng=rng)
        self._mgr.latest_iteration = -1
        return str(self.root)
