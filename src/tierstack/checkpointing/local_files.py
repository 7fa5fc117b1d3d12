"""LOCAL tier: this rank's files of one step, written and sealed on the writer thread, or removed.

:class:`LocalFiles` is a base of :class:`~tierstack.checkpointing.local_tier.LocalTier` and uses
its attributes (``cfg``, ``layout``, ``root``, ``tier``, ``_abandoned``). Layout (the
nvidia-resiliency-ext one): ``<local_dir>/<rank>/iter_N_<rank>_local.pt`` and its manifest beside
it; a file being written is ``.dirty`` until it is renamed.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Optional

from tierstack.checkpointing import errors, local_file, manifest, paths, retention
from tierstack.runtime import collectives

log = logging.getLogger(__name__)


class LocalFiles:
    """Where this rank's LOCAL files of a step are, how they are written and sealed (with retries
    of transient I/O errors), and how they are removed (never another run's)."""

    @property
    def rank_dir(self) -> Path:
        return self.root / str(self.layout.rank)

    def _paths(self, step: int) -> tuple[Path, Path]:
        r = self.layout.rank
        return self.rank_dir / paths.local_file_name(step, r), self.rank_dir / paths.local_manifest_name(step, r)

    def _write_and_seal(self, step: int, run_id: str, train_state: dict, header: bytes, buffers: list,
                        extra: dict, room: Optional[tuple] = None) -> int:
        """Writer thread: write this rank's file and manifest; transient I/O errors retried here.
        ``room``: :meth:`_room_plan`'s plan when some rank is short of room (carried out first)."""
        c = self.cfg
        ckpt, man_path = self._paths(step)
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        # (the retention thread may still delete sealed or quarantined files here: never the same files)
        try:  # nothing of this tier is in flight: what an interrupted save left is not a checkpoint
            paths.remove_leftovers(self.rank_dir, run_id)
        except OSError as e:  # listing the folder failed: the write below reports what is wrong
            log.warning("LOCAL leftovers in %s not cleaned: %s", self.rank_dir, e)
        for old in sorted(self._abandoned - {step}):  # this rank's part of an interrupted save
            log.info("removing rank %d's LOCAL files of step %d, left by an interrupted save", self.layout.rank, old)
            self._remove_step(old, run_id)
        self._abandoned.clear()
        if room is not None:
            self._make_room(step, run_id, room)
        theirs = self._owner(step)
        if theirs not in (None, run_id):  # another run's checkpoint is never replaced or deleted
            raise FileExistsError(f"{ckpt} holds a LOCAL checkpoint of run {theirs}, not of this run ({run_id}); "
                                  "not replaced: use another checkpoint.local_dir")
        for n in range(1, max(1, c.save_retries) + 1):
            try:  # a failed removal of the last attempt's files is this attempt's failure, classified alike
                self._remove_step(step, run_id)
                entry = local_file.write(ckpt, header, buffers)
                man = manifest.build_manifest(
                    tier=self.tier.value, step=step, run_id=run_id, topology=self.layout.topology(),
                    train_state=train_state, files={ckpt.name: entry}, rank=self.layout.rank, **extra)
                manifest.write_manifest(man_path, man)
                if n > 1:
                    log.warning("LOCAL write of step %d on rank %d: attempt %d succeeded", step, self.layout.rank, n)
                return int(entry["size"])
            except Exception as e:  # noqa: BLE001 - classified: transient ones are retried
                if n >= c.save_retries or errors.classify(e) != errors.TRANSIENT:
                    self._discard_step(step, run_id)
                    raise
                log.warning("LOCAL write of step %d on rank %d, attempt %d failed (%s); retrying",
                            step, self.layout.rank, n, errors.describe(e))
                time.sleep(c.retry_backoff_s * 2 ** (n - 1))
        raise AssertionError("unreachable")

    def _room_plan(self, step: int, run_id: str, nbytes: int) -> Optional[tuple[int, list[int], int]]:
        """Collective, on the training thread before the file save of ``step`` is handed off: whether
        any rank's file system has less room than its node's ranks write for one step (``nbytes`` of
        each rank's file, times ``checkpoint.replication_factor`` for the replicas they receive).

        Returns None when every rank has room (one all-reduce), else ``(keep, doomed, own_need)``
        for :meth:`_make_room`: ``keep``, the newest step sealed by this process, or before any,
        the newest step whose file every rank holds (all-gathered); ``doomed``, this rank's own steps
        of ``run_id`` older than ``keep``. Every rank removes its steps older than the same
        ``keep`` (a check of each rank's own free space left one rank's copy of a step removed and
        the other's kept, which ``checkpoints verify`` reports as damaged). ``most_recent_k=-1``
        (keep all) or no such ``keep``: nothing but quarantined entries of this run."""
        need = (nbytes + 2 ** 16) * max(1, self.cfg.replication_factor)
        free = retention.free_bytes(self.rank_dir) if self.rank_dir.exists() else retention.free_bytes(self.root)
        short = free is not None and free < need * self.layout.ranks_per_node
        if not collectives.any_true(short):  # the usual case
            return None
        own = retention.own_local_steps(self.rank_dir, self.layout.rank, run_id) if self.rank_dir.exists() else []
        held = [set(x) for x in collectives.all_gather_object([s for s in own if s < step])]
        common = set.intersection(*held) if held else set()
        keep = max(self.sealed) if self.sealed else max(common, default=None)
        doomed = [s for s in own if keep is not None and s < keep] if self.cfg.most_recent_k != -1 else []
        return (keep if self.cfg.most_recent_k != -1 else None), doomed, need

    def _make_room(self, step: int, run_id: str, plan: tuple[int, list[int], int]) -> list[str]:
        """Writer thread, before writing step ``step``: carry out :meth:`_room_plan`'s ``plan``: every
        one of ``doomed`` (this rank's steps older than ``keep``) and the replicas of steps before
        ``keep`` this rank keeps for other ranks, then, as long as room is short, this run's
        quarantined entries (:func:`~tierstack.checkpointing.retention.make_room`; each removal
        logged). The step ``keep`` itself is never removed."""
        keep, doomed, need = plan
        d, r = self.rank_dir, self.layout.rank
        forced = [(f"rank {r}'s LOCAL checkpoint of step {s}", functools.partial(retention.remove_local_step, d, r, s))
                  for s in doomed]
        if keep is not None and self._replication is not None:
            rep = self._replication
            forced.append((f"the replicas of steps before {keep} that rank {r} keeps for other ranks",
                           functools.partial(rep.store.prune, rep.replicator.clique, run_id, keep, 1)))
        quarantined = [(f"quarantined {p}", functools.partial(retention.remove_quarantined, p))
                       for p in retention.quarantined(d, run_id)]
        return retention.make_room(d, need * self.layout.ranks_per_node, quarantined,
                                   f"LOCAL checkpoint of step {step} on rank {r}", forced=forced, own_need=need)

    def _owner(self, step: int) -> Optional[str]:
        """The run id in this rank's manifest of ``step``; None when there is no manifest."""
        man = paths.read_json(self._paths(step)[1])
        return None if man is None else str(man.get("run_id"))

    def _remove_step(self, step: int, run_id: str) -> None:
        """Remove this rank's files of ``step`` unless a manifest names another run (left alone)."""
        if self._owner(step) not in (None, run_id):
            return
        ckpt, man_path = self._paths(step)
        for p in (man_path, ckpt, ckpt.with_name(ckpt.name.replace("_local.pt", "_local.dirty.pt"))):
            p.unlink(missing_ok=True)

    def _discard_step(self, step: int, run_id: str) -> None:
        """:meth:`_remove_step` after a failed save: an ``OSError`` there (EIO, EROFS, ...) is logged,
        never raised, so the save's own failure is what every rank agrees on and reports.

        Files left behind are not a checkpoint: the step never sealed on every rank, and the next
        save of this step or of any step removes them (leftovers of an interrupted save).
        """
        try:
            self._remove_step(step, run_id)
        except OSError as e:
            log.error("LOCAL files of failed step %d on rank %d not removed: %s", step, self.layout.rank,
                      errors.describe(e))
