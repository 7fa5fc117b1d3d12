"""Memory steps that outlive their process: their buffers in the node's shared memory.

With ``checkpoint.memory_dir`` (a tmpfs, such as ``/dev/shm``) the LOCAL tier's staging sets under
in-process restart are shared mappings of files there instead of anonymous memory, and the rank's
newest sealed memory step is described by a small *record* file beside them. A process that dies
(SIGKILL, a hang ended by the monitor, the OOM killer) leaves both behind in the node's memory, so
the process that takes its rank on the same node (a warm spare, or the launcher's restart) adopts
the step (:func:`adopt`): every rank then holds the same memory step and the job resumes it with no
file read, losing at most the step in flight. A node that is lost takes its memory with it: its
ranks' replacements resume the newest file step, as without this module.

Layout, per LOCAL root (so that two jobs on a node never touch each other's files) and rank::

    <memory_dir>/tierstack-<sha1 of the LOCAL root, 12 hex>/rank<R>/
        set-<pid>-<n>.bin   a staging set: the tensors' bytes at :func:`~tierstack.runtime.host_copy.region_layout`'s offsets
        held                the record: MAGIC, 8-byte length, JSON (step, run, rank, root, topology,
                            manifest, set file, tensor shapes and dtypes, CRC-32C), then the LOCAL header

The record is replaced atomically (write, then rename), before the held step changes in memory,
and names a set that the stager never refills while it is held (:class:`~tierstack.checkpointing.local_memory.MemoryStager`),
so a record is always the complete state of a step sealed on every rank. Before a step is adopted
the record is checked (:func:`adopt`): its CRC-32C over the description, the header and the set's
bytes, every field, a set file of its own directory, directories only this user can write; a
record that fails is removed with one warning and the file step is resumed instead. A process
removes its files when it frees a set or when the run ends (:func:`release_files`); what a killed
process leaves is adopted or, once no record names it and its process is gone, removed at the
next allocation in that directory or at the end of the run.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import re
import weakref
from pathlib import Path
from typing import Optional, Sequence

import crc32c
import numpy
import torch

from tierstack import runtime
from tierstack.checkpointing import paths
from tierstack.runtime.host_copy import carve, region_layout, unlink_quietly

log = logging.getLogger(__name__)

MAGIC = b"TSHELD2\n"  # 2: the checksum covers the set file in one piece (1: buffer by buffer)
RECORD = "held"
_counter = itertools.count()
_mine: set[str] = set()  # set files this process created or adopted (a rank exits with os._exit: no finalizer runs)
_dirs: set[Path] = set()  # rank directories this process's LOCAL tiers used (swept at the run's end: use_dir)


def rank_dir(memory_dir: str, root: Path, rank: int) -> Path:
    """This rank's directory in ``memory_dir`` for the LOCAL root ``root`` (created on first use)."""
    key = hashlib.sha1(str(Path(root).resolve()).encode()).hexdigest()[:12]
    return Path(memory_dir) / f"tierstack-{key}" / f"rank{rank}"


