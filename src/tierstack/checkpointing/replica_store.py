"""The files of one LOCAL root that replication reads and writes: :class:`ReplicaStore`.

Layout under ``checkpoint.local_dir`` (beside the rank folders)::

    replicas/<owner>/iter_0000020_<owner>_local.pt              the owner's file, byte for byte
    replicas/<owner>/iter_0000020_<owner>_local.manifest.json   the owner's manifest

The collective steps that fill and read it are in :mod:`local_replicas`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

import torch

from tierstack.checkpointing import local_file, manifest, paths, retention
from tierstack.checkpointing.replication import REPLICAS_DIR, FileReplica, parse_replica_id, replica_id

log = logging.getLogger(__name__)


def _manifest_step(name: str, owner: int) -> Optional[int]:
    """The step of ``owner``'s LOCAL manifest named ``name``; None for any other name."""
    if not name.endswith("_local.manifest.json"):
        return None
    parsed = paths.parse_local_name(name)
    return parsed[0] if parsed is not None and parsed[1] == owner else None


def _rename(src: Path, dst: Path) -> None:
    """``src`` renamed to ``dst`` durably (both folders fsync'd), never over an existing file."""
    if dst.exists():
        raise FileExistsError(f"{dst} exists; {src} not moved over it")
    src.rename(dst)
    paths.fsync_dir(dst.parent)
    paths.fsync_dir(src.parent)


