"""LOCAL replicas on other nodes: nvidia-resiliency-ext's clique replication, moving our files.

With ``checkpoint.replication_factor`` F > 1 and ``checkpoint.replication_jump`` J (default: the
ranks per node), the ranks form NVRx cliques ``n, n+J, ..., n+(F-1)J``
(``CliqueReplicationStrategy.from_replication_params``, groups from ``parse_group_sequence``); each
rank keeps the LOCAL file of every other member of its clique under
``<local_dir>/replicas/<owner rank>/`` (same names as the owner's: ``iter_N_<owner>_local.pt`` and
its manifest). With J = ranks per node, the members are on F different nodes.

What NVRx moves: its strategy exchanges ``TensorAwareStateDict`` objects (hollow part pickled, tensors
broadcast / sent). Our LOCAL file is our own format (:mod:`local_file`), so :class:`FileReplica`
is a ``TensorAwareStateDict`` whose hollow part is the owner's manifest and whose one tensor is the
file's bytes. The bytes travel as written, so the owner's CRC-32C in the manifest checks every
replica and every retrieved copy end to end (a damaged copy is refused, never loaded).

- :meth:`Replicator.replicate`: ``CliqueReplicationStrategy.replicate`` (all-gather of manifests,
  broadcast of each member's bytes within the clique).
- :meth:`Replicator.retrieve`: ``retrieve_plan`` (which member sends a wanted file) and
  ``retrieve_execute`` (point-to-point send/receive).

Both are checkpoint collectives: they run inside the manager's bounded blocks (LOCAL finalize,
resume), and the clique groups are registered with
:func:`tierstack.runtime.collectives.register_checkpoint_group`, so a member that is gone or hung
fails the exchange on every rank within ``checkpoint.collective_timeout_s`` (``CollectiveError``).

On CPU the groups are gloo; NVRx's ``retrieve_execute`` moves every tensor with ``.cuda()`` before
sending, which the CPU compatibility layer (:mod:`tierstack.runtime.cpu_compat`) maps to the host.
On GPU the groups are NCCL, which moves device memory only, and NVRx allocates each received tensor
on the device type it was sent from. So :meth:`Replicator.replicate` sends a file in rounds of at
most :data:`CHUNK_BYTES` (one NVRx exchange each, every member taking part in every round, with an
empty chunk once its file is sent): a seal puts at most one chunk of its own and one received chunk
on the device at a time, never the file (a whole file plus a received copy, about twice the training
state, would not fit beside a real model). Each received chunk is copied to the host at once. The
resume retrieval (:meth:`Replicator.retrieve`, NVRx point-to-point sends) runs its plan in the same
bounded rounds.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional, Sequence

import torch

from tierstack.runtime import collectives as _dist

log = logging.getLogger(__name__)

REPLICAS_DIR = "replicas"
CHUNK_BYTES = 256 << 20  # most bytes of a file on the device per replication round (NCCL)


def _tasd_base():
    from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict

    return TensorAwareStateDict


class FileReplica(_tasd_base()):
    """One rank's LOCAL checkpoint of one step, as NVRx's replication moves it.

    Attributes:
        owner: the global rank whose state the file holds.
        step: the iteration.
        manifest: the owner's manifest (files, sizes, CRC-32C, TrainState, run id); the hollow part.
        data: the file's bytes, a 1-D ``torch.uint8`` tensor (host, or the device on GPU); None when hollow.
    """

    def __init__(self, owner: int, step: int, manifest: dict, data: Optional[torch.Tensor], total: int = -1):
        self.owner, self.step, self.manifest = owner, step, manifest
        self.total = int(data.numel()) if total < 0 and data is not None else total  # the whole file's bytes
        self.data = data
        self.nbytes = 0 if data is None else int(data.numel())
        self.device = "cpu" if data is None else data.device.type

    @property
    def id(self) -> str:
        return replica_id(self.step, self.owner)

    def pop_tensors(self) -> list[torch.Tensor]:
        if self.data is None:
            raise RuntimeError(f"LOCAL replica {self.id} is hollow already")
        data, self.data = self.data, None
        return [data]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [] if self.data is None else [self.data]

    @property
    def is_hollow(self) -> bool:
        return self.data is None

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        (self.data,) = list(tensor_data)

    def init_tensors(self) -> None:
        from tierstack import runtime

        device = runtime.device() if self.device == "cuda" else torch.device("cpu")
        self.data = torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        if self.data is not None:
            self.data = self.data.to("cpu", non_blocking=non_blocking)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Nothing to restore: the bytes are read where they are (host) after every exchange."""

    def host_bytes(self) -> torch.Tensor:
        """The file's bytes on the host (a copy only when they were staged on a device)."""
        return self.data if self.data.device.type == "cpu" else self.data.cpu()