def is_tmpfs(path: str) -> Optional[bool]:
    """Whether ``path`` (or its nearest existing parent) is on a tmpfs; None when unknown (not Linux)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = [(line.split()[4], line.split(" - ")[1].split()[0]) for line in f if " - " in line]
    except OSError:
        return None
    real = str(p.resolve())
    best = max((m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return None if best is None else best[1] == "tmpfs"


@functools.lru_cache(maxsize=None)
def warn_unless_tmpfs(memory_dir: str) -> None:
    """Warn (once per process and directory: the LOCAL tier is built again at every in-process
    attempt) when ``memory_dir`` is not on a tmpfs: the kernel would write every memory step back
    to that disk."""
    if is_tmpfs(memory_dir) is False:
        log.warning("checkpoint.memory_dir=%s is not a tmpfs: the kernel writes every memory step back to that "
                    "disk; use the node's shared memory (e.g. /dev/shm)", memory_dir)


def allocate(likes: Sequence[torch.Tensor], directory: Path) -> tuple[list[torch.Tensor], str]:
    """A staging set of ``likes``' shapes and dtypes backed by a new file in ``directory``;
    returns the buffers and the file's path. The file is removed when the last buffer is freed
    (or at a normal exit). Leftovers of dead processes that no record names are removed first.

    Raises:
        OSError: the file could not be created or sized (ENOSPC: the tmpfs is full); PermissionError
            when a directory on the way is not this user's alone (created by another user first).
    """
    directory.parent.parent.mkdir(parents=True, exist_ok=True)  # memory_dir (the config checked it is writable)
    for d in (directory.parent, directory):
        d.mkdir(mode=0o700, exist_ok=True)
        try:
            _owned(d)
        except RecordError as e:  # another user's directory: never put this job's state there
            raise PermissionError(str(e)) from None
    _sweep(directory)
    path = str(directory / f"set-{os.getpid()}-{next(_counter)}.bin")
    try:
        buffers = runtime.empty_host_buffers(likes, path=path)
    except RuntimeError as e:  # page-locking a shared mapping refused (a driver or file system that cannot)
        log.warning("node-memory staging set %s not page-locked (%s): device-to-host copies into it are "
                    "slower", path, e)
        path = str(directory / f"set-{os.getpid()}-{next(_counter)}.bin")  # (the first file goes with its region)
        buffers = runtime.empty_host_buffers(likes, path=path, pin=False)
    _mine.add(path)
    return buffers, path


def use_dir(directory: Path) -> None:
    """Remember ``directory``, a rank's node-memory directory of this process's LOCAL tier, so that
    the run's end (:func:`release_files`) sweeps it even when this process neither allocated nor
    adopted a set there: a process that took a rank at the run's last step (a spare after a kill
    at the end: "nothing to do") left the dead process's set behind otherwise (a break-it pass:
    19 MB in /dev/shm after a run that ended with exit status 0)."""
    _dirs.add(Path(directory))


def release_files() -> None:
    """Remove every set file this process created or adopted, and what dead processes of the same
    ranks left there that no record names (the run ended: nothing is resumed from them; the
    mappings stay valid until their buffers are freed); then the directories, once empty."""
    dirs = {Path(p).parent for p in _mine} | _dirs
    for path in list(_mine):
        unlink_quietly(path)
    _mine.clear()
    _dirs.clear()
    for d in dirs:
        if d.is_dir():
            _sweep(d)
        for empty in (d, d.parent):  # the rank's and the root's directory
            try:
                empty.rmdir()
            except OSError:
                break


def checksum(meta: dict, header: bytes, region: numpy.ndarray) -> int:
    """CRC-32C (the LOCAL files' algorithm, :mod:`~tierstack.checkpointing.manifest`) of a record's
    description (without its ``crc32c``), its header and the bytes of its set file (``region``,
    uint8: the buffers at :func:`~tierstack.runtime.host_copy.region_layout`'s offsets and the
    padding between them, zeros since the file was created), in order: one call over the set, about
    1 ms for 18 MiB on this machine's CPU (one call per buffer cost 3-4 ms more, in torch calls)."""
    described = {k: v for k, v in meta.items() if k != "crc32c"}
    crc = crc32c.crc32c(header, crc32c.crc32c(json.dumps(described, sort_keys=True).encode()))
    return crc32c.crc32c(memoryview(region), crc)


_sets: dict[str, tuple[list, numpy.ndarray]] = {}  # set file -> (layout, a read-only mapping of it), while its buffers live


def _described_set(file: str, buffers: Sequence[torch.Tensor]) -> tuple[list, numpy.ndarray]:
    """The record's ``layout`` of the set in ``file`` and a read-only mapping of the file, computed
    once per set (a set's shapes and file never change; dropped with its buffers)."""
    got = _sets.get(file)
    if got is None:
        layout = [[list(b.shape), str(b.dtype).removeprefix("torch.")] for b in buffers]
        got = (layout, numpy.memmap(file, dtype=numpy.uint8, mode="r"))
        if buffers:
            _sets[file] = got
            weakref.finalize(buffers[0], _sets.pop, file, None)  # the set is freed: so is this mapping of it
    return got


def write_record(directory: Path, *, step: int, run_id: str, rank: int, root: str, topology: dict,
                 manifest: dict, header: bytes, buffers: Sequence[torch.Tensor], file: str) -> None:
    """Describe the sealed memory step ``step``, held in ``buffers`` (the set in ``file``), with
    their :func:`checksum`, so that a process taking this rank after this one died can adopt it.
    Atomic (:func:`~tierstack.checkpointing.paths.atomic_write_bytes`; its temp file
    ``.held.tmp-<pid>`` is swept once its process is gone).

    Raises:
        OSError: the record could not be written (the old one, if any, is removed then).
    """
    layout, region = _described_set(file, buffers)
    meta = {"step": step, "run_id": run_id, "rank": rank, "root": root, "topology": topology,
            "manifest": manifest, "file": Path(file).name, "layout": layout}
    meta["crc32c"] = checksum(meta, header, region)
    body = json.dumps(meta).encode()
    try:
        paths.atomic_write_bytes(directory / RECORD, MAGIC + len(body).to_bytes(8, "little") + body + header)
    except OSError:
        remove_record(directory)  # the old one names a set that is no longer protected
        raise


def remove_record(directory: Path) -> None:
    """No step is held for this rank in node memory any more (the set it named may be refilled)."""
    unlink_quietly(str(directory / RECORD))


class RecordError(ValueError):
    """A node-memory record, or the set it names, that must not be adopted (the reason is the message)."""


_SET_NAME = re.compile(r"set-\d+-\d+\.bin")
_FIELDS = {"step": int, "run_id": str, "rank": int, "root": str, "topology": dict, "manifest": dict, "file": str,
           "crc32c": int, "layout": list}


def read_record(directory: Path) -> Optional[tuple[dict, bytes]]:
    """``(meta, header)`` of the record in ``directory``; None when there is none.

    Raises:
        RecordError: it is not a complete record of this format (a field missing or of the wrong
            type, a set file name that is not a plain ``set-<pid>-<n>.bin`` of this directory).
    """
    try:
        data = (directory / RECORD).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RecordError(f"unreadable ({e})") from e
    start = len(MAGIC) + 8
    if data.startswith(MAGIC[:6]) and not data.startswith(MAGIC):
        raise RecordError(f"a node-memory record of another format ({data[:7].decode(errors='replace')}; this "
                          f"version reads {MAGIC[:7].decode()}), left by another tierstack version")
    if not data.startswith(MAGIC) or len(data) < start:
        raise RecordError("not a tierstack node-memory record")
    n = int.from_bytes(data[len(MAGIC):start], "little")
    try:
        meta = json.loads(data[start:start + n])
    except ValueError as e:
        raise RecordError(f"its description does not parse ({e})") from e
    bad = [k for k, t in _FIELDS.items() if not isinstance(meta, dict) or not isinstance(meta.get(k), t)]
    if bad:
        raise RecordError(f"field(s) {', '.join(bad)} missing or of the wrong type")
    if not _SET_NAME.fullmatch(meta["file"]):
        raise RecordError(f"set file name {meta['file']!r} is not a set file of this directory")
    return meta, data[start + n:]


def _owned(path: Path) -> None:
    st = path.stat()
    if st.st_uid != os.getuid() or (path.is_dir() and st.st_mode & 0o022):
        raise RecordError(f"{path} is not this user's alone (owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})")


def adopt(directory: Path) -> Optional[tuple[dict, bytes, tuple, str]]:
    """The memory step a previous process of this rank left in ``directory``: ``(meta, header,
    buffers, file)``, the buffers mapping its set file (removed when they are freed), its bytes
    checked against the record's checksum; None when there is none, or when it must not be
    adopted (logged, with the reason; the record is removed then, unless the directory is not
    this user's alone, which is not touched)."""
    try:
        _owned(directory.parent)
        _owned(directory)
    except FileNotFoundError:
        return None
    except RecordError as e:
        log.warning("node memory %s not used: %s", directory, e)
        return None
    try:
        got = read_record(directory)
        if got is None:
            return None
        meta, header = got
        path = directory / meta["file"]
        _owned(path)
        likes = [torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for shape, dtype in meta["layout"]]
        offsets, total = region_layout(likes)
        if path.stat().st_size != max(total, 1):
            raise RecordError(f"its set file has {path.stat().st_size} bytes, {max(total, 1)} expected")
        region = numpy.memmap(path, dtype=numpy.uint8, mode="r+", shape=(max(total, 1),))
        weakref.finalize(region, unlink_quietly, str(path))  # this process's now: freed with the step
        _mine.add(str(path))
        buffers = tuple(carve(region, likes, offsets))
        if checksum(meta, header, region) != meta["crc32c"]:
            raise RecordError("the record and its set's bytes do not match the record's checksum (damaged)")
    except (RecordError, OSError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        log.warning("rank %s: the memory step left in node memory (%s) is not adopted: %s; removed",
                    directory.name.removeprefix("rank"), directory / RECORD, e)
        remove_record(directory)
        return None
    return meta, header, buffers, str(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep(directory: Path) -> None:
    """Remove set files (and half-written records) of processes that are gone, except the set the
    record names."""
    try:
        got = read_record(directory)
    except RecordError:  # names nothing that could be adopted (an adoption removes it)
        got = None
    named = None if got is None else got[0].get("file")
    for p in [*directory.glob("set-*.bin"), *directory.glob(f".{RECORD}.tmp-*")]:
        try:
            pid = int(p.name.split("-")[1] if p.name.startswith("set-") else p.name.rsplit("-", 1)[1])
        except (IndexError, ValueError):
            continue
        if p.name != named and pid != os.getpid() and not _alive(pid):
            unlink_quietly(str(p))