class ReplicaStore:
    """Files of one LOCAL root: this rank's own folder and the replicas it keeps for its clique.

    Args:
        root: ``checkpoint.local_dir``.
        rank: this global rank.
        node_ranks: the global ranks of this node, which share ``root`` (default: this rank alone).
            Their own folders ``<root>/<r>`` belong here; any other rank's own folder is a leftover
            of a launch that put that rank on this node (:meth:`normalize`).
        kept_for: the owners whose replicas some rank of this node keeps (the other members of the
            node's ranks' cliques); None: every rank not of this node.
    """

    def __init__(self, root: Path, rank: int, node_ranks: Sequence[int] = (), kept_for: Optional[set[int]] = None):
        self.root, self.rank = Path(root), rank
        self.node_ranks = tuple(node_ranks) or (rank,)
        self.kept_for = kept_for
        # step -> this rank's own file's bytes, checked at resume (local_replicas), for the load to reuse
        self.verified: dict[int, torch.Tensor] = {}

    def _keeps(self, owner: int) -> bool:
        """Whether ``replicas/<owner>`` is kept by a rank of this node (and pruned by it)."""
        return owner not in self.node_ranks if self.kept_for is None else owner in self.kept_for

    def folder(self, owner: int) -> Path:
        """Where ``owner``'s files are on this node: its own rank folder, or ``replicas/<owner>``."""
        return self.root / str(owner) if owner == self.rank else self.root / REPLICAS_DIR / str(owner)

    def paths(self, step: int, owner: int) -> tuple[Path, Path]:
        d = self.folder(owner)
        return d / paths.local_file_name(step, owner), d / paths.local_manifest_name(step, owner)

    def holdings(self, run_id: str) -> list[str]:
        """Ids (``"<step>:<owner>"``) of the files this rank holds, own and replicas, of ``run_id``
        with a well-formed manifest and a file of the recorded size (the checksum is checked by
        whoever uses the bytes)."""
        owners = [self.rank] + [int(d.name) for d in paths.rank_dirs(self.root / REPLICAS_DIR) if int(d.name) != self.rank]
        out = []
        for owner in owners:
            folder = self.folder(owner)
            if not folder.is_dir():
                continue
            for p in folder.iterdir():
                parsed = paths.parse_local_file(p.name)
                if parsed is None or parsed[1] != owner:
                    continue
                man = paths.read_json(self.paths(parsed[0], owner)[1])
                if manifest.check_manifest(man, step=parsed[0]) is not None or man.get("run_id") != run_id:
                    continue
                (name, entry), = man["files"].items()
                size = p.stat().st_size
                if size == int(entry["size"]):
                    out.append(replica_id(parsed[0], owner))
                else:  # truncated (a full disk, a kill while copying): not offered, and said so
                    log.warning("resume: LOCAL %s of rank %d, step %d, %s has %d bytes, its manifest records %s: "
                                "damaged, not used", "file" if owner == self.rank else "replica", owner, parsed[0], p,
                                size, entry["size"])
        return out

    def load(self, id_: str) -> FileReplica:
        """The file and manifest of ``id_`` as this rank holds them (unchecked: the receiver checks;
        an unreadable file goes out as zero bytes, which the receiver refuses)."""
        step, owner = parse_replica_id(id_)
        ckpt, man_path = self.paths(step, owner)
        man = paths.read_json(man_path) or {}
        try:
            data = torch.frombuffer(bytearray(ckpt.read_bytes()), dtype=torch.uint8)
        except OSError as e:
            log.error("LOCAL file %s cannot be read to send it (%s)", ckpt, e)
            data = torch.empty(0, dtype=torch.uint8)
        return FileReplica(owner, step, man, data)

    def store(self, replica: FileReplica) -> None:
        """Check ``replica``'s bytes against its manifest, then write file and manifest durably.

        Raises:
            LocalFileError: damaged (size or checksum); nothing is written.
        """
        ckpt, man_path = self.paths(replica.step, replica.owner)
        (name, entry), = replica.manifest["files"].items()
        local_file.check_bytes(replica.data, entry, name)
        man_path.unlink(missing_ok=True)  # the manifest goes last: a file without one is no candidate
        local_file.write_raw(ckpt, replica.data)
        manifest.write_manifest(man_path, replica.manifest)

    def normalize(self, run_id: str) -> list[str]:
        """At resume, before the holdings are gathered: move the files of ``run_id`` that this node
        holds to where this launch's layout looks for them. Returns one line per folder moved from.

        Called on one rank of the node only (local rank 0; the others wait at a barrier), since the
        ranks of a node share the root. The rendezvous may give this node another node's index than
        at the launch that wrote the files (see the module docstring), so the root may hold:

        - ``replicas/<r>`` with ``r`` a rank of this node (and kept by none of its ranks: a
          ``replication_jump`` below the ranks per node makes cliques within a node): ``r``'s own
          files, replicated here while this disk belonged to another node. A replica on the
          owner's own node is no replica: each step ``<root>/<r>`` lacks is moved there and is
          ``r``'s own file again.
        - ``<root>/<o>`` with ``o`` a rank of another node now: ``o``'s own files, written while ``o``
          ran on this disk. This node holds them for ``o`` as replicas: each step ``replicas/<o>``
          lacks is moved there (offered to ``o`` by :meth:`holdings`, pruned as replicas are).

        A step the destination has already (file or manifest) stays where it is, as does every file
        of another run; :meth:`prune_strays` removes them once a newer step is sealed. A file moves
        before its manifest, so a file without its manifest (no candidate anywhere) is all a crash
        between the two renames leaves, and the next resume completes that move.
        """
        moves = [(d, self.root / REPLICAS_DIR / d.name, "held as a replica for that rank now on another node")
                 for d in paths.rank_dirs(self.root) if int(d.name) not in self.node_ranks]
        moves += [(d, self.root / d.name, "adopted as that rank's own file (a replica on the owner's own node)")
                  for d in paths.rank_dirs(self.root / REPLICAS_DIR)
                  if int(d.name) in self.node_ranks and not self._keeps(int(d.name))]
        lines = []
        for src, dst, why in moves:
            owner = int(src.name)
            moved, kept = [], []
            for step in sorted(s for s in (_manifest_step(p.name, owner) for p in src.iterdir()) if s is not None):
                man = paths.read_json(src / paths.local_manifest_name(step, owner))
                if manifest.check_manifest(man, step=step) is not None or man.get("run_id") != run_id:
                    continue  # another run's, or not a checkpoint: left alone
                (moved if self._move_step(src, dst, step, owner) else kept).append(step)
            if moved:
                lines.append(f"LOCAL step(s) {moved} of rank {owner} found under {src} on the node of rank(s) "
                             f"{list(self.node_ranks)}: moved to {dst}, {why}")
            if kept:
                lines.append(f"LOCAL step(s) {kept} of rank {owner} found under {src}: left in place ({dst} has "
                             "a file of each already), removed by retention")
            try:
                src.rmdir()  # only when empty
            except OSError:
                pass
        return lines

    @staticmethod
    def _move_step(src: Path, dst: Path, step: int, owner: int) -> bool:
        """``owner``'s file, then manifest, of ``step`` from ``src`` to ``dst``; False (nothing moved)
        when ``dst`` has that step already. A file already in ``dst`` without its manifest, and none
        in ``src``, is an earlier move a crash interrupted: only the manifest is left to move."""
        f_src, f_dst = src / paths.local_file_name(step, owner), dst / paths.local_file_name(step, owner)
        m_src, m_dst = src / paths.local_manifest_name(step, owner), dst / paths.local_manifest_name(step, owner)
        if m_dst.exists() or (f_dst.exists() and f_src.exists()):
            return False
        if f_src.exists():
            dst.mkdir(parents=True, exist_ok=True)
            _rename(f_src, f_dst)
        elif not f_dst.exists():
            return False  # a manifest without its file: not a checkpoint
        _rename(m_src, m_dst)
        return True

    def prune_strays(self, run_id: str, step: int, k: int) -> None:
        """Retention, on one rank of the node (local rank 0), of what no rank of the node prunes as
        its own files or its clique's replicas: another node's rank's own folder, and the replicas
        no rank of this node keeps (``replicas/<r>`` of a rank of this node, or of a rank in none of
        the node's ranks' cliques). :meth:`normalize` leaves such files where a step was held
        twice; they are surplus once a newer step is sealed (every rank's file and its replicas are
        where they belong), so every step of ``run_id`` older than ``step`` goes
        (``most_recent_k`` = -1, keep all, keeps them too), and so do the interrupted writes and
        stores there. Another run's files stay. An empty folder is removed."""
        strays = [d for d in paths.rank_dirs(self.root) if int(d.name) not in self.node_ranks]
        strays += [d for d in paths.rank_dirs(self.root / REPLICAS_DIR) if not self._keeps(int(d.name))]
        for folder in strays:
            retention.prune_local(folder, int(folder.name), run_id, step, min(k, 1))
            retention.prune_leftovers_upto(folder, step)
            try:
                folder.rmdir()  # only when empty
            except OSError:
                pass

    def remove_replicas(self, step: int, owners) -> None:
        for owner in owners:
            if owner != self.rank:
                for p in self.paths(step, owner):
                    p.unlink(missing_ok=True)

    def prune(self, owners, run_id: str, step: int, k: int) -> None:
        """Retention of the replicas kept for ``owners`` (most_recent_k, as for own files), and of
        what an interrupted store left there: ``.dirty`` and temp files of steps up to ``step`` (a
        store of a newer step may be in progress on the writer thread and is left alone)."""
        for owner in owners:
            if owner != self.rank and self.folder(owner).is_dir():
                retention.prune_local(self.folder(owner), owner, run_id, step, k)
                retention.prune_leftovers_upto(self.folder(owner), step)