def _to_device(data: torch.Tensor) -> torch.Tensor:
    """``data`` where the clique groups move it: the rank's GPU under NCCL, else as it is (host)."""
    from tierstack import runtime

    return data if not runtime.has_gpu() else data.to(runtime.device())


def _collective(fn: Callable, what: str):
    """``fn()``, an NVRx exchange over the clique groups; a failed or timed-out collective (a member
    gone or hung past ``checkpoint.collective_timeout_s``) raises ``CollectiveError`` like ours."""
    try:
        return fn()
    except _dist.CollectiveError:
        raise
    except RuntimeError as e:  # gloo/NCCL timeouts and closed connections; torch's DistError
        raise _dist.CollectiveError(f"{what} failed ({e}); a rank is gone or hung") from e


def replica_id(step: int, owner: int) -> str:
    """The NVRx id of ``owner``'s LOCAL file of ``step``."""
    return f"{step}:{owner}"


def parse_replica_id(id_: str) -> tuple[int, int]:
    step, owner = id_.split(":")
    return int(step), int(owner)


def clique_groups(world_size: int, factor: int, jump: int) -> list[list[int]]:
    """The replication cliques (NVRx ``parse_group_sequence``): ranks ``n, n+J, ..., n+(F-1)J``."""
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import parse_group_sequence

    return [list(g) for g in parse_group_sequence(jump, factor, world_size)]


