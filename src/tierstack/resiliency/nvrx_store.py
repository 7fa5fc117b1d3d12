"""The store NVRx's in-process restart runs on: the job's TCP store under this start's prefix.

NVRx builds one in each rank and one in each rank's monitor process from ``store_kwargs``, so
what it needs is a class (``inprocess.Wrapper(store_factory=...)``).

It also carries the fix of a defect of nvidia-resiliency-ext 0.7 (``inprocess/sibling_monitor.py``,
``terminate_unresponsive_ranks``): when a monitor finds a sibling rank unresponsive it enters the
termination barrier with ``get_initial_ranks``' raw store values, bytes such as ``b'1'``; the
barrier writes them as the text ``"b'1'"`` into its key, and every later ``termination_barrier``
of the job (each rank's ``Wrapper`` shutdown at the end of the run) fails parsing it:
``ValueError: invalid literal for int() with base 10: "b'1'"``. A busy 2-core CI machine, where
a heartbeat arrives late, ended a finished run with exit status 1 that way.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
from nvidia_resiliency_ext.inprocess.store import StoreMixin


class JobStore(dist.PrefixStore, StoreMixin):
    """NVRx's store mixin over a client of the job's TCP store (``MASTER_ADDR``/``MASTER_PORT``),
    its keys under ``prefix + "nvrx/"``.

    Args:
        prefix: this start's prefix in the job store (``in_process._job_store``).
        timeout_s: seconds a store operation waits (the barrier timeout).
    """

    def __init__(self, prefix: str, timeout_s: float):
        tcp = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                            is_master=False, timeout=timedelta(seconds=timeout_s))
        super().__init__(prefix + "nvrx/", tcp)
        self.tcp = tcp

    def termination_barrier(self, ranks, *args, **kwargs):
        """NVRx's termination barrier with ``ranks`` as ints (``b'1'`` -> 1; see the module)."""
        return StoreMixin.termination_barrier(self, [int(r) for r in ranks], *args, **kwargs)
