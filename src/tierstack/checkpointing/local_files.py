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
                        extra: dict) -> int:
        """Writer thread: write this rank's file and manifest; transient I/O errors retried here."""
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
        self._make_room(step, run_id, len(header) + sum(b.nbytes for b in buffers))
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

    def _make_room(self, step: int, run_id: str, nbytes: int) -> list[str]:
        """Writer thread, before writing step ``step`` (``nbytes`` bytes of this rank): when its file
        system has less room than this node's ranks write for one step (their files and the replicas
        they receive, ``checkpoint.replication_factor``), remove what a resume does not need, until
        there is: this rank's quarantined entries, then its own steps of ``run_id`` older than the
        newest sealed one (oldest first), then the replicas of those steps it keeps for other
        ranks (:func:`~tierstack.checkpointing.retention.make_room`). The newest step sealed by this
        process is never removed, nor, before any, this rank's newest file of the run (the run may have
        resumed from it); with ``most_recent_k=-1`` (keep all) only quarantined entries are."""
        d, r = self.rank_dir, self.layout.rank
        need = (nbytes + 2 ** 16) * self.layout.ranks_per_node * max(1, self.cfg.replication_factor)
        free = retention.free_bytes(d)
        if free is None or free >= need:  # the usual case: one statvfs, nothing listed
            return []
        own = retention.own_local_steps(d, r, run_id)
        keep = max(self.sealed) if self.sealed else max((s for s in own if s < step), default=None)
        removals = [(f"quarantined {p}", functools.partial(retention.remove_quarantined, p))
                    for p in retention.quarantined(d)]
        if keep is not None and self.cfg.most_recent_k != -1:
            older = [s for s in own if s < keep]
            removals += [(f"rank {r}'s LOCAL checkpoint of step {s}", functools.partial(retention.remove_local_step, d, r, s))
                         for s in older]
            if self._replication is not None:
                rep = self._replication
                removals.append((f"the replicas of steps before {keep} that rank {r} keeps for other ranks",
                                 functools.partial(rep.store.prune, rep.replicator.clique, run_id, keep, 1)))
        return retention.make_room(d, need, removals, f"LOCAL checkpoint of step {step} on rank {r}")

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