class Replicator:
    """This rank's side of LOCAL replication (see the module docstring). Every method that talks is
    collective over the whole job (every rank calls it, in the same order).

    Args:
        factor: ``checkpoint.replication_factor`` (> 1).
        jump: ``checkpoint.replication_jump`` (ranks between the members of a clique).
        rank / world_size: this rank and the job's size.
        timeout_s: None: the clique groups are bounded like every checkpoint collective
            (``checkpoint.collective_timeout_s`` inside the manager's blocks); a number: that
            fixed timeout in seconds (the LOCAL writers' groups: ``checkpoint.async_write_timeout_s``,
            since a member waits there for the slowest member's write).
    """

    def __init__(self, factor: int, jump: int, rank: int, world_size: int, *, timeout_s: Optional[float] = None):
        self.factor, self.jump, self.rank, self.world_size = factor, jump, rank, world_size
        self.timeout_s = timeout_s  # None: bounded like every checkpoint collective; else this fixed timeout
        self.clique = next(g for g in clique_groups(world_size, factor, jump) if rank in g)
        self._strategy = None

    @property
    def strategy(self):
        """NVRx ``CliqueReplicationStrategy`` (its process groups are created on first use: collective)."""
        if self._strategy is None:
            from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

            self._strategy = CliqueReplicationStrategy.from_replication_params(self.jump, self.factor)
            if self.timeout_s is None:  # bounded like every checkpoint collective
                _dist.register_checkpoint_group(self._strategy.local_group.group)
            else:  # used off the training thread (LOCAL writers): the bounded blocks there must not change it
                _dist.set_group_timeout(self._strategy.local_group.group, self.timeout_s)
        return self._strategy

    @staticmethod
    def _staged(data: torch.Tensor) -> torch.Tensor:
        return _to_device(data)

    def _round(self, step: int, manifest: dict, data: torch.Tensor, lo: int, total: int) -> list[FileReplica]:
        """One NVRx exchange of bytes ``[lo, lo + CHUNK_BYTES)`` of every member's file."""
        chunk = data[lo:lo + CHUNK_BYTES]
        mine = FileReplica(self.rank, step, manifest, self._staged(chunk), total)
        theirs, _ids = _collective(lambda: self.strategy.replicate(mine, mine.id), "LOCAL replication")
        for r in theirs:
            r.data = r.host_bytes()  # off the device before the next round
        return [r for r in theirs if r.owner != self.rank]

    def replicate(self, step: int, manifest: dict, data: torch.Tensor) -> list[FileReplica]:
        """Collective: send this rank's file of ``step`` to its clique and receive the others', in
        rounds of at most :data:`CHUNK_BYTES` (see the module docstring).

        Args:
            manifest: this rank's manifest of the step.
            data: the file's bytes (1-D uint8, host).

        Returns:
            The other members' files (owner, step, manifest, bytes), bytes on the host.
        """
        total = int(data.numel())
        first = self._round(step, manifest, data, 0, total)  # manifests and sizes travel with round 0
        rounds = max([1] + [-(-max(r.total, 0) // CHUNK_BYTES) for r in first] + [-(-total // CHUNK_BYTES)])
        files = {}
        for r in first:
            files[r.owner] = torch.empty(max(r.total, 0), dtype=torch.uint8)
            files[r.owner][:r.data.numel()] = r.data
        for i in range(1, rounds):
            lo = i * CHUNK_BYTES
            for r in self._round(step, {}, data, lo, total):
                files[r.owner][lo:lo + r.data.numel()] = r.data
        for r in first:
            r.data = files[r.owner]
        return first

    def retrieve(self, available: dict[int, list[str]], wanted: Sequence[str],
                 load: Callable[[str], FileReplica]) -> dict[str, tuple[FileReplica, int]]:
        """Collective: fetch ``wanted`` ids from clique members that hold them, in rounds of at
        most :data:`CHUNK_BYTES` per file (one NVRx ``retrieve_execute`` of the same plan per round,
        on every rank), so no more than a chunk of a file is on the device at a time.

        Args:
            available: global rank -> ids it holds (own files and replicas), for every rank of the job.
            wanted: ids this rank must obtain (empty when it holds what it needs).
            load: reads one id this rank holds (called for what the plan makes it send).

        Returns:
            id -> (the file, the rank that sent it), bytes on the host.

        Raises:
            NoReplicasAvailableError (NVRx): a wanted id is held by no member of the clique.
        """
        strategy = self.strategy
        plan = _collective(lambda: strategy.retrieve_plan(available, list(wanted)), "LOCAL replica retrieval")
        mine = {id_: load(id_) for id_ in plan.required_ids()}  # what this rank sends, on the host
        # rounds as in replicate(): every rank runs the same number of NVRx exchanges of the plan
        rounds = _dist.all_reduce_max(max([1] + [-(-int(r.data.numel()) // CHUNK_BYTES) for r in mine.values()]))
        senders = {e.id_: e.sender for e in plan.entries if e.receiver == self.rank}
        files: dict[str, FileReplica] = {}
        for i in range(rounds):
            lo = i * CHUNK_BYTES
            my_data = {id_: FileReplica(r.owner, r.step, r.manifest if i == 0 else {},
                                        self._staged(r.data[lo:lo + CHUNK_BYTES]), int(r.data.numel()))
                       for id_, r in mine.items()}
            received = _collective(lambda: strategy.retrieve_execute(plan, my_data), "LOCAL replica retrieval")
            for id_, chunk in received.items():
                if id_ not in wanted:
                    continue
                if i == 0:  # the manifest and the whole size travel with round 0
                    files[id_] = FileReplica(chunk.owner, chunk.step, chunk.manifest,
                                             torch.empty(max(chunk.total, 0), dtype=torch.uint8))
                part = chunk.host_bytes()  # off the device before the next round
                files[id_].data[lo:lo + part.numel()] = part
        return {id_: (r, senders.get(id_, self.rank)) for id_, r in files.items()}
