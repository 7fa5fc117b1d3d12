"""The LOCAL tier's replicas on disk, and the two collective steps that use them.

Layout under ``checkpoint.local_dir`` (beside the rank folders)::

    replicas/<owner>/iter_0000020_<owner>_local.pt              the owner's file, byte for byte
    replicas/<owner>/iter_0000020_<owner>_local.manifest.json   the owner's manifest

- :func:`exchange_step` (on the LOCAL writer thread right after the write on CPU; in the LOCAL
  finalize on GPU, :func:`replicate_step`): each rank sends its file to its clique
  (:class:`~tierstack.checkpointing.replication.Replicator`), checks every received copy against
  its owner's CRC-32C and writes it; the step is sealed only when every rank stored every replica.
- :func:`retrieve_for_resume` (before resume selection): the ranks gather what each holds, agree on
  the newest step that *every* rank can obtain (its own file, or a copy on a member of its clique),
  and the ranks missing their file of that step receive it from a member that holds it. A received
  copy is checked like a local file; a damaged one is not used (the log says so) and the ranks try
  the next older step every rank can obtain; with none left, selection falls back to GLOBAL.
- :class:`LocalReplication` is what the LOCAL tier holds: the two above, the replicas' removal and
  retention, and where the exchange runs (writer thread on CPU, finalize on GPU).

Which node a rank runs on is not fixed: torchrun's rendezvous decides which agent becomes which
node (``GROUP_RANK``) at every launch and restart, and a requeued job may land on other hosts. So
at resume, before the holdings are gathered, :meth:`ReplicaStore.normalize` (one rank per node)
puts what the node-local root holds where this launch's layout looks for it: a rank's own file
found under ``replicas/<rank>`` of its own node becomes its own file again, and the own folder of a
rank that now runs on another node is held for it as replicas (see :func:`retrieve_for_resume`).

Nothing is cached between calls: every (re)start looks at the disk afresh.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from tierstack.checkpointing import local_file, paths
from tierstack.checkpointing.replication import Replicator, clique_groups
from tierstack.checkpointing.replication import parse_replica_id, replica_id
from tierstack.checkpointing.replica_store import ReplicaStore  # noqa: F401 - re-exported
from tierstack.runtime import collectives as _dist

log = logging.getLogger(__name__)


class ReplicationError(Exception):
    """This rank's part of a LOCAL step's replication failed: its own file could not be read back,
    or a received replica was damaged or could not be written (the message says which)."""


def exchange_step(replicator: Replicator, store: ReplicaStore, step: int, *, have_file: bool = True) -> float:
    """Collective over this rank's clique: send this rank's (written, not yet sealed) file of ``step``
    to the other members, and check (owner's CRC-32C) and store durably every member's file received.

    Every member must call it for every save, even one whose write failed (``have_file`` False:
    nothing is sent, the others refuse the empty copy), so the exchanges of the clique stay paired.
    It runs on the LOCAL writer thread on CPU (the clique groups are gloo's, used by no other thread
    while training) and in the LOCAL finalize on GPU (:func:`replicate_step`).

    Returns:
        Seconds the exchange and the stores took.

    Raises:
        ReplicationError: this rank's part failed (its file unreadable, a received copy damaged or
            not written). The replicas of ``step`` this rank did store stay until the caller removes them.
        CollectiveError: the exchange itself failed (a member gone or hung).
    """
    t0 = time.perf_counter()
    problems = []
    ckpt, man_path = store.paths(step, store.rank)
    man, data = {}, torch.empty(0, dtype=torch.uint8)
    if have_file:
        man = paths.read_json(man_path) or {}
        try:
            (name, entry), = man["files"].items()
            data = local_file.read_verified(ckpt, entry)
        except (OSError, TypeError, KeyError, ValueError, local_file.LocalFileError) as e:
            problems.append(f"this rank's file cannot be read back to replicate it ({e})")
            man, data = {}, torch.empty(0, dtype=torch.uint8)
    received = replicator.replicate(step, man, data)  # every member takes part, even with nothing to send
    for replica in received:
        if not replica.manifest:
            problems.append(f"rank {replica.owner} sent no file of it (its write failed or was blocked)")
            continue
        try:
            store.store(replica)
        except (OSError, KeyError, ValueError) as e:  # LocalFileError is a ValueError
            problems.append(f"replica of rank {replica.owner} not stored ({e})")
    if problems:
        raise ReplicationError(f"LOCAL step {step} on rank {store.rank}: " + "; ".join(problems))
    return time.perf_counter() - t0


def replicate_step(replicator: Replicator, store: ReplicaStore, step: int, io_wait_s: Optional[float] = None) -> bool:
    """Collective over the job, in the LOCAL finalize (the GPU path): :func:`exchange_step`, then the
    ranks agree on it. Each rank reads its whole file and writes every received one meanwhile, so
    these collectives wait ``io_wait_s`` (``checkpoint.async_write_timeout_s``) longer than a
    collective's bound (:func:`tierstack.runtime.collectives.io_phase`).

    Returns:
        True when every replica of the step is stored on every rank (the step may be sealed; the
        caller runs the replicas' retention once the step is settled); on False every rank has
        removed the replicas of the step it stored.
    """
    ok = True
    seconds = 0.0
    with _dist.io_phase(io_wait_s):
        try:
            seconds = exchange_step(replicator, store, step)
        except ReplicationError as e:
            log.error("%s", e)
            ok = False
        agreed = _dist.all_true(ok)
    if not agreed:
        store.remove_replicas(step, replicator.clique)
        return False
    if _dist.rank() == 0:
        log.info("LOCAL checkpoint of step %d replicated (factor %d, cliques of ranks %s apart) in %.2fs",
                 step, replicator.factor, replicator.jump, seconds)
    return True


def _obtainable(held: list[list[str]], cliques: list[list[int]]) -> list[int]:
    """Steps, newest first, whose file of every rank is held by some member of that rank's clique."""
    clique_of = {r: g for g in cliques for r in g}
    steps = None
    for r in range(len(held)):
        mine = {parse_replica_id(i)[0] for m in clique_of[r] for i in held[m] if parse_replica_id(i)[1] == r}
        steps = mine if steps is None else steps & mine
    return sorted(steps or (), reverse=True)


def retrieve_for_resume(replicator: Replicator, store: ReplicaStore, run_id: str) -> Optional[int]:
    """Collective: make the newest step that every rank can obtain present in every rank's folder.

    The ranks agree on the newest step every rank can obtain; each rank checks its own file of it
    (size and checksum: a damaged one is quarantined and counts as missing), and the ranks missing
    their file of it receive it and check it. When a received copy is damaged anywhere, the ranks
    move on to the next older step that every rank can obtain (the damaged copy is never written).

    First, one rank per node (the first of ``store.node_ranks``) moves the node's files to where
    this launch's layout looks for them (:meth:`ReplicaStore.normalize`: the rendezvous may have
    given this node's disk to another node index), and the others wait at a barrier before they
    look at the disk: the ranks of a node share its root.

    Returns:
        The step every rank now holds, or None (nothing every rank can obtain: selection then
        skips LOCAL steps that some rank misses and falls back to GLOBAL).
    """
    if store.rank == store.node_ranks[0]:
        try:
            for line in store.normalize(run_id):
                log.warning("resume: %s", line)
        except OSError as e:  # what was not moved is not found below: logged, and the resume goes on
            log.error("resume: LOCAL files under %s not moved to where rank(s) %s look for them: %s", store.root,
                      list(store.node_ranks), e)
    _dist.barrier()
    held = _dist.all_gather_object(store.holdings(run_id))
    steps = _obtainable(held, clique_groups(replicator.world_size, replicator.factor, replicator.jump))
    if not steps and any(held) and _dist.rank() == 0:
        lacking = [r for r in range(len(held)) if not any(parse_replica_id(i)[1] == r for h in held for i in h)]
        log.warning("resume: no LOCAL step can be obtained by every rank (no file or replica of rank(s) %s "
                    "survives); LOCAL is skipped", lacking or "some")
    for step in steps:
        damaged = [r for r, bad in enumerate(_dist.all_gather_object(_own_file_damaged(store, held, step))) if bad]
        for r in damaged:  # every rank drops them: no plan offers a damaged file
            held[r] = [i for i in held[r] if i != replica_id(step, r)]
        missing = [r for r in range(len(held)) if replica_id(step, r) not in held[r]]
        if not missing:
            return step
        if _dist.all_true(_retrieve_step(replicator, store, held, step, missing)):
            return step
        if _dist.rank() == 0:
            log.warning("resume: LOCAL step %d could not be rebuilt on every rank from replicas; trying an older one",
                        step)
    return None


def _own_file_damaged(store: ReplicaStore, held: list[list[str]], step: int) -> bool:
    """Whether this rank's own file of ``step`` fails its checksum (read once; the bytes are kept in
    ``store.verified`` for the load). A damaged file is quarantined, so that the rank retrieves the
    step from a replica instead (a peer holds a good copy of exactly this step) rather than every
    rank falling back to an older step in selection. False when the rank does not hold the step."""
    if replica_id(step, store.rank) not in held[store.rank]:
        return False
    ckpt, man_path = store.paths(step, store.rank)
    try:
        (_name, entry), = (paths.read_json(man_path) or {})["files"].items()
        store.verified[step] = local_file.read_verified(ckpt, entry)
        return False
    except (OSError, KeyError, ValueError) as e:  # LocalFileError is a ValueError
        log.error("resume: rank %d's own LOCAL file of step %d is damaged (%s): quarantined, retrieved from a "
                  "replica instead", store.rank, step, e)
        for p in (ckpt, man_path):
            if p.exists():
                paths.quarantine(p, str(e).split(" ")[0] or "damaged")
        return True


def _retrieve_step(replicator: Replicator, store: ReplicaStore, held: list[list[str]], step: int,
                   missing: list[int]) -> bool:
    """Collective: the ranks in ``missing`` receive their file of ``step``; True when this rank holds it now."""
    me = store.rank
    wanted = [replica_id(step, me)] if me in missing else []
    if _dist.rank() == 0:
        log.warning("resume: LOCAL step %d is missing on rank(s) %s; retrieving it from their replicas", step, missing)
    t0 = time.perf_counter()
    got = replicator.retrieve(dict(enumerate(held)), wanted, store.load)
    seconds = time.perf_counter() - t0
    ok = not wanted
    for id_, (replica, sender) in got.items():
        try:
            store.store(replica)
        except (OSError, KeyError, ValueError) as e:
            log.error("resume: LOCAL step %d of rank %d retrieved from rank %d is damaged (%s): not used", step, me,
                      sender, e)
            continue
        ok = True
        log.warning("resume: LOCAL step %d of rank %d retrieved from rank %d: %d bytes in %.2fs (checksum verified)",
                    step, me, sender, replica.data.numel(), seconds)
    return ok


class LocalReplication:
    """This rank's LOCAL replication (``checkpoint.replication_factor`` > 1), as the LOCAL tier uses it.

    On CPU the clique exchange runs on the writer thread right after the write (gloo groups no other
    thread uses while training), so a step is replicated about when it is written and the loop never
    waits for it. On GPU it runs in the LOCAL finalize, on the training thread: NCCL collectives
    issued from two threads on different communicators can deadlock.

    Args:
        root: ``checkpoint.local_dir``.
        factor / jump: ``checkpoint.replication_factor`` / ``replication_jump`` (resolved).
        rank / world_size: this rank and the job's size.
        local_rank / ranks_per_node: this rank's index on its node and the ranks of each node (the
            node's ranks share ``root``; local rank 0 tidies it at resume, see :meth:`ReplicaStore.normalize`).
        on_writer: exchange on the writer thread (True on CPU).
        writer_timeout_s: ``checkpoint.async_write_timeout_s``: the writers' clique groups wait
            that long for the slowest member's write, as the training thread does.

    The writers' exchange has clique groups of its own (created at the first save, collectively, on
    the training thread), apart from those of the resume retrieval, which are bounded like every
    checkpoint collective. After a save that failed anywhere, or whose writer was left behind after
    the write timeout, every rank drops them (:meth:`reset_writer`) and the next save creates new
    ones: a timed-out gloo pair stays closed, and a writer left behind may still enter an exchange
    later, which must not meet the next save's exchange on the same group. Such a writer finds its
    save cancelled before it starts one.
    """

    def __init__(self, root: Path, factor: int, jump: int, rank: int, world_size: int, *, on_writer: bool,
                 writer_timeout_s: float = 1800.0, local_rank: int = 0, ranks_per_node: int = 1):
        self.replicator = Replicator(factor, jump, rank, world_size)
        node = set(range(rank - local_rank, rank - local_rank + ranks_per_node))  # torchrun: node-major ranks
        cliques = [g for g in clique_groups(world_size, factor, jump) if node & set(g)]
        kept_for = {o for g in cliques for o in g if node & (set(g) - {o})}  # by another member on this node
        self.store = ReplicaStore(root, rank, sorted(node), kept_for)
        self.on_writer = on_writer
        self._writer_timeout_s = writer_timeout_s
        self._writer: Optional[Replicator] = None  # the writers' exchange (own clique groups)
        self._cancel = threading.Event()  # set when the save in flight is given up (reset_writer)
        self._exchange_s: Optional[float] = None  # this rank's last exchange on the writer (seconds)

    def writer_step(self, step: int):
        """At a save, on the training thread (collective when the writers' clique groups are
        created: the first save, and the first after :meth:`reset_writer`): the ``then`` the writer
        runs after writing ``step`` (see ``StagedTier._submit_checked``), or None when the exchange
        runs in finalize (GPU)."""
        if not self.on_writer:
            return None
        if self._writer is None:
            self._writer = Replicator(self.replicator.factor, self.replicator.jump, self.store.rank,
                                      self.replicator.world_size, timeout_s=self._writer_timeout_s)
            _ = self._writer.strategy
        writer, cancel = self._writer, self._cancel
        return lambda wrote: self._exchange_after_write(writer, cancel, step, wrote)

    def reset_writer(self) -> None:
        """On every rank, after a save that failed anywhere or timed out (see the class docstring)."""
        self._cancel.set()
        self._cancel, self._writer = threading.Event(), None

    def _exchange_after_write(self, writer: Replicator, cancel: threading.Event, step: int, wrote: bool) -> None:
        """Writer thread, after this rank's write of ``step`` (``wrote``: it succeeded): its part of
        the exchange. A failure fails the save when the write succeeded; after a failed write it is
        only logged (the write's error is the save's outcome, and the exchange ran so that the other
        members were not left waiting). A save given up meanwhile (``cancel``) exchanges nothing."""
        self._exchange_s = None
        if cancel.is_set():
            if wrote:
                raise ReplicationError(f"LOCAL step {step} on rank {self.store.rank}: given up before replication")
            return
        try:
            self._exchange_s = exchange_step(writer, self.store, step, have_file=wrote)
        except Exception as e:  # noqa: BLE001 - ReplicationError, CollectiveError
            if wrote:
                raise
            log.error("LOCAL step %d: rank %d's replication exchange after its failed write: %s", step,
                      self.store.rank, e)

    def seal(self, step: int) -> bool:
        """Collective, in the LOCAL finalize once every rank's writer succeeded: True when every
        replica of ``step`` is stored on every rank (on the writer path the agreement on the writers'
        outcome already covered it; on GPU this is :func:`replicate_step`)."""
        if not self.on_writer:
            return replicate_step(self.replicator, self.store, step, self._writer_timeout_s)
        if _dist.rank() == 0 and self._exchange_s is not None:
            log.info("LOCAL checkpoint of step %d replicated by the writer (factor %d, cliques of ranks %s apart) "
                     "in %.2fs", step, self.replicator.factor, self.replicator.jump, self._exchange_s)
        return True

    def remove(self, step: int, what: str) -> None:
        """The replicas of ``step`` this rank stored for its clique are removed (a failure is logged)."""
        try:
            self.store.remove_replicas(step, self.replicator.clique)
        except OSError as e:
            log.error("LOCAL replicas of %s step %d on rank %d not removed: %s", what, step, self.store.rank, e)

    def prune(self, run_id: str, step: int, k: int) -> None:
        """Retention of the replicas this rank keeps (most_recent_k, as for its own files); on local
        rank 0 also of the files no rank of the node keeps (:meth:`ReplicaStore.prune_strays`)."""
        self.store.prune(self.replicator.clique, run_id, step, k)
        if self.store.rank == self.store.node_ranks[0]:
            self.store.prune_strays(run_id, step, k)

    def retrieve_for_resume(self, run_id: str) -> Optional[int]:
        """Collective: :func:`retrieve_for_resume` with this rank's clique and store."""
        return retrieve_for_resume(self.replicator, self.store, run_id)

