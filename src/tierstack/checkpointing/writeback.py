"""Start the disk writes of a checkpoint file while it is still being written.

A buffered write only copies bytes into the page cache; Linux starts writing them to the disk when
the dirty pages pass ``vm.dirty_background_ratio`` (10% of memory by default) or age past
``vm.dirty_expire_centisecs`` (30 s). A checkpoint file of a few GiB on a machine with tens of GiB
stays under both, so the disk idles while the file is written and all of the I/O waits for the
final ``fsync``: write time plus disk time. :class:`EarlyWriteback` asks the kernel every
``interval_s`` to start writing out what is dirty so far (``sync_file_range(SYNC_FILE_RANGE_WRITE)``,
which starts the write-out and returns at once), so the disk works while the writer copies and the
``fsync`` waits only for the tail: about the larger of the two instead of their sum.

It never replaces the fsync that makes the file durable, and it changes no byte of the file: a
failed or unsupported call (no ``sync_file_range`` in this libc, a file system that refuses it) only
leaves the kernel's default behaviour. Source of the calls' semantics: sync_file_range(2),
posix_fadvise(2) and Documentation/admin-guide/sysctl/vm.rst of the Linux kernel.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start write-out of dirty pages not already under write-out
INTERVAL_S = 0.05  # how often the dirty pages written so far are handed to the disk


def _load_sync_file_range():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):  # not Linux/glibc: the kernel's default writeback
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


class EarlyWriteback:
    """Context manager around the write of one file at ``path`` (created by the writer, possibly
    after this starts): a daemon thread starts the write-out of its dirty pages every
    ``interval_s`` seconds until the block ends. Errors of the calls are not errors of the save
    (the writer's own write and fsync report those); the first one ends the thread's work.

    Args:
        path: the file being written.
        interval_s: seconds between calls (each costs one syscall).
    """

    def __init__(self, path: Path, interval_s: float = INTERVAL_S):
        self.path = str(path)
        self.interval_s = interval_s
        self.calls = 0  # sync_file_range calls made (for tests)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "EarlyWriteback":
        if _sync_file_range is not None:
            self._thread = threading.Thread(target=self._run, name="tierstack-writeback", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        fd = None
        try:
            while not self._stop.wait(self.interval_s):
                if fd is None:
                    try:
                        fd = os.open(self.path, os.O_RDONLY)
                    except FileNotFoundError:  # the writer has not created it yet
                        continue
                if _sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE) != 0:
                    log.debug("sync_file_range on %s: errno %d; the kernel's default writeback",
                              self.path, ctypes.get_errno())
                    return
                self.calls += 1
        except OSError as e:  # e.g. the directory was removed under a dropped save
            log.debug("early writeback of %s stopped: %s", self.path, e)
        finally:
            if fd is not None:
                os.close(fd)
