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
                            manifest, set file, tensor shapes and dtypes), then the LOCAL header

The record is replaced atomically (write, then rename), before the held step changes in memory,
and names a set that the stager never refills while it is held (:class:`~tierstack.checkpointing.local_memory.MemoryStager`),
so a record is always the complete state of a step sealed on every rank. A process removes its
files when it frees a set or exits; what a killed process leaves is adopted or, once no record
names it and its process is gone, removed at the next allocation in that directory.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import weakref
from pathlib import Path
from typing import Optional, Sequence

import numpy
import torch

from tierstack import runtime
from tierstack.runtime.host_copy import carve, region_layout, unlink_quietly

log = logging.getLogger(__name__)

MAGIC = b"TSHELD1\n"
RECORD = "held"
_counter = itertools.count()
_mine: set[str] = set()  # set files this process created or adopted (a rank exits with os._exit: no finalizer runs)


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


def allocate(likes: Sequence[torch.Tensor], directory: Path) -> tuple[list[torch.Tensor], str]:
    """A staging set of ``likes``' shapes and dtypes backed by a new file in ``directory``;
    returns the buffers and the file's path. The file is removed when the last buffer is freed
    (or at a normal exit). Leftovers of dead processes that no record names are removed first.

    Raises:
        OSError: the file could not be created or sized (ENOSPC: the tmpfs is full).
    """
    directory.mkdir(parents=True, exist_ok=True)
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


def release_files() -> None:
    """Remove every set file this process created or adopted (the run ended: nothing is resumed
    from them; the mappings stay valid until their buffers are freed)."""
    for path in list(_mine):
        unlink_quietly(path)
    _mine.clear()


def write_record(directory: Path, *, step: int, run_id: str, rank: int, root: str, topology: dict,
                 manifest: dict, header: bytes, buffers: Sequence[torch.Tensor], file: str) -> None:
    """Describe the sealed memory step ``step``, held in ``buffers`` (the set in ``file``), so that
    a process taking this rank after this one died can adopt it. Atomic (write, then rename).

    Raises:
        OSError: the record could not be written (the old one, if any, is removed then).
    """
    meta = {"step": step, "run_id": run_id, "rank": rank, "root": root, "topology": topology,
            "manifest": manifest, "file": Path(file).name,
            "layout": [[list(b.shape), str(b.dtype).removeprefix("torch.")] for b in buffers]}
    body = json.dumps(meta).encode()
    tmp = directory / f".{RECORD}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(body).to_bytes(8, "little") + body + header)
        os.replace(tmp, directory / RECORD)
    except OSError:
        remove_record(directory)
        unlink_quietly(str(tmp))
        raise


def remove_record(directory: Path) -> None:
    """No step is held for this rank in node memory any more (the set it named may be refilled)."""
    unlink_quietly(str(directory / RECORD))


def read_record(directory: Path) -> Optional[tuple[dict, bytes]]:
    """``(meta, header)`` of the record in ``directory``, or None (none, or not a complete record)."""
    try:
        data = (directory / RECORD).read_bytes()
    except OSError:
        return None
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        return None
    n = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8
    try:
        return json.loads(data[start:start + n]), data[start + n:]
    except ValueError:
        return None


def adopt(directory: Path) -> Optional[tuple[dict, bytes, tuple, str]]:
    """The memory step a previous process of this rank left in ``directory``: ``(meta, header,
    buffers, file)``, the buffers mapping its set file (removed when they are freed); None when
    there is none, or its set file is gone or of the wrong size (the record is removed then)."""
    got = read_record(directory)
    if got is None:
        return None
    meta, header = got
    path = directory / meta["file"]
    likes = [torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for shape, dtype in meta["layout"]]
    offsets, total = region_layout(likes)
    try:
        if path.stat().st_size != max(total, 1):
            raise OSError(f"{path.stat().st_size} bytes, {max(total, 1)} expected")
        region = numpy.memmap(path, dtype=numpy.uint8, mode="r+", shape=(max(total, 1),))
        weakref.finalize(region, unlink_quietly, str(path))  # this process's now: freed with the step
    except (OSError, ValueError) as e:
        log.warning("rank %s: the memory step %s left in node memory is unusable (%s); removed",
                    meta.get("rank"), meta.get("step"), e)
        remove_record(directory)
        return None
    _mine.add(str(path))
    return meta, header, tuple(carve(region, likes, offsets)), str(path)


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
    got = read_record(directory)
    named = None if got is None else got[0].get("file")
    for p in [*directory.glob("set-*.bin"), *directory.glob(f".{RECORD}.*.tmp")]:
        try:
            pid = int(p.name.split("-")[1] if p.name.startswith("set-") else p.name.split(".")[2])
        except (IndexError, ValueError):
            continue
        if p.name != named and pid != os.getpid() and not _alive(pid):
            unlink_quietly(str(p))
