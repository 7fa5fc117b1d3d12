"""Heartbeats to nvidia-resiliency-ext's rank monitor, when the ranks run under ``ft_launcher``.

``ft_launcher`` (NVRx fault tolerance; torchrun's arguments plus ``--ft-*``) starts a rank monitor
beside each rank and sets ``FT_RANK_MONITOR_IPC_SOCKET`` in the rank's environment. A rank that
stops sending heartbeats for ``--ft-rank-heartbeat-timeout`` seconds (``--ft-initial-rank-heartbeat-timeout``
before the first one: imports, setup, resume) is considered hung, is killed, and the job restarts
(``--max-restarts``), resuming from its newest checkpoint. This catches what an error cannot: a
stuck collective or a hung file system. The training loop sends one heartbeat per iteration;
outside ``ft_launcher`` nothing is sent and nothing is imported.

Probed on this CPU (gloo) stack with nvidia-resiliency-ext 0.4.1: a rank that stops at an iteration
is detected within the heartbeat timeout, SIGKILLed, and the worker group restarts (the NIC health
check disables itself without GPUs, with an error line per rank that can be ignored).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

log = logging.getLogger(__name__)

IPC_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # nvidia_resiliency_ext.fault_tolerance.data


class Heartbeat:
    """This rank's connection to its NVRx rank monitor (``RankMonitorClient``).

    Use :meth:`from_environment`; :meth:`beat` after each iteration; :meth:`close` at the end.
    """

    def __init__(self, client) -> None:
        self._client = client

    @classmethod
    def from_environment(cls) -> Optional["Heartbeat"]:
        """Connect to the rank monitor when ``ft_launcher`` started this rank; None otherwise.

        Raises:
            nvidia_resiliency_ext RankMonitorClientError: the monitor the environment names cannot
                be reached (the launcher is broken: better to stop than to run unmonitored).
        """
        if not os.environ.get(IPC_SOCKET_ENV):
            return None
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        client = RankMonitorClient()
        client.init_workload_monitoring()
        if int(os.environ.get("RANK", "0")) == 0:
            log.info("fault tolerance: heartbeats to the nvidia-resiliency-ext rank monitor after every iteration")
        return cls(client)

    def beat(self) -> None:
        """One heartbeat (an IPC message to the monitor; microseconds)."""
        self._client.send_heartbeat()

    def close(self) -> None:
        """Stop monitoring (the monitor then does not treat the end of the rank as a hang). Idempotent."""
        client, self._client = self._client, None
        if client is None:
            return
        try:
            client.shutdown_workload_monitoring()
        except OSError as e:  # the monitor went first (the launcher is stopping)
            log.debug("fault tolerance: closing the rank monitor connection: %r", e)
