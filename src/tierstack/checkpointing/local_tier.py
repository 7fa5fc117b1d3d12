"""LOCAL tier: per-rank checkpoints on node-local storage (or a tmpfs), saved asynchronously.

Each rank writes its own file (``<local_dir>/<rank>/iter_N_<rank>_local.pt``, the nvidia-resiliency-ext
layout) holding a megatron-core ``MCoreTensorAwareStateDict`` (NVRx's ``TensorAwareStateDict``) built
with ``algo="fully_parallel"``: data-parallel replicas write their shard once and exchange at load.
TrainState, scheduler and per-rank RNG ride in the same file; a manifest beside it seals the step.

A save (see DESIGN.md, "Asynchronous LOCAL"): the blocking part builds the state dict, pops its
tensors, copies them into the tier's reused staging buffers (:mod:`staging`) and encodes the header;
the writer thread then writes ``.dirty``, fsyncs, renames and writes this rank's manifest
(:mod:`local_files`, :mod:`local_file`: CRC-32C of the bytes as they are written). :meth:`LocalTier.finalize`, called
by the loop, agrees across ranks that every rank sealed the step (a step missing on one rank is
never a resume candidate), then applies retention. At most one save is in flight.

Kept from NVRx: the ``TensorAwareStateDict`` protocol (``pop_tensors`` / ``insert_tensors``,
``to_state_dict`` with the fully-parallel exchange) and the file layout. Not kept:
``LocalCheckpointManager.save`` clones every tensor at each save (no reused buffers), writes with
``torch.save`` without fsync, forks a writer per save on CPU; its ``load`` reads a file twice.
Under in-process restart the newest sealed step is also kept in memory, and with
``checkpoint.memory_save_interval`` memory steps are staged between the files (:mod:`local_memory`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from tierstack.checkpointing import compat, local_exchange, local_file, local_memory, local_replicas, manifest
from tierstack.checkpointing import model_settings, node_memory, paths, retention, retry, rewind
from tierstack.checkpointing import state as ckpt_state
from tierstack.checkpointing.local_files import LocalFiles
from tierstack.checkpointing.staging import StagedTier
from tierstack.checkpointing.types import Candidate, CheckpointTier, TrainingObjects
from tierstack.config import CheckpointConfig
from tierstack.runtime import ParallelLayout
from tierstack.runtime import collectives

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    step: int
    run_id: str
    started: float  # perf_counter at the start of the save
    blocked_s: float
    job: Future
    timed_out: Optional[BaseException] = None  # set by StagedTier._take_ended after the write timeout


class LocalTier(LocalFiles, StagedTier):
    """The LOCAL tier (see the module docstring); implements :class:`CheckpointTierHandler`.

    Args:
        cfg: the ``checkpoint`` section (``local_dir``, ``local_save_interval``, ``most_recent_k``, ...).
        parallel_layout: this rank's layout; a LOCAL checkpoint loads only at the same one.
        run_config: the whole run config as plain dicts; its tokenizer and config go into every
            manifest (:func:`~tierstack.checkpointing.compat.manifest_fields`); empty: nothing recorded.
    """

    tier = CheckpointTier.LOCAL
    persistent = False  # node-local: lost with the node
    per_rank_files = True

    def __init__(self, cfg: CheckpointConfig, parallel_layout: ParallelLayout, *,
                 run_config: Optional[Mapping[str, Any]] = None):
        super().__init__("LOCAL", cfg.async_write_timeout_s)
        self.cfg = cfg
        self.layout = parallel_layout
        self.run_config = run_config or {}
        self.root = Path(cfg.local_dir) if cfg.local_dir else None
        self._node_dir = (node_memory.rank_dir(cfg.memory_dir, self.root, parallel_layout.rank)
                          if cfg.memory_dir and self.root is not None else None)  # memory steps in node memory
        self._stager = local_memory.stager_for(self._stager, self._node_dir)  # more sets under in-process restart
        if self._node_dir is not None and local_memory.enabled():
            node_memory.use_dir(self._node_dir)  # swept at the run's end, whatever this process put there
        if self._node_dir is not None and parallel_layout.rank_on_node == 0:
            node_memory.warn_unless_tmpfs(cfg.memory_dir)
        self._distribution = None  # NVRx/megatron fully-parallel shard distribution, computed once
        self._extra: Optional[tuple] = None  # (model, optimizer, manifest fields), see _manifest_extra
        self._verified: dict[int, object] = {}  # step -> file bytes read by verify(), for load()
        self.sealed: list[int] = []  # steps sealed on every rank by this process
        self._run_id = ""  # the run of those steps
        self._abandoned: set[int] = set()  # interrupted saves found at resume: removed by the next save
        self._replication = None  # checkpoint.replication_factor > 1: copies on other nodes
        if self.root is not None and cfg.replication_factor > 1:
            from tierstack import runtime

            self._replication = local_replicas.LocalReplication(
                self.root, cfg.replication_factor, cfg.replication_jump or parallel_layout.ranks_per_node,
                parallel_layout.rank, parallel_layout.world_size, on_writer=not runtime.has_gpu(),
                writer_timeout_s=cfg.async_write_timeout_s, local_rank=parallel_layout.rank_on_node,
                ranks_per_node=parallel_layout.ranks_per_node)

    @property
    def enabled(self) -> bool:
        return self.root is not None

    @property
    def saves(self) -> bool:
        return self.root is not None

    @property
    def interval(self) -> Optional[int]:
        return self.cfg.local_save_interval

    @property
    def run_root(self) -> Optional[Path]:
        return self.root

    def claim(self, run_id: str) -> None:
        """Local rank 0 of each node writes the run file of a fresh run into the (node-local) root."""
        if self.root is not None and self.layout.rank_on_node == 0:
            paths.write_run_file(self.root, run_id)

    def saved_steps(self) -> list[int]:
        return list(self.sealed)

    # ------------------------------------------------------------------ save
    def save(self, objs: TrainingObjects, *, run_id: str, in_memory: bool = False) -> Optional[float]:
        """Collective: stage ``objs`` and hand the write to the writer thread.

        ``in_memory``: a memory step (:mod:`local_memory`): staged like a file save, checked for
        NaN/inf and agreed here, then kept in host memory only; it neither waits for nor finalizes
        a file save in flight (it stages into a set the writer does not read).

        Returns the seconds the caller was blocked (waiting for the previous save included), or
        None when staging failed on some rank (nothing was handed off).
        """
        if self.root is None:
            return None
        t0 = time.perf_counter()
        if not in_memory:
            self.finalize(blocking=True)  # one save in flight per tier; reports the previous one's end
        step = objs.train_state.step
        captured = dict(objs.train_state.state_dict())
        try:
            staged = retry.run_agreed(lambda: self._stage(objs))
        except retry.SaveAttemptFailed as e:
            log.error("LOCAL checkpoint of step %d NOT saved: staging failed (%s)", step, e)
            self.failures.append(step)
            return None
        extra = self._manifest_extra(objs)
        if in_memory:  # its manifest stays in memory with it
            self._seal_in_memory(step, run_id, staged["sources"], manifest.build_manifest(
                tier=self.tier.value, step=step, run_id=run_id, topology=self.layout.topology(),
                train_state=captured, files={}, rank=self.layout.rank, in_memory=True, **extra))
            return time.perf_counter() - t0
        then = None if self._replication is None else self._replication.writer_step(step)
        room = self._room_plan(step, run_id, len(staged["header"]) + sum(b.nbytes for b in staged["buffers"]))
        job = self._submit_checked(f"LOCAL checkpoint of step {step}", self._write_and_seal, step, run_id,
                                   captured, staged["header"], staged["buffers"], extra, room, then=then)
        blocked = time.perf_counter() - t0
        self._in_flight = _InFlight(step, run_id, t0, blocked, job)
        if self.layout.rank == 0:
            log.info("LOCAL checkpoint of step %d handed to the writer (blocked %.2fs)", step, blocked)
        return blocked

    def _manifest_extra(self, objs: TrainingObjects) -> dict:
        """The manifest fields that depend on the model, optimizer and run config only: computed
        once per model and optimizer (a memory step every iteration paid ~1 ms for them)."""
        if self._extra is None or self._extra[0] is not objs.model or self._extra[1] is not objs.optimizer:
            fields = {"has_optimizer": self.cfg.save_optim, "has_rng": self.cfg.save_rng,
                      "distributed_optimizer": ckpt_state.uses_distributed_optimizer(objs.optimizer),
                      **model_settings.model_settings(objs.model),
                      **compat.manifest_fields(self.run_config)}  # tokenizer and config, compared before a resume
            self._extra = (objs.model, objs.optimizer, fields)
        return dict(self._extra[2])

    def _stage(self, objs: TrainingObjects) -> dict:
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

        c = self.cfg
        sd = ckpt_state.build(objs, is_loading=False, optim=c.save_optim, rng=c.save_rng)
        tasd, self._distribution = MCoreTensorAwareStateDict.from_state_dict(
            sd, algo="fully_parallel", cached_metadata=self._distribution)
        sources = tasd.pop_tensors()
        buffers = self._stager.stage(sources)
        header = local_file.encode_header(tasd, buffers)
        local_memory.note_staged(self._stager, objs.train_state.step, header)
        return {"header": header, "buffers": buffers, "sources": sources}

    def finalize(self, blocking: bool) -> None:
        """Collective: when the in-flight save has ended on every rank (or ``blocking``), agree on it.

        Sealed everywhere: the step counts as saved and retention runs. Failed anywhere: every rank
        removes its files of that step and the step is recorded in ``failures`` (in ``nonfinite``
        with the ranks, when a writer found NaN/inf in the staged state: nothing of it was written).
        """
        job: Optional[_InFlight] = self._take_ended(blocking)
        if job is None:
            return
        error = self._job_error(job)
        self._log_writer_error(job.step, error)
        reason, nonfinite = None, []
        try:
            retry.agree(error)  # the writer already retried transient errors; every rank learns each cause
        except retry.SaveAttemptFailed as e:
            reason, nonfinite = str(e), self._nonfinite_ranks(job)
        if reason is None and job.step in self._vetoed:  # blocked in another tier: not kept here either
            self._discard_step(job.step, job.run_id)
            if self._replication is not None:
                self._replication.remove(job.step, "blocked")
            log.error("LOCAL checkpoint of step %d discarded on every rank: the non-finite guard blocked that step",
                      job.step)
            return
        if reason is None and self._replication is not None and not self._replication.seal(job.step):
            reason = "replication to the other nodes failed on some rank"
        if reason is not None:
            self._discard_step(job.step, job.run_id)
            if self._replication is not None:  # what the writers stored of the failed step
                self._replication.remove(job.step, "failed")
                self._replication.reset_writer()  # every rank: the next save exchanges on new groups
            if nonfinite:  # not a failed save: the guard's verdict (the manager applies on_nonfinite)
                self.nonfinite.append((job.step, nonfinite))
                return
            log.error("LOCAL checkpoint of step %d NOT saved (%s); the previous one stays the newest", job.step, reason)
            self.failures.append(job.step)
            return
        self.sealed.append(job.step)
        local_memory.note_sealed(self._stager, step=job.step, run_id=job.run_id, rank=self.layout.rank,
                                 root=self.root, topology=self.layout.topology())
        self._run_id = job.run_id
        self.last_durable_s, self.last_blocked_s = time.perf_counter() - job.started, job.blocked_s
        if self.layout.rank_on_node == 0:
            paths.write_run_file(self.root, job.run_id)
        budget = self.cfg.quarantine_budget_bytes
        budget = int(job.job.result()) if budget is None else budget
        rank_dir, rank, run_id, step, k = self.rank_dir, self.layout.rank, job.run_id, job.step, self.cfg.most_recent_k
        replicas = (lambda: None) if self._replication is None else (lambda: self._replication.prune(run_id, step, k))
        self._retain_when_settled(step, lambda: (retention.prune_local(rank_dir, rank, run_id, step, k),
                              replicas(), retention.prune_quarantined(rank_dir, budget)), f"after step {step}")
        if self.layout.rank == 0:
            where = (f"each node's checkpoint.local_dir ({self.root} on rank 0's node)"
                     if self.layout.num_nodes > 1 else str(self.root))
            log.info("LOCAL checkpoint of step %d sealed on every rank under %s (blocked %.2fs, durable after %.2fs)",
                     job.step, where, job.blocked_s, self.last_durable_s)

    def _seal_in_memory(self, step: int, run_id: str, sources: list, memory_manifest: dict) -> None:
        """Collective: a memory step just staged is held in memory (no file, no replica) when its
        state is finite on every rank; otherwise it is the guard's verdict (``nonfinite``, applied
        by the manager as for a file save) and the step held before stays. ``sources``: the live
        tensors it was staged from, unchanged since (the copy has landed): on a GPU the check
        runs there, not over the host copy."""
        from tierstack.checkpointing.nonfinite_guard import NonFiniteStateError, check_staged

        try:
            check_staged(sources, f"LOCAL memory step {step}")
            bad = False
        except NonFiniteStateError as e:
            log.error("%s", e)
            bad = True
        ranks = collectives.ranks_where(bad)
        if ranks:
            self.nonfinite.append((step, ranks))
        elif step not in self._vetoed:
            local_memory.note_sealed(self._stager, step=step, run_id=run_id, rank=self.layout.rank,
                                     root=self.root, topology=self.layout.topology(), manifest=memory_manifest)

    def veto(self, step: int) -> None:
        super().veto(step)
        local_memory.forget_newer(step - 1)  # a held memory step of ``step`` (or newer) is not resumed

    def _unseal(self, step: int) -> None:
        """This rank's sealed files of ``step`` (and the replicas it holds of it) are removed: the
        guard blocked the step (:meth:`veto`)."""
        self._discard_step(step, self._run_id)
        if self._replication is not None:
            self._replication.remove(step, "blocked")
        self.sealed.remove(step)
        log.error("LOCAL checkpoint of step %d removed on rank %d: the non-finite guard blocked that step",
                  step, self.layout.rank)

    # ------------------------------------------------------------------ resume
    def prepare_resume(self, run_id: str) -> None:
        """Collective: with replication, each node's files are first moved to where this launch's
        layout looks for them (the rendezvous may have given the node another index), then the ranks
        that miss their file of the newest step every rank can obtain retrieve it from a replica
        (:func:`local_replicas.retrieve_for_resume`; it checks this rank's own file, kept for verify)."""
        self._verified.clear()  # every (re)start selects afresh: nothing read before counts
        if self._replication is not None:
            self._replication.retrieve_for_resume(run_id)
            self._verified, self._replication.store.verified = self._replication.store.verified, {}

    def candidates(self, run_id: Optional[str]) -> list[Candidate]:
        held = None if self.root is None else local_memory.memory_candidate(
            run_id, self.layout.rank, self.root, self.layout.topology(), self.rank_dir, self._node_dir)
        out = [] if held is None else [held]  # a memory step this process holds (it has no file)
        if self.root is None or not self.rank_dir.is_dir():
            return out
        for p in self.rank_dir.iterdir():
            parsed = paths.parse_local_file(p.name)
            if parsed is None or parsed[1] != self.layout.rank:
                continue
            step = parsed[0]
            man_path = self._paths(step)[1]
            man = paths.read_json(man_path)
            problem = manifest.check_manifest(man, step=step)
            foreign = man is not None and run_id is not None and man.get("run_id") != run_id
            if problem is None and not foreign and man["topology"] != self.layout.topology():
                problem = "topology-changed"
            out.append(Candidate(self.tier, step, p, man, "other-run" if foreign else problem, foreign))
        return out

    def verify(self, cand: Candidate) -> Optional[str]:
        """Read this rank's file once, checking size and checksum; the bytes are kept for :meth:`load`.

        This read *is* the load's read: resume selection verifies every rank's file (and quarantines
        on failure) before any state changes, and the load decodes the bytes verified here. The
        file's pickled part is decoded here too, weights-only (:mod:`safe_load`), so a file that
        asks for code is refused in selection, like a damaged one, and the next candidate is tried.
        """
        data, self._verified = self._verified.get(cand.step), {}  # checked already by prepare_resume, or read now
        if self._held(cand.step, cand.manifest.get("run_id")) is not None:
            return None  # this process holds the step, sealed: resumed from memory, no file read
        (name, entry), = cand.manifest["files"].items()
        try:
            data = local_file.read_verified(self.rank_dir / name, entry) if data is None else data
            local_file.decode(data, self.rank_dir / name)  # weights-only: an unsafe pickle is refused here
            self._verified[cand.step] = data
        except FileNotFoundError:
            return f"missing-file {name}"
        except local_file.LocalFileError as e:
            return str(e)  # "<reason> <file> ..."; the first word names the quarantine
        except OSError as e:
            return f"unreadable {name} ({e.strerror})"
        return None

    def interrupted_steps(self) -> list[int]:
        """Steps whose write this rank left unfinished (a ``.dirty`` file; not collective)."""
        return [] if self.root is None else paths.interrupted_local_steps(self.rank_dir, self.layout.rank)

    def abandon(self, step: int) -> None:
        """``step`` is an interrupted save (sealed on some ranks, a ``.dirty`` file on another): this
        rank's files of it are leftovers, removed by the next LOCAL save (not collective)."""
        self._abandoned.add(step)

    def quarantine(self, cand: Candidate, reason: str) -> None:
        for p in self._paths(cand.step):
            if p.exists():
                paths.quarantine(p, reason)
        log.info("LOCAL checkpoint step %d: rank %d's files quarantined (%s)", cand.step, self.layout.rank, reason)

    def rewind(self, step: int, run_id: str) -> Optional[list[int]]:
        """This rank's newer files and the replicas it keeps of them (:func:`rewind.move_aside_local`)."""
        if self.root is None:
            return None
        local_memory.forget_newer(step)
        return rewind.move_aside_local(self.rank_dir, self.candidates(run_id), step, run_id,
                                       self._replication)

    def load(self, step: int, objs: TrainingObjects) -> str:
        c = self.cfg
        man = (local_memory.memory_manifest(step, self.layout.rank, self.root, self.layout.topology())
               or paths.read_json(self._paths(step)[1]) or {})
        optim = c.load_optim and man.get("has_optimizer", True)
        rng = c.load_rng and man.get("has_rng", True)
        if c.load_rng and not man.get("has_rng", True):
            ckpt_state.warn_no_rng(step, self.tier.value)
        ckpt = self._paths(step)[0]
        model_settings.check_load(man, model_settings.model_settings(objs.model), optim=optim, where=str(ckpt),
                                  casts_weights=False)
        held, data = self._held(step, man.get("run_id")), self._verified.pop(step, None)
        if held is None and data is None:  # not verified in this process (a direct load): verify now, one read
            (name, entry), = man["files"].items()
            data = local_file.read_verified(self.rank_dir / name, entry)
        self._verified.clear()
        tasd = local_memory.decode(held, ckpt) if held is not None else local_file.decode(data, ckpt)
        sd = ckpt_state.build(objs, is_loading=True, optim=optim, rng=rng)
        before = ckpt_state.optimizer_state_tensors(objs.optimizer) if optim else {}
        local_exchange.fill_missing(tasd)  # replicas another rank saved: a few packed broadcasts
        loaded = tasd.to_state_dict(sd, algo="atomic")  # every tensor is here now: no per-tensor exchange
        del tasd
        ckpt_state.apply(objs, loaded, optim=optim, rng=rng)
        del loaded
        if optim:  # no view of the file or of the held buffers
            ckpt_state.own_optimizer_state(objs.optimizer, before, held.sources() if held is not None else data)
        del data
        return str(self.root)

    def _held(self, step: int, run_id: Optional[str]):  # this rank's step held in memory, or None
        return local_memory.match(step, run_id, self.layout.rank, self.root, self.layout.topology())
