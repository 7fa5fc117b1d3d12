"""What a forked helper process (a DataLoader worker) must not keep of its parent: its network sockets.

A process forked from a rank holds a copy of every file descriptor the rank had open, the TCP
connections of its gloo process groups and of the job's store included. A connection only closes
when every process holding it closes its copy. When a rank fails and releases its groups (the
in-process restart's abort), or dies, its peers blocked in a gloo collective with it fail at once
because the connection closes (:func:`tierstack.runtime.distributed.release_distributed`); while a
forked worker still holds it, it does not, and they wait in C, where no interruption reaches them.
Measured with ``dataset.num_workers=2`` and ``resiliency.restart=in-process``: a rank that raised
after step 1 left its peer blocked in the step's ``all_reduce`` until NVRx's hard timeout killed it
(the restart became the launcher's), in 2 of 2 runs.
"""

from __future__ import annotations

import socket

from tierstack.runtime.group_sockets import NETWORK, open_sockets


def close_inherited_network_sockets(_worker_id: int = 0) -> int:
    """Close this process's copies of the TCP/UDP sockets it inherited (IPv4 and IPv6); returns how
    many. Only this process's descriptors are closed (``close``, never ``shutdown``): the parent's
    connections stay open for the parent. Unix-domain sockets and every other descriptor are kept.

    Meant to run first in a process forked from a rank (``DataLoader(worker_init_fn=...)``: the
    ``_worker_id`` argument is the DataLoader's), before it opens sockets of its own.
    """
    closed = 0
    for fd, _ in open_sockets():
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # closed meanwhile
            continue
        if sock.family in NETWORK:
            sock.close()
            closed += 1
        else:
            sock.detach()  # not ours to close
    return closed
