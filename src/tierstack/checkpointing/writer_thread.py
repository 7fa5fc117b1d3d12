"""One daemon thread that runs submitted jobs in order: the writer of a tier's staged saves and the
thread that deletes its old checkpoints (:mod:`tierstack.checkpointing.staging`)."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable


class WriterThread:
    """One daemon thread running submitted jobs in order, each with its ``Future``.

    A daemon thread rather than ``ThreadPoolExecutor``'s: a thread cannot be killed, and the pool's
    threads are joined at interpreter exit, so one stuck in a write (a hung file system) would keep
    the process from ever exiting. :meth:`Stager.close` still joins a healthy writer.
    """

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to whoever finalizes the save
                future.set_exception(e)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool) -> None:
        self._jobs.put(None)
        if wait:
            self._thread.join()
