"""What NVRx's hang protection is told about an in-process rank (:mod:`tierstack.resiliency.in_process`):
that its process runs, even while its main thread is blocked in a collective."""

from __future__ import annotations

import threading
import time
from typing import Callable


class Liveness:
    """What NVRx's hang protection (soft and hard timeouts) is told about this rank: that its
    process runs. A thread sends NVRx's progress timestamp every ``interval_s`` seconds.

    Why: NVRx's own watchdog stamps progress through ``Py_AddPendingCall``, which runs only while
    the main thread executes Python. With NCCL the main thread goes on while a collective waits on
    the GPU; with gloo it blocks inside the collective. So a healthy rank waiting in an all-reduce
    for a stopped peer looked as hung as the peer: both reached the hard timeout together, and
    NVRx killed the healthy rank too (seen here: the SIGSTOP scenario failed 1 run in 3). A
    stopped or frozen process runs no thread, so it is still found within
    ``resiliency.heartbeat_timeout_s``; a collective that never returns is bounded by
    ``distributed.timeout_s``, like any collective.

    NVRx's own thread goes on sending too, and what it sends carries the time its last pending call
    ran in the main thread (``ProgressWatchdog.run``): while the main thread is blocked, that time
    is old, and the monitor process judges the last message it read. So the watchdog's ``send`` is
    wrapped to carry the newest of the two times: without it, spares waiting for a rank (their main
    thread in a store wait) and healthy ranks inside a collective still reached the soft timeout
    now and then (seen in the goodput benchmark: 2 restarts no rank had asked for in 40 s, with 3
    spares on 2 cores).

    Except after an abort: while ``vouch()`` is false (an in-process restart's abort began in this
    attempt), the thread vouches for nothing, until it is true again (the next attempt). From the
    abort to NVRx's restart barrier the main thread must leave its work, running Python; one that
    stays blocked in C (a process-group creation waiting for a peer that is gone: a break-it pass
    saw a rank wait there for ``distributed.timeout_s``, 4 minutes, and the job with it) now meets
    NVRx's hard timeout like a hung rank: it is terminated and replaced (a spare, or the
    launcher's restart) about ``resiliency.heartbeat_timeout_s`` x 1.5 after the abort.

    Args:
        watchdog: NVRx's ``ProgressWatchdog`` of the rank (``CallWrapper.progress_watchdog``).
        interval_s: seconds between two progress messages of this thread.
        vouch: whether the process may be vouched for now (default: always).
    """

    def __init__(self, watchdog, interval_s: float, vouch: Callable[[], bool] = lambda: True) -> None:
        self._alive = time.monotonic()
        self._interval_s = interval_s
        self._vouch = vouch
        send = watchdog.send

        def send_newest() -> None:
            ts = watchdog.timestamp
            if ts.auto is None or ts.auto < self._alive:
                ts.auto = self._alive
            send()

        watchdog.send = send_newest  # the instance's: NVRx calls self.send()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(watchdog,), name="tierstack-liveness", daemon=True)
        self._thread.start()

    def _run(self, watchdog) -> None:
        while not self._stop.wait(self._interval_s):
            if self._vouch():
                self._alive = time.monotonic()
                watchdog.reset()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
