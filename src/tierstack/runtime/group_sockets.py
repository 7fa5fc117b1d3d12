"""Closing the connections of this process's gloo groups at an abort, whoever still refers to them.

Why. A gloo collective cannot be aborted: a rank blocked in one (in C, where no interruption
reaches it) comes back only when a peer's connection closes. :func:`~tierstack.runtime.distributed.
release_distributed` destroys the process groups at the in-process restart's abort, but destroying
a group only drops c10d's reference to it; its connections close when the last reference goes,
and while the aborted attempt's main thread still runs, its model and frames refer to the groups
(megatron-core modules keep their tensor-parallel group). Measured (torch 2.13, gloo, 2 ranks): a
rank whose peer destroyed a group it still referred to stayed blocked in ``all_reduce`` until the
peer's process exited; under in-process restart, when a spare died (or hung) while the two active
ranks were in a tensor-parallel ``all_reduce``, the rank NVRx interrupted first released its groups
and its peer stayed blocked until NVRx's hard timeout killed it: a healthy process and a spare lost
to someone else's fault. gloo's own ``abort()`` and ``shutdown()`` leave the connections open too
(same measurement).

How. Every process group built in this process is watched while it is built
(``torch.distributed.distributed_c10d._new_process_group_helper``, through which ``init_process_group``
and ``new_group`` build every group): the network sockets that appear during that call are the
group's (gloo connects its full mesh there; ``TORCH_GLOO_LAZY_INIT`` is not used). :func:`shut_down`
shuts down (``shutdown(SHUT_RDWR)``, not ``close``: the descriptors stay gloo's) each of them that is
still the same socket and connected, so both this rank's and its peers' pending gloo operations fail
at once. The store's connections (made before any group) and listening sockets are never touched.
On a GPU, NCCL communicators are not sockets of this kind (they are aborted by their own API);
megatron-core's gloo groups there are covered the same way.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from typing import Callable

NETWORK = (socket.AF_INET, socket.AF_INET6)  # the families of a TCP/UDP socket
_lock = threading.Lock()
_owned: dict[int, int] = {}  # descriptor -> socket inode, of the sockets opened while a group was built
_original: "Callable | None" = None  # torch's _new_process_group_helper, once wrapped


def open_sockets() -> set[tuple[int, int]]:
    """``(descriptor, inode)`` of each socket this process has open, of every family (Linux:
    ``/proc/self/fd``; elsewhere an empty set)."""
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc (not Linux): nothing is watched
        return set()
    out = set()
    for fd in fds:
        try:
            st = os.fstat(fd)
        except OSError:  # the listing's own descriptor, or one closed meanwhile
            continue
        if stat.S_ISSOCK(st.st_mode):
            out.add((fd, st.st_ino))
    return out


def install() -> None:
    """Watch every process group built from now on in this process (idempotent; thread-safe)."""
    global _original
    from torch.distributed import distributed_c10d as c10d

    with _lock:
        if _original is not None:
            return
        _original = c10d._new_process_group_helper

        def watched(*args, **kwargs):
            before = open_sockets()
            try:
                return _original(*args, **kwargs)
            finally:
                new = open_sockets() - before
                with _lock:
                    _owned.update(new)

        c10d._new_process_group_helper = watched


def uninstall() -> None:
    """Stop watching (tests): torch's own function again, nothing remembered."""
    global _original
    from torch.distributed import distributed_c10d as c10d

    with _lock:
        if _original is not None:
            c10d._new_process_group_helper = _original
            _original = None
        _owned.clear()


def shut_down() -> int:
    """Shut down every connection of the groups built so far (see the module docstring), from any
    thread, never raising; forget them. Returns how many connections were shut down."""
    with _lock:
        owned = dict(_owned)
        _owned.clear()
    done = 0
    for fd, inode in owned.items():
        try:
            if os.fstat(fd).st_ino != inode:  # closed since, and the number reused: not ours any more
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            if sock.family in NETWORK:
                sock.getpeername()  # a listening socket has none (OSError): left alone
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the descriptor stays gloo's to close
    return done
