"""The store NVRx's in-process restart runs on: the job's TCP store under this start's prefix.

NVRx builds one in each rank and one in each rank's monitor process from ``store_kwargs``, so
what it needs is a class (``inprocess.Wrapper(store_factory=...)``).

It also carries the fixes of two defects of nvidia-resiliency-ext 0.7, both in
``inprocess/sibling_monitor.py``, ``terminate_unresponsive_ranks`` (run by a rank's monitor process
when it finds its sibling rank without heartbeats):

1. It enters the termination barrier with ``get_initial_ranks``' raw store values, bytes such as
   ``b'1'``; the barrier writes them as the text ``"b'1'"`` into its key, and every later
   ``termination_barrier`` of the job (each rank's ``Wrapper`` shutdown at the end of the run)
   fails parsing it: ``ValueError: invalid literal for int() with base 10: "b'1'"``. A busy 2-core
   CI machine, where a heartbeat arrived late, ended a finished run with exit status 1 that way.
   :meth:`JobStore.termination_barrier` passes ints.
2. ``get_initial_ranks`` waits for the unresponsive rank's ``initial_rank_<r>`` key of the
   iteration, which that rank writes when it starts the iteration. A rank killed during a restart,
   before it wrote it (a second fault while the first one was recovered), never does: the monitor
   thread waited for the store's whole timeout (minutes). At the next restart its monitor process
   waits for that thread (``SiblingMonitor.shutdown``, up to the heartbeat timeout) before it
   starts the new iteration's heartbeats, so the healthy rank it watches was itself found
   unresponsive and discarded: 3 of 5 runs with both original ranks killed 0.5 s apart ended the
   job (py-spy of the monitor process: ``shutdown`` joining a thread in ``get_initial_ranks``).
   :meth:`JobStore.multi_get` waits at most :data:`INITIAL_RANK_WAIT_S` for those keys and reads a
   missing one as ``-1``, which the termination barrier leaves out (the dead rank's own monitor
   process enters that barrier for it when it sees the process gone).

For that second fix the store is a Python store (:class:`~tierstack.runtime.attempt_store.DelegatingStore`
over a prefix of a TCP store client), so NVRx's per-iteration ``PrefixStore`` over it reaches
:meth:`JobStore.multi_get`.
"""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta

import torch.distributed as dist
from nvidia_resiliency_ext.inprocess.store import StoreMixin

from tierstack.runtime.attempt_store import DelegatingStore

INITIAL_RANK_WAIT_S = 1.0  # how long a read of initial-rank keys waits for one that is missing
_INITIAL_RANK_KEY = re.compile("(^|/)" + re.escape(StoreMixin.INITIAL_RANK).replace(r"\{rank\}", r"\d+") + "$")


class JobStore(DelegatingStore, StoreMixin):
    """NVRx's store mixin over a client of the job's TCP store (``MASTER_ADDR``/``MASTER_PORT``),
    its keys under ``prefix + "nvrx/"``.

    Args:
        prefix: this start's prefix in the job store (``in_process._job_store``).
        timeout_s: seconds a store operation waits (the barrier timeout).
    """

    def __init__(self, prefix: str, timeout_s: float):
        self.tcp = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                                 is_master=False, timeout=timedelta(seconds=timeout_s))
        super().__init__(dist.PrefixStore(prefix + "nvrx/", self.tcp))

    def termination_barrier(self, ranks, *args, **kwargs):
        """NVRx's termination barrier with ``ranks`` as ints (``b'1'`` -> 1), less the ``-1`` of an
        initial rank that was never written (see the module)."""
        ranks = [int(r) for r in ranks]
        return StoreMixin.termination_barrier(self, [r for r in ranks if r >= 0], *args, **kwargs)

    def multi_get(self, keys):
        """The values of ``keys``; for initial-rank keys only (``get_initial_ranks``), a key still
        missing after :data:`INITIAL_RANK_WAIT_S` reads as ``b"-1"`` instead of waiting for the
        store's timeout (see the module)."""
        keys = list(keys)
        if not keys or not all(_INITIAL_RANK_KEY.search(k) for k in keys):
            return self.inner.multi_get(keys)
        deadline = time.monotonic() + INITIAL_RANK_WAIT_S
        while not self.inner.check(keys) and time.monotonic() < deadline:
            time.sleep(0.01)
        return [self.inner.get(k) if self.inner.check([k]) else b"-1" for k in keys]

    # The rest as :class:`DelegatingStore` does it, and NVRx's extended operations too.
    def append(self, key, value):
        self.inner.append(key, value)

    def multi_set(self, keys, values):
        self.inner.multi_set(list(keys), list(values))
