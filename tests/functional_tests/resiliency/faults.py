"""File-system fault injection for real checkpoint saves, configured by environment variables.

``TIERSTACK_FAULTS`` is a JSON list of faults; each one fires when a process of the named rank
touches a path matching its glob::

    {"id": "g-write-eio", "op": "write", "path": "*/iter_0000002.staging-*/__1_*.distcp",
     "rank": 1, "errno": "EIO", "times": 1}

``op``: ``write`` (open for writing: ``open`` or ``os.open`` with a write flag), ``read`` (open for reading), ``rename`` (os.rename/os.replace,
source or target), ``remove`` (shutil.rmtree, os.unlink, os.remove), ``kill`` / ``stop`` (SIGKILL /
SIGSTOP of the rank on a write-open: a rank that dies / hangs). ``times``: 1 fires once (transient: the retry then succeeds), -1 every time
(permanent). ``sleep``: seconds the operation waits before it goes on (a slow file system; no error). ``if_exists``: a glob that must match an existing path (e.g. the staging directory
of one step, to hit the tracker write of that step's publish). The hooks are installed into ``builtins.open``, ``io.open``, ``os`` and ``shutil`` at
interpreter start by ``sitecustomize`` (this folder's ``inject/`` on ``PYTHONPATH``), so they reach
every process of a rank: forked writer processes and spawned ones alike. ``RANK`` comes from
torchrun's environment, read at each operation (in-process restart gives a spare its rank later).

Each firing appends ``id rank pid unix_time path`` to ``$TIERSTACK_FAULT_DIR/fired.log``; a fault with
``times: 1`` fires once over all processes (an ``O_EXCL`` marker file decides).

The GLOBAL writer's early-writeback thread (``tierstack-writeback``, :mod:`tierstack.checkpointing.writeback`)
opens each data file read-only once the file takes longer than its interval to write (timing:
on a busy machine only) and by design ignores any error of its own. A fault meant for the save's
reads (the checksum) would be used up there without a trace, so faults skip that thread unless
they say ``"writeback": true``.
"""

from __future__ import annotations

import builtins
import errno as errno_mod
import fnmatch
import glob
import io
import json
import os
import shutil
import signal
import threading
import time

_FAULTS: list = []
_DIR = None
_RANK = None
_RANK_PID = None
_os_open = os.open  # the real one: the hooks' own marker files must not go through the hooks
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _rank() -> int:
    """The rank this process works for now: ``RANK`` as it is at the operation (under in-process
    restart a spare's changes when it takes a rank), else the one at interpreter start."""
    try:
        return int(os.environ["RANK"])
    except (KeyError, ValueError):
        return _RANK


def _fires(fault: dict, path) -> bool:
    if _RANK is None or int(fault.get("rank", _rank())) != _rank():
        return False
    if not fnmatch.fnmatch(os.fsdecode(path), fault["path"]):  # bytes paths too (numpy, megatron)
        return False
    if threading.current_thread().name == "tierstack-writeback" and not fault.get("writeback"):
        return False  # best-effort observer: its errors are ignored by design (module docstring)
    if fault.get("if_exists") and not glob.glob(fault["if_exists"]):
        return False
    if int(fault.get("times", 1)) == 1:
        try:
            fd = _os_open(os.path.join(_DIR, f"{fault['id']}.fired"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.close(fd)
        except FileExistsError:
            return False
    fd = _os_open(os.path.join(_DIR, "fired.log"), os.O_CREAT | os.O_APPEND | os.O_WRONLY)
    os.write(fd, f"{fault['id']} {_rank()} {os.getpid()} {time.time():.3f} {os.fsdecode(path)}\n".encode())
    os.close(fd)
    return True


def _check(op: str, *paths) -> None:
    for fault in _FAULTS:
        want = fault["op"]
        if want != op and not (want in ("kill", "stop") and op == "write"):
            continue
        for p in paths:
            if p is None or isinstance(p, int) or not _fires(fault, p):
                continue
            if want == "kill":
                os.kill(_RANK_PID, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            if want == "stop":  # the rank hangs; a writer process of it fails and exits as usual
                os.kill(_RANK_PID, signal.SIGSTOP)
            if "sleep" in fault:  # a slow file system: the operation waits, then goes on
                time.sleep(float(fault["sleep"]))
                continue
            n = getattr(errno_mod, fault["errno"])
            raise OSError(n, os.strerror(n), os.fspath(p))


def _wrap_open(real):
    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)):
            _check("write" if any(c in mode for c in "wax+") else "read", file)
        return real(file, mode, *args, **kwargs)

    return open_


def _wrap_os_open(real):
    def os_open(path, flags, *args, **kwargs):
        _check("write" if flags & _WRITE_FLAGS else "read", path)
        return real(path, flags, *args, **kwargs)

    return os_open


def _wrap_paths(real, op: str, n: int):
    def wrapper(*args, **kwargs):
        _check(op, *args[:n])
        return real(*args, **kwargs)

    return wrapper


def install() -> None:
    """Install the hooks when ``TIERSTACK_FAULTS`` is set and this process belongs to a rank."""
    global _FAULTS, _DIR, _RANK, _RANK_PID
    spec = os.environ.get("TIERSTACK_FAULTS")
    if not spec or "RANK" not in os.environ or _FAULTS:
        return
    _FAULTS = json.loads(spec)
    _DIR = os.environ["TIERSTACK_FAULT_DIR"]
    _RANK = int(os.environ["RANK"])
    # The first process of a rank records its pid; forked and spawned children inherit it.
    os.environ.setdefault("TIERSTACK_FAULT_RANK_PID", str(os.getpid()))
    _RANK_PID = int(os.environ["TIERSTACK_FAULT_RANK_PID"])
    builtins.open = io.open = _wrap_open(io.open)
    os.open = _wrap_os_open(_os_open)  # tierstack's LOCAL file writer (local_file.write) uses os.open
    os.rename = _wrap_paths(os.rename, "rename", 2)
    os.replace = _wrap_paths(os.replace, "rename", 2)
    os.unlink = _wrap_paths(os.unlink, "remove", 1)
    os.remove = _wrap_paths(os.remove, "remove", 1)
    shutil.rmtree = _wrap_paths(shutil.rmtree, "remove", 1)


def first_fired_at(fault_dir, fid: str) -> float:
    """Unix time at which fault ``fid`` first fired."""
    for line in open(os.path.join(fault_dir, "fired.log")).read().splitlines():
        if line.split(" ", 1)[0] == fid:
            return float(line.split(" ", 4)[3])
    raise KeyError(fid)


def fired(fault_dir) -> list[tuple[str, int, str]]:
    """``(id, rank, path)`` of every firing so far."""
    log = os.path.join(fault_dir, "fired.log")
    if not os.path.exists(log):
        return []
    out = []
    for line in open(log).read().splitlines():
        fid, rank, _pid, _t, path = line.split(" ", 4)
        out.append((fid, int(rank), path))
    return out
